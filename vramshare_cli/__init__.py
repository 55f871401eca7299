"""The ``vramshare`` command's composition: the top layer.

``main`` holds the parser and hands each subcommand to its daemon or tool; ``install``, ``check_cmd``,
``checks``, ``kustomize``, ``certs`` and ``traces_download`` are the commands that are neither daemon
nor stand-in. Imports the core (``vramshare``), the daemons and the stand-ins; nothing imports it.
"""
