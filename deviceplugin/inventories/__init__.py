"""Packaged simulated GPU inventories (YAML) for ``vramshare demo`` and ``--backend simulated``."""
