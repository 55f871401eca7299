"""vramshare: share GPUs between Kubernetes inference pods by memory.

The shared core lives here: the contract between the parts (``contract``), the GPU inventory model
(``inventory``), the versioned configuration (``config``) and structured logging (``logs``).
``deviceplugin``, ``extender`` and ``vllm_patches`` build on it and never on each other's insides; the
stand-ins and demo (``standins``) and the ``vramshare`` command (``vramshare_cli``) sit above them. The
core imports nothing of ours above it (tests/test_layering.py).
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
