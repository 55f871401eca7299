"""Tests of the Kubernetes API server double, through the real kubernetes client."""
