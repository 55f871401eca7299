"""vllm_patches."""
