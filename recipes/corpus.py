"""Where the recipe's text comes from: the embedded corpus, local files, or the hub.

``data.dataset`` selects the source:

* ``"embedded"`` – English documentation text that ships with CPython itself
  (:func:`embedded_documents`); needs no download and no files in this repository.
* a local ``.txt``, ``.jsonl`` or ``.json`` file, or a folder holding files of one
  of those kinds (:func:`load_local`). A ``.txt`` file is read with one document per
  *paragraph* (text between empty lines, ``"\n\n"``), so prose files need no
  conversion; a file with one document per line should be written as ``.jsonl``.
  ``.jsonl``/``.json`` files (JSON lines or a JSON array of records) take each
  record's ``data.text_field``; a malformed record, or one without a string in that
  field, is a ``ValueError`` naming the file and line (recipes/records.py).
* anything else – a Hugging Face hub dataset name (:func:`open_hub`), which needs
  network access or a warm cache.

Local files and non-streamed hub datasets come back as a ``datasets.Dataset`` with
a single ``"text"`` column; streamed hub datasets as a ``datasets.IterableDataset``
whose rows carry ``data.text_field``.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import importlib
import inspect
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .records import check_records

# Local file suffix → ``datasets`` builder that reads it.
LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json"}

# Modules whose docstrings form the fallback corpus when ``pydoc_data`` is missing.
# fmt: off
FALLBACK_MODULES = (
    "json", "argparse", "collections", "functools", "itertools", "re", "os", "pathlib",
    "subprocess", "typing", "dataclasses", "logging", "unittest", "asyncio",
)
# fmt: on

_BLANK_LINE = re.compile(r"\n[ \t]*\n")


def split_paragraphs(text: str) -> list[str]:
    """Blocks of ``text`` separated by blank lines, trailing whitespace removed, empties dropped."""
    paragraphs = (p.strip("\n").rstrip() for p in _BLANK_LINE.split(text.replace("\r\n", "\n")))
    return [p for p in paragraphs if p.strip()]


def group_paragraphs(paragraphs: list[str], target_chars: int, min_chars: int) -> list[str]:
    """Join consecutive paragraphs (with a blank line) into documents of ≥ ``target_chars``.

    A trailing remainder shorter than ``min_chars`` is appended to the previous
    document, or dropped when there is none (tiny fragments are not documents).
    """
    docs: list[str] = []
    current: list[str] = []
    size = 0
    for p in paragraphs:
        current.append(p)
        size += len(p) + 2
        if size >= target_chars:
            docs.append("\n\n".join(current))
            current, size = [], 0
    if current:
        rest = "\n\n".join(current)
        if len(rest) >= min_chars:
            docs.append(rest)
        elif docs:
            docs[-1] = docs[-1] + "\n\n" + rest
    return docs


def _to_documents(sections: list[str], target_chars: int, min_chars: int) -> list[str]:
    docs: list[str] = []
    for section in sections:
        docs.extend(group_paragraphs(split_paragraphs(section), target_chars, min_chars))
    return docs


def fallback_sections() -> list[str]:
    """Docstrings of :data:`FALLBACK_MODULES` and their public classes and functions.

    Deterministic (modules in the fixed order, members sorted by name, duplicates
    skipped). Empty under ``python -OO``, which strips docstrings.
    """
    sections: list[str] = []
    seen: set[str] = set()

    def add(title: str, doc: Any) -> None:
        if isinstance(doc, str) and doc.strip():
            text = inspect.cleandoc(doc)
            if text not in seen:
                seen.add(text)
                sections.append(f"{title}\n\n{text}")

    with warnings.catch_warnings():  # some members (typing.io, ...) warn when touched
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in FALLBACK_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:  # pragma: no cover - all are stdlib
                continue
            add(f"Module {name}", module.__doc__)
            for attr, obj in sorted(vars(module).items()):
                if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
                    continue
                if str(getattr(obj, "__module__", "") or "").split(".")[0] != name:
                    continue  # re-exported from elsewhere
                add(f"{name}.{attr}", obj.__doc__)
    return sections


def pydoc_sections() -> list[str]:
    """The CPython documentation topics (``pydoc_data.topics``), sorted by topic name.

    Raises ``ImportError`` where a distribution leaves ``pydoc_data`` out.
    """
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


@functools.lru_cache(maxsize=4)
def embedded_documents(
    target_chars: int = 600, min_chars: int = 100, use_pydoc: bool = True
) -> tuple[str, ...]:
    """The embedded corpus as documents, always in the same order.

    The source is CPython's own documentation: the ~80 ``pydoc_data`` topics
    (~465K characters of English prose, grammar and examples) or, if that module is
    missing (or ``use_pydoc=False``), the docstrings from :func:`fallback_sections`.
    Each topic is split into paragraphs and consecutive paragraphs are joined
    into documents of at least ``target_chars`` characters; documents never cross
    topics, and repeated documents (some topics share sections) are kept once, so a
    document split cannot leak text between training and validation. Raises ``ValueError`` if no text is available (e.g. ``python -OO``
    without ``pydoc_data``).
    """
    sections: list[str] | None = None
    if use_pydoc:
        try:
            sections = pydoc_sections()
        except ImportError:
            sections = None
    if sections is None:
        sections = fallback_sections()
    docs = tuple(dict.fromkeys(_to_documents(sections, target_chars, min_chars)))
    if not docs:
        raise ValueError(
            "data.dataset='embedded': no text found (pydoc_data is missing and docstrings are "
            "stripped, e.g. under python -OO); use a local file or a hub dataset"
        )
    return docs


def local_files(path: str | Path) -> tuple[str, list[str]]:
    """The ``datasets`` builder and sorted file list for a local file or folder.

    A folder contributes every file (recursively, hidden files and folders excluded)
    with a supported suffix; they must all need the same builder. Raises ``ValueError`` naming ``data.dataset``
    for an unsupported suffix, a folder without usable files, or mixed kinds.
    """
    p = Path(path)
    supported = ", ".join(sorted(LOCAL_BUILDERS))
    if p.is_file():
        builder = LOCAL_BUILDERS.get(p.suffix.lower())
        if builder is None:
            raise ValueError(
                f"data.dataset={str(path)!r}: unsupported file extension {p.suffix!r} "
                f"(supported: {supported})"
            )
        return builder, [str(p)]
    files = sorted(
        f
        for f in p.rglob("*")
        if f.is_file()
        and f.suffix.lower() in LOCAL_BUILDERS
        and not any(part.startswith(".") for part in f.relative_to(p).parts)
    )
    if not files:
        raise ValueError(f"data.dataset={str(path)!r}: folder has no {supported} files")
    builders = {LOCAL_BUILDERS[f.suffix.lower()] for f in files}
    if len(builders) > 1:
        raise ValueError(
            f"data.dataset={str(path)!r}: folder mixes .txt and .json/.jsonl files; "
            "keep one kind per folder"
        )
    return builders.pop(), [str(f) for f in files]


def check_utf8(files: list[str], where: str) -> None:
    """``ValueError`` naming the first of ``files`` that is not UTF-8 text, with the byte
    offset of the first undecodable byte."""
    for path in files:
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        with open(path, "rb") as f:
            while True:
                chunk = f.read(1 << 20)
                pending = decoder.getstate()[0]  # an incomplete sequence from the last chunk
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as e:
                    bad = e.object[e.start : e.start + 1].hex()
                    raise ValueError(
                        f"{where}: {path} is not UTF-8 text (byte 0x{bad} at offset "
                        f"{offset - len(pending) + e.start}); convert it to UTF-8 "
                        "(e.g. iconv -f latin1 -t utf-8)"
                    ) from None
                if not chunk:
                    break
                offset += len(chunk)


def _text_only(ds: Any, text_field: str, where: str) -> Any:
    """Keep only ``text_field`` of a map-style dataset, renamed to ``"text"``."""
    if text_field not in ds.column_names:
        raise ValueError(
            f"{where}: no column data.text_field={text_field!r} (columns: {ds.column_names})"
        )
    ds = ds.select_columns([text_field])
    return ds if text_field == "text" else ds.rename_column(text_field, "text")


def load_local(path: str, text_field: str, cache_dir: str | None = None) -> Any:
    """A local file or folder as a ``datasets.Dataset`` with one ``"text"`` column (file order)."""
    import datasets
    import pyarrow as pa

    builder, files = local_files(path)
    where = f"data.dataset={path!r}"
    kwargs: dict[str, Any] = {"sample_by": "paragraph"} if builder == "text" else {}
    try:
        ds = datasets.load_dataset(
            builder, data_files=files, split="train", cache_dir=cache_dir, **kwargs
        )
    except datasets.exceptions.DatasetGenerationError as e:
        check_utf8(files, where)  # name the file and the place, else datasets' own cause
        if builder == "json":
            check_records(files, text_field, where)
        cause = e.__cause__ or e
        raise ValueError(f"{where}: cannot be read: {type(cause).__name__}: {cause}") from e
    if builder == "text":  # paragraphs split at "\n\n" keep stray newlines at their ends
        return ds.map(_strip_newlines, batched=True, desc="paragraphs")
    ds = _text_only(ds, text_field, where)
    column = ds.data.column("text")
    text_type = pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
    if column.null_count or not text_type:  # a record without text: never dropped silently
        check_records(files, text_field, where)
    return ds


def _strip_newlines(batch: dict[str, list[str]]) -> dict[str, list[str]]:
    return {"text": [t.strip("\n") for t in batch["text"]]}


def open_hub(
    name: str,
    config: str | None,
    split: str,
    streaming: bool,
    text_field: str,
    data_files: Any = None,
    cache_dir: str | None = None,
) -> Any:
    """``datasets.load_dataset(name, config, split=split, streaming=streaming)``.

    Streamed: an ``IterableDataset`` (rows are dicts holding ``text_field``).
    Otherwise a ``Dataset`` with one ``"text"`` column. ``data_files`` passes
    through, so a packaged builder (``"json"``, ``"text"``) with local files runs
    the same code path as a hub dataset — that is how the tests cover streaming.
    """
    import datasets

    ds = datasets.load_dataset(
        name,
        config,
        split=split,
        streaming=streaming,
        data_files=data_files,
        cache_dir=cache_dir,
    )
    if streaming:
        return ds
    return _text_only(ds, text_field, f"data.dataset={name!r}")


def open_source(cfg: Any, cache_dir: str | None = None) -> Any:
    """The documents named by ``cfg`` (a ``DataConfig``), as described in the module docstring.

    Returns a tuple of texts (embedded), a ``datasets.Dataset`` with a ``"text"``
    column (local files; hub with ``streaming=false``) or a ``datasets.IterableDataset``
    (hub, streamed). A path-like name (``/``, ``./``, ``~`` or a .txt/.json/.jsonl
    suffix) that does not exist, or files that are all empty, raise ``ValueError``.
    """
    name = cfg.dataset
    if name == "embedded":
        return embedded_documents()
    path = Path(name).expanduser()
    if path.exists():
        _, files = local_files(path)
        if all(Path(f).stat().st_size == 0 for f in files):
            raise ValueError(f"data.dataset={name!r}: the corpus is empty (all files are empty)")
        return load_local(str(path), cfg.text_field, cache_dir)
    if name.startswith(("/", "./", "../", "~")) or path.suffix.lower() in LOCAL_BUILDERS:
        raise ValueError(f"data.dataset={name!r}: no such file or folder")
    return open_hub(
        name, cfg.dataset_config, cfg.split, cfg.streaming, cfg.text_field, cache_dir=cache_dir
    )


def row_text(row: dict[str, Any], text_field: str) -> Any:
    """``row[text_field]``; ``ValueError`` naming ``data.text_field`` if it is missing."""
    if text_field not in row:
        raise ValueError(f"data.text_field={text_field!r} is not in the rows ({sorted(row)})")
    return row[text_field]


def document_digest(text: str) -> bytes:
    """A 16-byte hash identifying a document's exact text."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def stream_documents(
    dataset: Any, text_field: str, exclude: frozenset[bytes], rank: int = 0
) -> Iterator[str]:
    """The texts of an ``IterableDataset``, pass after pass without end.

    Pass ``e`` calls ``dataset.set_epoch(e)`` first (a shuffled dataset reshuffles).
    Blank texts and texts whose :func:`document_digest` is in ``exclude`` are
    skipped; a pass that yields nothing raises ``ValueError`` instead of looping.
    """
    epoch = 0
    while True:
        dataset.set_epoch(epoch)
        kept = 0
        for row in dataset:
            text = row_text(row, text_field)
            if isinstance(text, str) and text.strip() and document_digest(text) not in exclude:
                kept += 1
                yield text
        if kept == 0:
            raise ValueError(
                f"rank {rank}'s share of the streamed training documents is empty; the "
                "dataset is too small for this many ranks (or all of it is validation)"
            )
        epoch += 1
