"""Generated kubelet API code; regenerate with python -m protos.generate."""
