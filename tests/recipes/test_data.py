"""The recipe's data pipeline (recipes.data / corpus / tokenizer): offline and fast."""

from __future__ import annotations

import itertools
import json
import random
import string
import sys

import pytest
import torch

from recipes.config import DataConfig
from recipes.corpus import embedded_documents, open_hub
from recipes.data import (
    PackedTrainLoader,
    ValLoader,
    build_loaders,
    build_map_loaders,
    build_stream_loaders,
)
from recipes.tokenizer import ByteTokenizer, load_tokenizer, pack_documents

BYTE = ByteTokenizer()
EOS = BYTE.eos_id
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper", "light", "green"]


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return str(tmp_path / "hf-cache")


def make_docs(n: int, seed: int = 0) -> list[str]:
    """Unique documents of roughly 40-200 characters: ``doc <i>: words ...``."""
    rng = random.Random(seed)
    return [
        f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 25))) + "."
        for i in range(n)
    ]


def docs_in(batches: list[dict[str, torch.Tensor]]) -> list[str]:
    """The complete documents (between two eos tokens) in a run of batches."""
    stream = torch.cat([b["input_ids"].flatten() for b in batches]).tolist()
    cuts = [i for i, t in enumerate(stream) if t == EOS]
    return [BYTE.decode(stream[a + 1 : b]) for a, b in itertools.pairwise(cuts)]


def cfg(**kw) -> DataConfig:
    return DataConfig(**{"seq_len": 32, "val_fraction": 0.1, **kw})


# ---- tokenizers ------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    text = "Plain ASCII, café, naïve, Größe, 日本語, emoji 🙂\nnew line"
    ids = BYTE.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert BYTE.decode(ids) == text
    assert BYTE.batch_encode([text, ""]) == [ids, []]
    assert (BYTE.eos_id, BYTE.vocab_size) == (256, 257)
    assert BYTE.decode([*ids, EOS]) == text  # eos is not text
    assert BYTE.decode(BYTE.encode("é")[:1]) == "\ufffd"  # cut mid-character: no error
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


def test_hf_tokenizer_from_local_folder(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"])
    tk.train_from_iterator(make_docs(50), trainer)
    tk.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert tok.eos_id == 2 and tok.vocab_size == len(fast)
    ids = tok.encode("alpha beta gamma")
    assert len(ids) == 3 and 1 not in ids and 2 not in ids  # no BOS/EOS added
    assert tok.batch_encode(["alpha beta gamma", "river"]) == [ids, tok.encode("river")]
    assert tok.decode(ids) == "alpha beta gamma"
    with pytest.raises(ValueError, match=r"data\.tokenizer"):
        load_tokenizer(str(tmp_path / "missing"))


# ---- embedded corpus --------------------------------------------------------------------


def assert_real_text(docs: tuple[str, ...], min_chars: int, min_docs: int) -> None:
    text = "".join(docs)
    assert len(text) > min_chars and len(docs) > min_docs
    letters = sum(c.isascii() and (c.isalpha() or c == " ") for c in text)
    printable = sum(c in string.printable for c in text)
    assert letters / len(text) > 0.7 and printable / len(text) > 0.98
    assert text.count(" the ") > min_chars // 500  # English prose, not code or noise
    assert len(set(docs)) == len(docs) and all(d.strip() for d in docs)


def test_embedded_corpus_is_real_english_text():
    docs = embedded_documents()
    assert_real_text(docs, 100_000, 300)
    assert embedded_documents.__wrapped__() == docs  # deterministic


def test_embedded_corpus_fallback_without_pydoc_data(monkeypatch):
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)  # import raises ImportError
    docs = embedded_documents.__wrapped__()
    assert docs == embedded_documents(use_pydoc=False)
    assert_real_text(docs, 50_000, 100)


# ---- packing and splits -------------------------------------------------------------------


def test_packing_fixed_length_eos_and_exact_stream():
    docs = make_docs(200)
    train, val = build_map_loaders(docs, cfg(), BYTE, batch_size=4)
    n_val = 20
    stream = pack_documents(BYTE, docs[:-n_val])
    assert stream.tolist() == [t for d in docs[:-n_val] for t in [*BYTE.encode(d), EOS]]
    assert torch.equal(train.tokens, stream) and torch.equal(
        val.tokens, pack_documents(BYTE, docs[-n_val:])
    )
    n = stream.numel() // 32
    assert train.num_sequences == n and torch.equal(train.sequences.flatten(), stream[: n * 32])
    batches = [train.next_batch() for _ in range(train.batches_per_epoch + 3)]  # into epoch 1
    for b in batches:
        assert set(b) == {"input_ids", "labels"} and b["input_ids"].shape == (4, 32)
        assert b["input_ids"].dtype == torch.int64 and torch.equal(b["input_ids"], b["labels"])
    epoch0 = torch.cat([b["input_ids"] for b in batches[: train.batches_per_epoch]])
    assert len({tuple(r) for r in epoch0.tolist()}) == epoch0.shape[0]  # no repeats in an epoch
    assert not torch.equal(train.epoch_order(0), train.epoch_order(1))  # reshuffled per epoch
    eos_at = (stream == EOS).nonzero().flatten().tolist()
    lengths = [len(BYTE.encode(d)) for d in docs[:-n_val]]
    assert eos_at == [sum(lengths[: i + 1]) + i for i in range(len(lengths))]


def test_train_and_validation_documents_are_disjoint():
    docs = embedded_documents()
    n_val = max(1, round(len(docs) * 0.05))
    train, val = build_loaders(DataConfig(seq_len=64), BYTE, batch_size=8)
    train_text, val_text = BYTE.decode(train.tokens), BYTE.decode(val.tokens)
    assert val_text == "".join(docs[-n_val:]) and train_text == "".join(docs[:-n_val])
    assert not set(docs[:-n_val]) & set(docs[-n_val:])
    assert train.tokens.numel() > 300_000 and val.num_sequences >= 8


def test_sharding_concatenates_to_the_single_rank_global_batch():
    docs = make_docs(300)
    single, _ = build_map_loaders(docs, cfg(), BYTE, batch_size=6, world_size=1)
    ranks = [build_map_loaders(docs, cfg(), BYTE, 3, r, 2)[0] for r in range(2)]
    for _ in range(single.batches_per_epoch + 2):
        b0, b1 = (r.next_batch()["input_ids"] for r in ranks)
        assert not {tuple(x) for x in b0.tolist()} & {tuple(x) for x in b1.tolist()}
        assert torch.equal(torch.cat([b0, b1]), single.next_batch()["input_ids"])
    sd0, sd1 = (r.state_dict() for r in ranks)
    assert sd0.keys() == sd1.keys() and all(torch.equal(sd0[k], sd1[k]) for k in sd0)


def assert_int64_state(sd: dict[str, torch.Tensor]) -> None:
    assert sd and all(
        isinstance(v, torch.Tensor)
        and v.dtype == torch.int64
        and v.dim() == 0
        and v.device.type == "cpu"
        for v in sd.values()
    )


def test_map_style_resume_matches_uninterrupted_run():
    docs = make_docs(200)
    run, _ = build_map_loaders(docs, cfg(), BYTE, batch_size=4)
    k = run.batches_per_epoch - 2  # the continuation crosses an epoch boundary
    for _ in range(k):
        run.next_batch()
    sd = run.state_dict()
    assert_int64_state(sd) and int(sd["position"]) == k
    expected = [run.next_batch()["input_ids"] for _ in range(5)]
    resumed, _ = build_map_loaders(docs, cfg(), BYTE, batch_size=4)
    resumed.load_state_dict(sd)
    assert all(torch.equal(resumed.next_batch()["input_ids"], e) for e in expected)
    # same global batch on two ranks continues the same sequence stream
    halves = [build_map_loaders(docs, cfg(), BYTE, 2, r, 2)[0] for r in range(2)]
    for h in halves:
        h.load_state_dict(sd)
    for e in expected:
        assert torch.equal(torch.cat([h.next_batch()["input_ids"] for h in halves]), e)
    with pytest.raises(ValueError, match="seq_len"):
        resumed.load_state_dict({**sd, "seq_len": torch.tensor(64)})


def test_validation_loader_is_deterministic_and_sharded():
    tokens = torch.arange(10 * 8, dtype=torch.int32)  # 10 sequences of 8
    single = ValLoader(tokens, 8, batch_size=4)
    first = [b["input_ids"] for b in single.batches(100)]
    assert [b.shape[0] for b in first] == [4, 4, 2] and single.num_batches == 3
    assert all(
        torch.equal(a, b["input_ids"]) for a, b in zip(first, single.batches(100), strict=True)
    )
    assert torch.equal(torch.cat(first), tokens.view(10, 8).long())
    assert len(list(single.batches(2))) == 2
    ranks = [ValLoader(tokens, 8, 2, r, 2) for r in range(2)]
    per_rank = [list(r.batches(100)) for r in ranks]
    assert [len(p) for p in per_rank] == [3, 3]  # every rank runs the same number of batches
    for a, b, whole in zip(*per_rank, first, strict=True):
        assert torch.equal(torch.cat([a["input_ids"], b["input_ids"]]), whole)
    with pytest.raises(ValueError, match=r"data\.seq_len"):
        ValLoader(tokens[:7], 8, 4)


# ---- local files and streaming --------------------------------------------------------------


def test_local_txt_file(tmp_path, offline):
    docs = make_docs(120)
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(docs) + "\n")
    train, val = build_loaders(cfg(dataset=str(path)), BYTE, batch_size=4, cache_dir=offline)
    assert BYTE.decode(val.tokens) == "".join(docs[-12:])  # one document per paragraph
    assert BYTE.decode(train.tokens) == "".join(docs[:-12])
    assert train.next_batch()["input_ids"].shape == (4, 32)


def test_local_jsonl_file_and_folder(tmp_path, offline):
    docs = make_docs(100)
    folder = tmp_path / "shards"
    folder.mkdir()
    for i, part in enumerate((docs[:50], docs[50:])):
        rows = [json.dumps({"id": j, "content": d}) for j, d in enumerate(part)]
        (folder / f"part{i}.jsonl").write_text("\n".join(rows) + "\n")
    c = cfg(dataset=str(folder / "part0.jsonl"), text_field="content")
    train, val = build_loaders(c, BYTE, batch_size=2, cache_dir=offline)
    assert BYTE.decode(val.tokens) == "".join(docs[45:50])
    c.dataset = str(folder)
    train, val = build_loaders(c, BYTE, batch_size=2, cache_dir=offline)
    assert BYTE.decode(train.tokens) == "".join(docs[:90]) and val.num_sequences >= 1
    with pytest.raises(ValueError, match=r"data\.text_field"):
        build_loaders(cfg(dataset=str(folder)), BYTE, batch_size=2, cache_dir=offline)


def write_jsonl(tmp_path, docs: list[str], parts: int) -> list[str]:
    files = []
    for p in range(parts):
        f = tmp_path / f"stream{p}.jsonl"
        f.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[p::parts]))
        files.append(str(f))
    return files


def stream_loaders(files, cache, rank=0, world_size=1, batch_size=2):
    ds = open_hub("json", None, "train", True, "text", data_files=files, cache_dir=cache)
    c = cfg(dataset="json", val_documents=10, shuffle_buffer=16, seed=3)
    return build_stream_loaders(ds, c, BYTE, batch_size, rank, world_size)


def test_streamed_jsonl_packs_resumes_and_holds_out_validation(tmp_path, offline):
    docs = make_docs(80)
    files = write_jsonl(tmp_path, docs, parts=1)
    train, val = stream_loaders(files, offline)
    assert BYTE.decode(val.tokens) == "".join(docs[:10])  # the head of the stream
    assert [b["input_ids"].tolist() for b in val.batches(3)] == [
        b["input_ids"].tolist() for b in val.batches(3)
    ]
    run = [train.next_batch() for _ in range(200)]  # > 2 epochs of 70 train docs
    assert all(
        b["input_ids"].shape == (2, 32) and torch.equal(b["input_ids"], b["labels"]) for b in run
    )
    seen = docs_in(run)
    assert set(seen) == set(docs[10:]) and not set(seen) & set(docs[:10])
    assert seen[:60] != docs[10:70]  # shuffled
    k = 90  # the continuation crosses into the second epoch
    interrupted, _ = stream_loaders(files, offline)
    for _ in range(k):
        interrupted.next_batch()
    sd = interrupted.state_dict()
    assert_int64_state(sd) and int(sd["position"]) == k
    resumed, _ = stream_loaders(files, offline)
    resumed.load_state_dict(sd)
    for b in run[k : k + 20]:
        assert torch.equal(resumed.next_batch()["input_ids"], b["input_ids"])


@pytest.mark.parametrize("parts", [1, 2])  # 1 file: split by examples; 2 files: by shards
def test_streamed_ranks_are_disjoint_and_skip_validation(tmp_path, offline, parts):
    docs = make_docs(60)
    files = write_jsonl(tmp_path, docs, parts)
    ds = open_hub("json", None, "train", True, "text", data_files=files, cache_dir=offline)
    val_docs = {row["text"] for row in ds.take(10)}
    head, seen = [], []  # a rank's first ~12 documents, and its first two epochs
    for rank in range(2):
        train, _ = stream_loaders(files, offline, rank, 2)
        batches = [train.next_batch() for _ in range(60)]
        head.append(set(docs_in(batches[:20])))
        seen.append(set(docs_in(batches)))
    assert not head[0] & head[1]  # each epoch, the ranks split the documents between them
    assert seen[0] | seen[1] == set(docs) - val_docs and len(val_docs) == 10


# ---- errors -----------------------------------------------------------------------------------


def test_errors_name_the_argument(tmp_path, offline):
    bad = tmp_path / "data.csv"
    bad.write_text("text\nhello\n")
    with pytest.raises(ValueError, match=r"data\.dataset.*extension"):
        build_loaders(cfg(dataset=str(bad)), BYTE, 2, cache_dir=offline)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"data\.dataset.*empty"):
        build_loaders(cfg(dataset=str(empty)), BYTE, 2, cache_dir=offline)
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": "   "}\n{"text": ""}\n')
    with pytest.raises(ValueError, match=r"data\.dataset.*empty"):
        build_loaders(cfg(dataset=str(blank)), BYTE, 2, cache_dir=offline)
    with pytest.raises(ValueError, match=r"data\.dataset.*no such file"):
        build_loaders(cfg(dataset=str(tmp_path / "missing.txt")), BYTE, 2)
    with pytest.raises(ValueError, match=r"data\.val_fraction"):
        build_loaders(cfg(val_fraction=0.0), BYTE, 2)
    with pytest.raises(ValueError, match=r"data\.seq_len"):  # validation split below one sequence
        build_map_loaders(make_docs(20), cfg(seq_len=4096), BYTE, 1)
    with pytest.raises(ValueError, match="global batch"):
        PackedTrainLoader(torch.zeros(100, dtype=torch.int32), 32, batch_size=4)
