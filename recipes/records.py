"""The first bad record of local ``.json`` / ``.jsonl`` files, by file and line.

``datasets``' json builder reports a malformed line as a ``DatasetGenerationError`` with
the row deep in the traceback, and fills a record's missing field with None (rows the
recipe would then drop without a word). ``recipes.corpus.load_local`` loads first and
only reads the files again through here when something went wrong, so a good corpus
costs nothing extra. Errors are ``ValueError`` naming ``FILE:LINE`` (JSON lines) or
``FILE record N`` (a JSON array).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _malformed(where: str, e: json.JSONDecodeError) -> ValueError:
    return ValueError(f"{where}: malformed JSON ({e.msg}, column {e.colno})")


def records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` for each record of a JSON-lines file or a JSON array file;
    ``ValueError`` naming the line at the first malformed one."""
    with open(path, encoding="utf-8") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if head.startswith("["):
            try:
                array = json.load(f)
            except json.JSONDecodeError as e:
                raise _malformed(f"{path}:{e.lineno}", e) from None
            for i, rec in enumerate(array if isinstance(array, list) else [array], 1):
                yield f"{path} record {i}", rec
            return
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                raise _malformed(f"{path}:{n}", e) from None
            yield f"{path}:{n}", rec


def _problem(rec: Any, text_field: str) -> str | None:
    if not isinstance(rec, dict):
        return f"a record must be a JSON object, got {type(rec).__name__}"
    if rec.get(text_field) is None:
        return f"the record has no data.text_field={text_field!r} (keys: {sorted(rec)})"
    if not isinstance(rec[text_field], str):
        return f"data.text_field={text_field!r} must hold a string, got {rec[text_field]!r:.60}"
    return None


def check_records(files: list[str], text_field: str, where: str) -> None:
    """Raise ``ValueError`` (``where: FILE:LINE: ...``) at the first record of ``files`` that
    is malformed, not an object, or has no string ``text_field``, with the count of such
    records; return if every record is fine."""
    first, bad, total = None, 0, 0
    for path in files:
        try:
            for at, rec in records(path):
                total += 1
                problem = _problem(rec, text_field)
                if problem is not None:
                    bad += 1
                    first = first or f"{at}: {problem}"
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if first is not None:
        raise ValueError(
            f"{where}: {first} ({bad} of {total} records have this kind of problem; every "
            "record needs a string in data.text_field)"
        )
