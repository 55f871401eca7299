"""protos."""
