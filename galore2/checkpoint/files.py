"""Checksums of a checkpoint's files: damaged bytes are found before DCP reads them.

DCP stores each tensor as a ``torch.save`` record whose CRC nobody checks on load, so
a changed byte inside a tensor loads silently. At save time every file of the folder gets
its size and CRC-32 recorded (each rank reads its share of the files, which are still in
the page cache); at load time the same split verifies them. A truncated file or a missing
``.metadata`` is found from the sizes alone.
"""

from __future__ import annotations

import zlib
from pathlib import Path

from . import _dist
from .errors import CheckpointCorrupt

_CHUNK = 16 << 20


def crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def fingerprint(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, list[int]]:
    """``{name: [size, crc32]}`` of every file in ``folder`` (collective: ranks split the work)."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name not in skip)
    mine = {
        n: [(folder / n).stat().st_size, crc32(folder / n)]
        for n in names[_dist.rank() :: _dist.world()]
    }
    out: dict[str, list[int]] = {}
    for part in _dist.gather(mine):
        out.update(part)
    return dict(sorted(out.items()))


def verify(folder: Path, files: dict[str, list[int]], checksums: bool = True) -> None:
    """Raise :class:`CheckpointCorrupt` naming each file that is missing, of another size or
    (``checksums``) of another CRC-32 than recorded (collective: ranks split the work)."""
    names = sorted(files)
    problems = []
    for n in names:  # sizes on every rank: cheap, and every rank then agrees
        path = folder / n
        size = path.stat().st_size if path.is_file() else None
        if size is None:
            problems.append(f"{n} is missing")
        elif size != files[n][0]:
            problems.append(f"{n} has {size} bytes, {files[n][0]} written")
    if checksums and not problems:
        mine = [n for n in names[_dist.rank() :: _dist.world()] if crc32(folder / n) != files[n][1]]
        problems = [
            f"{n} has changed bytes (CRC-32 differs)" for part in _dist.gather(mine) for n in part
        ]
    if problems:
        raise CheckpointCorrupt(
            f"checkpoint {folder} is damaged: {'; '.join(sorted(problems))}", folder
        )
