"""``python -m vramshare_cli``: the ``vramshare`` command."""
import sys

from vramshare_cli.main import main

sys.exit(main())
