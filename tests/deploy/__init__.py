"""Tests of the deployment manifests."""
