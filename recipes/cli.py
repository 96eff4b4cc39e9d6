"""Command-line entry points: one clear line for a user error, the traceback on request.

``python -m recipes.<tool>`` runs its ``main(argv)`` through :func:`run_cli`. A user
error (a bad setting, a missing file, data that cannot be read: :data:`USER_ERRORS`)
prints ``error: MESSAGE`` on stderr and exits 2; a run stopped because it diverged
(:class:`recipes.divergence.Diverged`) prints the same way and exits 1. ``--debug``
anywhere on the command line (it is taken out before ``main`` sees the arguments), or
``GALORE2_DEBUG=1``, shows the full traceback instead. ``main(argv)`` called from Python
raises as usual.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from galore2.checkpoint import CheckpointError

from .divergence import Diverged

#: a bad setting, a missing file, data that cannot be read, an out dir that is a file or
#: holds another run or is in use by another process, a folder we may not write into, a
#: checkpoint that cannot be read or written (UnicodeDecodeError is a ValueError)
USER_ERRORS = (
    CheckpointError,
    ValueError,
    TypeError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    PermissionError,
)
DEBUG_FLAG, DEBUG_ENV = "--debug", "GALORE2_DEBUG"
DEBUG_HELP = "errors print one line; --debug (or GALORE2_DEBUG=1) shows the full traceback"


def debugging(argv: list[str]) -> bool:
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def run_cli(main: Callable[[list[str]], Any], argv: list[str] | None = None) -> None:
    """``main(argv)`` (default: ``sys.argv[1:]``) with errors reported as described above."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debugging(argv)
    try:
        main([a for a in argv if a != DEBUG_FLAG])
    except (*USER_ERRORS, Diverged) as e:
        if debug:
            raise
        world = int(os.environ.get("WORLD_SIZE", "1"))
        where = f" (rank {os.environ.get('RANK', '?')})" if world > 1 else ""
        print(f"error{where}: {e}", file=sys.stderr, flush=True)
        sys.exit(1 if isinstance(e, Diverged) else 2)
