"""vramshare tests."""
