"""The torchtitan that matches a torch (issue 39 item 14): 0.3.0 needs torch >= 2.12 (it
imports ``DataParallelMeshDims`` from ``torch.distributed.fsdp``); an older torch gets 0.2.2
(it imports on torch 2.11). galore2's integration works with both
(docs/guides/torchtitan.md).

    python -m benchmarks.torchtitan_wheel               # for the installed torch
    python -m benchmarks.torchtitan_wheel 2.11.0+cu126  # for that one

Prints the version; benchmarks/gpu_session.sh installs the wheels that
benchmarks/gpu_wheels.sh downloaded into ``.whl/torchtitan-<version>/``.
"""

from __future__ import annotations

import re
import sys

#: torchtitan versions, newest first, with the oldest torch (major, minor) each imports on
TORCHTITAN = (("0.3.0", (2, 12)), ("0.2.2", (0, 0)))


def pick(torch_version: str) -> str:
    """The torchtitan version for ``torch_version`` (``"2.11.0+cu126"``, ``"2.12.0.dev…"``).

    Raises:
        ValueError: a version that does not start with ``major.minor``.
    """
    found = re.match(r"(\d+)\.(\d+)", torch_version)
    if found is None:
        raise ValueError(f"torch version {torch_version!r} does not start with major.minor")
    have = (int(found[1]), int(found[2]))
    return next(version for version, needs in TORCHTITAN if have >= needs)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args:
        torch_version = args[0]
    else:
        import torch

        torch_version = torch.__version__
    print(pick(torch_version))
    return 0


if __name__ == "__main__":
    sys.exit(main())
