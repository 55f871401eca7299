"""Tests of the device plugin."""
