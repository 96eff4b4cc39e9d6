"""Token batches for pre-training: documents → tokens → packed fixed-length sequences.

Packing: each document is tokenized (no special tokens), followed by ``eos_id``, and
the documents are concatenated into one token stream cut into sequences of exactly
``seq_len`` tokens (a document may span two sequences; the tail shorter than
``seq_len`` is dropped). A batch is ``{"input_ids", "labels"}``, two equal
``int64`` tensors ``[batch, seq_len]`` (``LlamaForCausalLM`` shifts labels itself).

Sharding: with ``G = batch_size × world_size``, global batch ``b`` is sequences
``[b·G, (b+1)·G)`` of the epoch's order and rank ``r`` takes the contiguous slice
``[b·G + r·B, b·G + (r+1)·B)``. A loader's position is the number of global
batches consumed, the same on every rank.

* Map-style sources (embedded corpus, local files, hub with ``streaming=false``) are
  tokenized once. The last ``val_fraction`` of the documents (at least one) is the
  validation split. Epoch ``e`` visits the train sequences in the order
  ``torch.randperm(N, generator=manual_seed(seed + e))``; the ``N mod G``
  sequences that do not fill a global batch are skipped that epoch. Resuming at
  another world size with the same global batch continues the same stream.
* Streamed sources: the first ``val_documents`` documents (stream order, before
  splitting or shuffling) are validation. Training splits the stream by node
  (``datasets.distributed.split_dataset_by_node``), shuffles it with a buffer
  (``set_epoch(e)`` per pass) and packs each rank's documents on the fly, leaving
  out any document equal to a validation document (hashed). In each pass the ranks
  split the documents between them (which rank gets which may change between
  passes, and ranks may be in different passes at a time). ``.skip()`` is not used
  because ``datasets`` divides a skip count among shards when a dataset is split
  across nodes by shards, which would let validation documents into training.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from recipes.config import DataConfig
from recipes.corpus import document_digest, open_source, row_text, stream_documents
from recipes.tokenizer import Tokenizer, is_text, pack_documents, pack_stream, split_and_pack
from recipes.tokenizer import load_tokenizer as load_tokenizer  # re-exported for callers


def _batch(x: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.to(torch.int64)
    return {"input_ids": x, "labels": x.clone()}


def _as_sequences(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = tokens.numel() // seq_len
    return tokens[: n * seq_len].view(n, seq_len)


class TrainLoader:
    """An endless source of training batches with a resumable position.

    ``next_batch()`` returns this rank's ``batch_size`` sequences of the next global
    batch. ``state_dict()`` holds only 0-d ``int64`` CPU tensors, identical on
    every rank: ``position`` (global batches consumed), ``global_batch_size``,
    ``seq_len`` and ``world_size``. ``load_state_dict`` makes the following batches
    equal to those of the uninterrupted run.
    """

    def __init__(self, seq_len: int, batch_size: int, rank: int, world_size: int):
        self.seq_len, self.batch_size = seq_len, batch_size
        self.rank, self.world_size = rank, world_size
        self.global_batch_size = batch_size * world_size
        self.tokens_per_batch = batch_size * seq_len
        self.position = 0

    def next_batch(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _seek(self, position: int) -> None:
        self.position = position

    def state_dict(self) -> dict[str, torch.Tensor]:
        values = {
            "position": self.position,
            "global_batch_size": self.global_batch_size,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
        }
        return {k: torch.tensor(v, dtype=torch.int64) for k, v in values.items()}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        saved = {k: int(v) for k, v in sd.items()}
        if "position" not in saved or saved["position"] < 0:
            raise ValueError(f"data loader state has no valid 'position': {saved}")
        for key in ("seq_len", "global_batch_size"):
            if key in saved and saved[key] != getattr(self, key):
                raise ValueError(
                    f"data loader state was saved with {key}={saved[key]}, now "
                    f"{getattr(self, key)}; positions are counted in global batches of "
                    "seq_len tokens, so resume with the same data.seq_len and "
                    "batch_size × world_size"
                )
        self._check_world_size(saved.get("world_size", self.world_size))
        self._seek(saved["position"])

    def _check_world_size(self, saved: int) -> None:
        pass


class PackedTrainLoader(TrainLoader):
    """Training batches from a tokenized (map-style) split; see the module docstring."""

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_len: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ):
        super().__init__(seq_len, batch_size, rank, world_size)
        self.tokens = tokens
        self.sequences = _as_sequences(tokens, seq_len)
        self.seed = seed
        self.num_sequences = self.sequences.shape[0]
        self.batches_per_epoch = self.num_sequences // self.global_batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"the train split has {tokens.numel()} tokens = {self.num_sequences} sequences "
                f"of data.seq_len={seq_len}, fewer than one global batch ({batch_size} × "
                f"{world_size} ranks); use more text, a shorter seq_len or a smaller batch"
            )
        self._order_epoch, self._order = -1, torch.empty(0, dtype=torch.int64)

    @property
    def epoch(self) -> int:
        return self.position // self.batches_per_epoch

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The permutation of train sequence indices used in ``epoch``."""
        if epoch != self._order_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._order = torch.randperm(self.num_sequences, generator=g)
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> dict[str, torch.Tensor]:
        epoch, b = divmod(self.position, self.batches_per_epoch)
        start = b * self.global_batch_size + self.rank * self.batch_size
        idx = self.epoch_order(epoch)[start : start + self.batch_size]
        self.position += 1
        return _batch(self.sequences[idx])


class StreamingTrainLoader(TrainLoader):
    """Training batches packed on the fly from ``documents()``: this rank's endless stream.

    Resuming replays the stream from the start and discards the ``position ×
    batch_size`` sequences already consumed: exact, but it costs reading and
    tokenizing all of that text again (O(position)). The per-rank streams depend on
    the world size, so resuming at another world size only approximately continues.
    """

    def __init__(
        self,
        documents: Callable[[], Iterable[str]],
        tokenizer: Tokenizer,
        seq_len: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
    ):
        super().__init__(seq_len, batch_size, rank, world_size)
        self.documents, self.tokenizer = documents, tokenizer
        self._seqs = self._stream()

    def _stream(self) -> Iterator[list[int]]:
        return pack_stream(self.tokenizer, self.documents(), self.seq_len)

    def next_batch(self) -> dict[str, torch.Tensor]:
        rows = [next(self._seqs) for _ in range(self.batch_size)]
        self.position += 1
        return _batch(torch.tensor(rows, dtype=torch.int64))

    def _seek(self, position: int) -> None:
        self._seqs = self._stream()
        for _ in range(position * self.batch_size):
            next(self._seqs)
        self.position = position

    def _check_world_size(self, saved: int) -> None:
        if saved != self.world_size:
            warnings.warn(
                f"resuming a streamed dataset saved at world_size={saved} with "
                f"world_size={self.world_size}: each rank's stream differs, so the data order "
                "only approximately continues",
                stacklevel=3,
            )


class ValLoader:
    """Validation batches: the same, unshuffled batches on every call.

    Global batch ``b`` holds validation sequences ``[b·G, (b+1)·G)`` split
    contiguously across ranks. A final partial global batch is split evenly (each
    rank gets ``⌊rest / world_size⌋`` sequences, so the batch dimension may be below
    ``batch_size``); every rank yields the same number of batches. Weight a mean
    loss by ``batch["input_ids"].shape[0]``.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_len: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.tokens = tokens
        self.sequences = _as_sequences(tokens, seq_len)
        self.num_sequences = self.sequences.shape[0]
        self.seq_len, self.batch_size = seq_len, batch_size
        self.rank, self.world_size = rank, world_size
        self.tokens_per_batch = batch_size * seq_len
        if self.num_sequences < world_size:
            raise ValueError(
                f"the validation split has {tokens.numel()} tokens = {self.num_sequences} "
                f"sequence(s) of data.seq_len={seq_len}, fewer than one per rank ({world_size}); "
                "raise data.val_fraction / data.val_documents or lower data.seq_len"
            )

    def _rows(self, b: int) -> tuple[int, int]:
        g = self.batch_size * self.world_size
        per_rank = min(self.batch_size, max(0, self.num_sequences - b * g) // self.world_size)
        return b * g + self.rank * per_rank, per_rank

    @property
    def num_batches(self) -> int:
        """How many batches ``batches(n)`` yields at most."""
        g = self.batch_size * self.world_size
        full, rest = divmod(self.num_sequences, g)
        return full + (1 if rest >= self.world_size else 0)

    def batches(self, n: int) -> Iterator[dict[str, torch.Tensor]]:
        """The first ``min(n, num_batches)`` validation batches of this rank."""
        for b in range(min(n, self.num_batches)):
            start, rows = self._rows(b)
            yield _batch(self.sequences[start : start + rows])


def build_map_loaders(
    source: Any,
    cfg: DataConfig,
    tokenizer: Tokenizer,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[PackedTrainLoader, ValLoader]:
    """Loaders over a document list or a ``datasets.Dataset`` with a ``"text"`` column."""
    where = f"data.dataset={cfg.dataset!r}"
    train, val = split_and_pack(source, tokenizer, cfg.val_fraction, where)
    loader = PackedTrainLoader(train, cfg.seq_len, batch_size, rank, world_size, cfg.seed)
    return loader, ValLoader(val, cfg.seq_len, batch_size, rank, world_size)


def build_stream_loaders(
    dataset: Any,
    cfg: DataConfig,
    tokenizer: Tokenizer,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[StreamingTrainLoader, ValLoader]:
    """Loaders over a ``datasets.IterableDataset`` (rows holding ``cfg.text_field``).

    Reads the ``val_documents`` validation documents now; training reads lazily.
    """
    from datasets.distributed import split_dataset_by_node

    head = [row_text(row, cfg.text_field) for row in dataset.take(cfg.val_documents)]
    where = f"data.dataset={cfg.dataset!r}"
    if len(head) < cfg.val_documents:
        raise ValueError(
            f"{where}: the stream has only {len(head)} document(s), all taken by "
            f"data.val_documents={cfg.val_documents}; lower it or use a bigger dataset"
        )
    val_docs = [t for t in head if is_text(t)]
    if not val_docs:
        raise ValueError(f"{where}: the first data.val_documents documents are all empty")
    exclude = frozenset(document_digest(t) for t in val_docs)
    train_ds = split_dataset_by_node(dataset, rank=rank, world_size=world_size)
    train_ds = train_ds.shuffle(seed=cfg.seed, buffer_size=cfg.shuffle_buffer)
    documents = functools.partial(stream_documents, train_ds, cfg.text_field, exclude, rank)
    loader = StreamingTrainLoader(documents, tokenizer, cfg.seq_len, batch_size, rank, world_size)
    val = ValLoader(pack_documents(tokenizer, val_docs), cfg.seq_len, batch_size, rank, world_size)
    return loader, val


def _check(cfg: DataConfig, batch_size: int, rank: int, world_size: int) -> None:
    checks = [
        (cfg.seq_len >= 1, f"data.seq_len must be >= 1, got {cfg.seq_len}"),
        (batch_size >= 1, f"batch_size must be >= 1, got {batch_size}"),
        (0 <= rank < world_size, f"rank {rank} is not in [0, world_size={world_size})"),
        (0 < cfg.val_fraction < 1, f"data.val_fraction must be in (0, 1), got {cfg.val_fraction}"),
        (cfg.val_documents >= 1, f"data.val_documents must be >= 1, got {cfg.val_documents}"),
        (cfg.shuffle_buffer >= 1, f"data.shuffle_buffer must be >= 1, got {cfg.shuffle_buffer}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def build_loaders(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    *,
    cache_dir: str | None = None,
) -> tuple[TrainLoader, ValLoader]:
    """The train and validation loaders of ``cfg`` for one rank (see the module docstring).

    ``batch_size`` is sequences per rank per call. ``cache_dir`` is the ``datasets``
    cache (default: the Hugging Face cache). Raises ``ValueError`` for bad settings,
    unsupported files, an empty corpus or splits too small for one batch.
    """
    _check(cfg, batch_size, rank, world_size)
    source = open_source(cfg, cache_dir)
    if not isinstance(source, tuple):
        from datasets import IterableDataset

        if isinstance(source, IterableDataset):
            return build_stream_loaders(source, cfg, tokenizer, batch_size, rank, world_size)
    return build_map_loaders(source, cfg, tokenizer, batch_size, rank, world_size)
