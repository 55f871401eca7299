"""The one exception a subcommand raises for a user's mistake.

``vramshare`` prints it as one line (``vramshare <command>: <what is wrong>; <the fix>``) and exits 2;
everything else that escapes is a bug and keeps its traceback.
"""
from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(Exception):
    """A mistake the user can fix: a flag that does not apply, a missing or malformed file."""
