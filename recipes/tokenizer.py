"""Tokenizers for the pre-training recipe, all behind one small interface.

Every tokenizer returned by :func:`load_tokenizer` has

* ``eos_id: int`` – the id the packer appends after every document;
* ``vocab_size: int`` – one more than the largest id it can produce (size the
  model's embedding with at least this many rows);
* ``encode(text) -> list[int]`` and ``batch_encode(texts) -> list[list[int]]`` –
  plain tokenization: no BOS/EOS or other special tokens are added;
* ``decode(ids) -> str``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Tokenizer(Protocol):
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def batch_encode(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are the bytes, 256 is end-of-document.

    Needs no files. ``decode(encode(text)) == text`` for every string; ``decode``
    drops ``eos_id`` and replaces invalid UTF-8 (e.g. a sequence cut mid-character)
    with U+FFFD instead of raising.
    """

    eos_id = 256
    vocab_size = 257
    name = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def batch_encode(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Any) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        data = bytes(i for i in map(int, ids) if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257, eos_id=256)"


class HFTokenizer:
    """A ``transformers`` tokenizer behind the recipe's interface.

    ``eos_id`` is the tokenizer's ``eos_token_id`` and ``vocab_size`` is
    ``len(tokenizer)`` (base vocabulary plus added tokens). Encoding never adds
    special tokens (``add_special_tokens=False``), and long texts are not
    truncated: the packer cuts the token stream itself.
    """

    def __init__(self, tokenizer: Any, name: str = ""):
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"data.tokenizer={name!r} has no eos token (eos_token_id is None); the packer "
                "needs one to separate documents"
            )
        self.tokenizer = tokenizer
        self.name = name
        self.eos_id = int(tokenizer.eos_token_id)
        self.vocab_size = len(tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.batch_encode([text])[0]

    def batch_encode(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        out = self.tokenizer(
            list(texts),
            add_special_tokens=False,
            return_attention_mask=False,
            return_token_type_ids=False,
            verbose=False,
        )
        return [list(ids) for ids in out["input_ids"]]

    def decode(self, ids: Any) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def load_tokenizer(name: str) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` → :class:`ByteTokenizer`; anything else → ``AutoTokenizer.from_pretrained(name)``.

    A local tokenizer folder works offline; a hub name needs network access (or a
    warm Hugging Face cache).
    """
    if name == "byte":
        return ByteTokenizer()
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name)
    except Exception as e:
        raise ValueError(
            f"data.tokenizer={name!r}: could not load a tokenizer (use 'byte', a local folder "
            f"with tokenizer files, or a hub name while online): {e}"
        ) from e
    return HFTokenizer(tok, name)


def text_ids(tokenizer: Tokenizer) -> int:
    """One more than the largest id encoding text can produce: ``vocab_size`` without the
    special tokens at its end (T5's 100 ``<extra_id_N>`` sentinels) other than ``eos_id``,
    which the packer appends."""
    inner = getattr(tokenizer, "tokenizer", None)
    special = set(getattr(inner, "all_special_ids", ()) or ()) - {tokenizer.eos_id}
    n = tokenizer.vocab_size
    while n > 0 and n - 1 in special:
        n -= 1
    return n


def check_vocab_size(tokenizer: Tokenizer, vocab_size: int) -> None:
    """``model.vocab_size`` against the ids ``tokenizer`` produces: ``ValueError`` (before
    anything is built or deleted) when text can produce an id the embedding has no row
    for; a warning when only special tokens (T5's sentinels, never in text) lie beyond."""
    needed = text_ids(tokenizer)
    if vocab_size < needed:
        raise ValueError(
            f"model.vocab_size={vocab_size} is smaller than the ids the tokenizer produces "
            f"({tokenizer!r} encodes text to ids up to {needed - 1}): the embedding would "
            f"have no row for them. Set --model.vocab_size {tokenizer.vocab_size} (or at "
            f"least {needed})"
        )
    if vocab_size < tokenizer.vocab_size:
        warnings.warn(
            f"tokenizer has {tokenizer.vocab_size} ids; model.vocab_size={vocab_size} "
            f"covers the {needed} that text produces (the rest are special tokens)",
            stacklevel=2,
        )


# ---- packing helpers ------------------------------------------------------------------

ENCODE_CHUNK = 256  # documents per tokenizer call


def is_text(text: Any) -> bool:
    """Whether ``text`` is a non-blank string (anything else is not a document)."""
    return isinstance(text, str) and bool(text.strip())


def iter_document_tokens(tokenizer: Tokenizer, texts: Iterable[Any]) -> Iterator[list[int]]:
    """``tokens(doc) + [eos_id]`` for each non-blank document, in order (lazy, chunked)."""
    chunk: list[str] = []
    for text in texts:
        if is_text(text):
            chunk.append(text)
        if len(chunk) == ENCODE_CHUNK:
            for ids in tokenizer.batch_encode(chunk):
                yield [*ids, tokenizer.eos_id]
            chunk = []
    for ids in tokenizer.batch_encode(chunk):
        yield [*ids, tokenizer.eos_id]


def pack_documents(tokenizer: Tokenizer, texts: Iterable[Any]) -> torch.Tensor:
    """The packed token stream of ``texts`` as a 1-D ``int32`` tensor."""
    stream: list[int] = []
    for ids in iter_document_tokens(tokenizer, texts):
        stream.extend(ids)
    return torch.tensor(stream, dtype=torch.int32)


class _Encoder:
    """Batched ``datasets.map`` function: ``"text"`` → ``"input_ids"`` (+eos), blanks dropped."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        return {"input_ids": list(iter_document_tokens(self.tokenizer, batch["text"]))}


def tokenize_dataset(ds: Any, tokenizer: Tokenizer) -> Any:
    """A ``datasets.Dataset`` with a ``"text"`` column → one ``"input_ids"`` row per document.

    Runs ``ds.map(batched=True)``, so ``datasets`` caches the result next to the
    source's cache files; blank documents are dropped, order is kept.
    """
    import datasets

    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})
    return ds.map(
        _Encoder(tokenizer),
        batched=True,
        batch_size=1000,
        remove_columns=ds.column_names,
        features=features,
        desc="tokenizing",
    )


def flatten_tokens(ds: Any) -> torch.Tensor:
    """The ``"input_ids"`` rows of a tokenized dataset concatenated: a 1-D ``int32`` tensor."""
    import numpy as np
    import pyarrow.compute as pc

    column = ds.with_format("arrow")[:].column("input_ids")
    flat = pc.list_flatten(column).to_numpy()
    return torch.from_numpy(np.array(flat, dtype=np.int32))


def pack_stream(tokenizer: Tokenizer, texts: Iterable[Any], seq_len: int) -> Iterator[list[int]]:
    """The packed stream of ``texts`` cut lazily into lists of exactly ``seq_len`` ids."""
    buf: list[int] = []
    for ids in iter_document_tokens(tokenizer, texts):
        buf.extend(ids)
        start = 0
        while len(buf) - start >= seq_len:
            yield buf[start : start + seq_len]
            start += seq_len
        del buf[:start]


def num_val_documents(num_docs: int, val_fraction: float, where: str) -> int:
    """``max(1, round(num_docs·val_fraction))``; ``ValueError`` if none would be left to train."""
    n_val = max(1, round(num_docs * val_fraction))
    if num_docs == 0:
        raise ValueError(f"{where}: the corpus is empty (no non-blank documents)")
    if n_val >= num_docs:
        raise ValueError(
            f"{where}: {num_docs} document(s) leave none for training after the validation "
            f"split (data.val_fraction={val_fraction}); the corpus needs more documents"
        )
    return n_val


def split_and_pack(
    source: Any, tokenizer: Tokenizer, val_fraction: float, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (train, validation) token streams of a map-style source.

    ``source`` is a list of texts or a ``datasets.Dataset`` with a ``"text"``
    column. Blank documents are dropped, then the last :func:`num_val_documents`
    documents form the validation stream and the rest, in order, the train stream.
    """
    if isinstance(source, (list, tuple)):
        docs = [d for d in source if is_text(d)]
        n_val = num_val_documents(len(docs), val_fraction, where)
        return pack_documents(tokenizer, docs[:-n_val]), pack_documents(tokenizer, docs[-n_val:])
    ds = tokenize_dataset(source, tokenizer)
    n = len(ds)
    n_val = num_val_documents(n, val_fraction, where)
    train = flatten_tokens(ds.select(range(n - n_val)))
    return train, flatten_tokens(ds.select(range(n - n_val, n)))
