"""``optim_target_modules`` selects exactly what the Trainer's own ``optim="galore_adamw"``
selects (its matcher, run by ``Trainer.get_optimizer_cls_and_kwargs``), on real
architectures built offline from tiny configs."""

from __future__ import annotations

import ast
import logging
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("galore_torch")  # the Trainer's GaLore path imports it (a test extra)

from galore2.integrations.transformers import create_optimizer  # noqa: E402

SIZES = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
MODELS = {  # Qwen2: q/k/v biases and the head tied to the embedding
    "llama": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**SIZES, tie_word_embeddings=False)
    ),
    "mistral": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**SIZES, tie_word_embeddings=False)
    ),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**SIZES, tie_word_embeddings=True)
    ),
}
TARGETS = [
    ["q_proj", "v_proj"],  # substrings
    ["attn", "mlp"],  # substrings that also name non-Linear containers (reported, skipped)
    ["lm_head", "down_proj"],  # the head by name: not projected when it is tied
    [r"model\.layers\.1\.mlp\..*", "o_proj"],  # a regex in a list
    r".*\.(q|k|v|o)_proj",  # a string is fullmatched
    r"model\.layers\.0\..*",  # matching non-Linear modules by regex: not reported
    ".*",  # every Linear, the same as HF's "all-linear"
    "all-linear",
    "all_linear",
]


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def hf_selection(model, args) -> tuple[set[str], set[str]]:
    """Names of the parameters the Trainer projects, and of the modules it reports."""
    logger = logging.getLogger("transformers.trainer_optimizer")
    records = Records()
    logger.addHandler(records)
    try:
        _, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    finally:
        logger.removeHandler(records)
    name = {id(p): n for n, p in model.named_parameters()}
    (target,) = [g for g in kwargs["params"] if "rank" in g]
    reported = {m.split(" matched but ignored")[0] for m in records.messages}
    return {name[id(p)] for p in target["params"]}, reported


def our_selection(model, args) -> tuple[set[str], set[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = create_optimizer(model, args, rank=4)
    name = {id(p): n for n, p in model.named_parameters()}
    reported = set()
    for w in caught:
        text = str(w.message)
        reported |= set(ast.literal_eval(text[text.index("[") : text.index("]") + 1]))
    return {name[id(p)] for g in opt.param_groups if g["rank"] for p in g["params"]}, reported


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_same_parameters_as_the_trainers_galore(tmp_path, arch, target):
    torch.manual_seed(0)
    model = MODELS[arch]()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        optim="galore_adamw",
        optim_target_modules=target,
        use_cpu=True,
        report_to=[],
    )
    theirs, their_reports = hf_selection(model, args)
    ours, our_reports = our_selection(model, args)
    assert ours == theirs
    assert our_reports == their_reports
    assert theirs and all(n.endswith(".weight") for n in theirs)
    tied = arch == "qwen2"
    head = "lm_head.weight"
    if target in ("all-linear", "all_linear", ".*"):
        linears = {
            f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
        }
        assert theirs == linears - ({head} if tied else set())
    assert head not in theirs or not tied  # a tied head is the embedding: never projected
