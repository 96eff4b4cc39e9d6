"""A small Llama config.json and the real Llama-2-7B one, written offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

#: meta-llama/Llama-2-7b-hf's config.json (shapes: hidden 4096, MLP 11008, 32 layers, 32
#: heads, vocabulary 32000, untied head), typed in: no download
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "tie_word_embeddings": False, "torch_dtype": "float16", "use_cache": True,
    "vocab_size": 32000,
}  # fmt: skip
#: a small Llama with grouped-query attention
SMALL = {
    "model_type": "llama", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 688,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}  # fmt: skip


def write(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder / "config.json"


@pytest.fixture
def small(tmp_path: Path) -> Path:
    return write(tmp_path / "small", SMALL)


@pytest.fixture
def llama2_7b(tmp_path: Path) -> Path:
    return write(tmp_path / "llama2-7b", LLAMA2_7B)
