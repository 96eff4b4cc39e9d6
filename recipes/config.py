"""Recipe configuration schema: TOML files and the command line read into dataclasses.

    python -m recipes.pretrain --config recipes/configs/tiny.toml \\
        --optimizer galore_adamw --steps 200 --out runs/tiny --optim.rank 32 --data.seq_len 128

A TOML file has one table per section (``[model]``, ``[data]``, ``[optim]``,
``[train]``); every key must be a field of that section (typos are errors, not
silently ignored). On the command line ``--section.field VALUE`` overrides a field;
``--optimizer``, ``--steps`` and ``--out`` are shorthands for ``--optim.name``,
``--train.steps`` and ``--train.out``. Values are parsed by the field's type
(``true``/``false`` for booleans, ``none`` for optional fields, comma-separated
lists).

This module is the schema and its parsing only; it knows no optimizer. [optim]'s settings
are routed (field or option of the chosen optimizer), parsed and validated once, with the
fields a preset fixes, by :func:`recipes.resolve.resolve`, the step every entry point
calls on :func:`parse_args`'s result.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass
class ModelConfig:
    """A Llama (``transformers.LlamaForCausalLM``) built from these fields; no hub access."""

    vocab_size: int = 32000
    dim: int = 512  # hidden_size
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int | None = None  # None: = n_heads (no GQA)
    ffn_dim: int = 1376  # intermediate_size
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02
    dtype: str = "auto"  # parameter dtype: auto = bf16 on GPU, fp32 on CPU; or fp32 / bf16
    activation_checkpointing: bool = False
    compile: bool = False
    # 8: the linear weights of the decoder layers as int8 codes + scales, re-quantized with
    # stochastic rounding (galore2.quantize_weights, which checks both values); None: dtype
    weight_bits: int | None = None
    weight_group_size: int | None = 256  # inputs per scale of an int8 weight; None: per row


@dataclass
class DataConfig:
    """Where the text comes from and how it becomes fixed-length token sequences."""

    dataset: str = "embedded"  # "embedded", a local .txt/.jsonl file or folder, or a hub name
    dataset_config: str | None = None  # hub dataset configuration, e.g. "en" for allenai/c4
    split: str = "train"
    text_field: str = "text"
    streaming: bool = True  # hub datasets are streamed; local files are tokenized once
    tokenizer: str = "byte"  # "byte" (no files), a local tokenizer folder, or a hub name
    seq_len: int = 256
    val_fraction: float = 0.05  # held-out share of documents (embedded / local files)
    val_documents: int = 2000  # held-out documents at the head of a streamed dataset
    shuffle_buffer: int = 10000  # streamed datasets only
    seed: int = 0


@dataclass
class OptimConfig:
    """Optimizer (by name, see recipes.optimizers) and LR schedule.

    The fields below are the recipe's own. Every optimizer setting — torch.optim's ``lr``
    and ``weight_decay``, Adam's ``betas`` and ``eps``, GaLore's ``rank``,
    ``update_proj_gap``, ``scale``, ``proj_type``, every option of a galore2 optimizer —
    is set as ``--optim.KEY VALUE`` (or ``KEY = VALUE`` under ``[optim]``): it lands in
    ``options``, is parsed and validated (:func:`recipes.resolve.resolve`) by galore2's
    declaration of it (``galore2.<Optimizer>.all_options()``;
    :func:`recipes.optimizers.declarations`) and goes to the optimizer unchanged, so every
    option of the chosen optimizer is settable and an unknown key is an error naming the
    allowed ones. Unset, an option is at the recipe's default
    (:data:`recipes.optimizers.RECIPE_DEFAULTS`: projected rank, no weight decay) or
    galore2's; for the optimizers that warm up and down themselves ``num_iterations`` =
    ``train.steps``. The value in force: :func:`recipes.optimizers.setting`.
    """

    name: str = "galore_adamw"
    target_modules: list[str] = field(default_factory=lambda: ["attn", "mlp"])
    per_layer: bool = False  # update each parameter inside backward (frees its gradient)
    max_grad_norm: float = 0.0  # 0: no clipping (per_layer refuses clipping)
    # schedule: linear warmup, then cosine to min_lr_ratio·lr (GaLore's pre-training setup)
    warmup_steps: int = 0
    warmup_ratio: float = 0.1  # used when warmup_steps == 0
    min_lr_ratio: float = 0.1
    # galore2 optimizers: replay non-refresh steps from a CUDA graph (galore2.CapturedStep;
    # sets capturable=True, needs a constant lr; eager on the CPU): recipes.optimizers
    capture: bool = False
    # --optimizer adamw: torch's kernel, auto = fused on CUDA (what users run), foreach
    # elsewhere; or fused / foreach
    adamw_kernel: str = "auto"
    # every optimizer setting, by its option's name (--optim.lr 0.01, --optim.rank 32,
    # --optim.projector power, ...), as given and parsed
    options: dict[str, Any] = field(default_factory=dict)
    # set by recipes.resolve, not by a setting: the options the preset fixes (APOLLO's α,
    # APOLLO-Mini's rank 1), already in ``options``; recorded so the run can say so
    fixed: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainConfig:
    steps: int = 1000  # the run's length (the LR schedule spans it)
    stop_after: int = 0  # >0: checkpoint and exit after this step (resume later); 0: run to steps
    batch_size: int = 8  # sequences per rank per micro-batch
    grad_accum: int = 1
    log_every: int = 10  # >= 1
    eval_every: int = 100  # >= 1 (train.eval_batches 0 turns evaluation off)
    eval_batches: int = 8  # 0: no evaluation (no val_loss anywhere)
    max_skip_steps: int = 10  # stop after this many steps in a row skip updates; 0: never
    checkpoint_every: int = 0  # 0: only at the end; -1: never (peers are never checkpointed)
    keep_checkpoints: int = 2
    out: str = "runs/pretrain"
    resume: bool = True  # continue from the newest checkpoint under out/checkpoints
    overwrite: bool = False  # start afresh in an out dir holding a run, deleting that run
    seed: int = 0
    device: str = "auto"  # auto: cuda if available, else cpu
    progress: bool = True
    threads: int = 0  # CPU intra-op threads; 0: torch's default


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SHORTHANDS = {"optimizer": "optim.name", "steps": "train.steps", "out": "train.out"}


def _field_type(section: Any, name: str) -> Any:
    hints = typing.get_type_hints(type(section))
    return hints[name]


def _parse(value: Any, tp: Any, where: str) -> Any:
    """Convert a TOML or CLI value to the field type ``tp``; clear error otherwise."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        return _parse(value, inner[0], where)
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ValueError(f"{where} must be a list, got {value!r}")
        return [_parse(v, args[0], where) for v in value]
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
                return value.lower() in ("true", "1", "yes")
            raise ValueError
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp is str:
            if not isinstance(value, str):
                raise ValueError
            return value
    except (TypeError, ValueError):
        name = getattr(tp, "__name__", str(tp))
        raise ValueError(f"{where} must be {name}, got {value!r}") from None
    return value


#: fields no setting names: [optim]'s options (set by their own keys) and what resolve fixes
NOT_SETTINGS = ("options", "fixed")


def field_names(section: Any) -> list[str]:
    """The fields of a config section a setting may name (``options`` is not one)."""
    return [f.name for f in dataclasses.fields(section) if f.name not in NOT_SETTINGS]


def set_field(section: Any, name: str, value: Any, where: str) -> None:
    """Set field ``name`` of ``section`` from a TOML or CLI value, parsed to its type."""
    setattr(section, name, _parse(value, _field_type(section, name), where))


def _set(job: JobConfig, dotted: str, value: Any) -> None:
    """Set ``SECTION.FIELD`` of a section other than [optim]; clear error for an unknown key."""
    section_name, _, name = dotted.partition(".")
    sections = {f.name for f in dataclasses.fields(job)}
    if section_name not in sections or not name:
        raise ValueError(
            f"unknown setting {dotted!r}: use SECTION.FIELD with SECTION in {sorted(sections)}"
        )
    section = getattr(job, section_name)
    names = field_names(section)
    if name not in names:
        raise ValueError(f"unknown setting {dotted!r}; [{section_name}] has: {', '.join(names)}")
    set_field(section, name, value, dotted)


#: [train] fields, their lowest allowed values and what to say (checked before anything
#: is built)
_TRAIN_LOW = {
    "steps": (1, ""),
    "stop_after": (0, " (0: run all steps)"),
    "batch_size": (1, ""),
    "grad_accum": (1, ""),
    "log_every": (1, ""),
    "eval_every": (1, "; train.eval_batches 0 turns evaluation off"),
    "eval_batches": (0, " (0: no evaluation)"),
    "checkpoint_every": (-1, " (0: only at the end, -1: never)"),
    "keep_checkpoints": (1, ""),
    "threads": (0, " (0: torch's default)"),
    "max_skip_steps": (0, " (0: never stop)"),
}


def check_train(job: JobConfig) -> None:
    """``ValueError`` for [train] values no run can use (a zero log interval, keeping no
    checkpoint...), so they fail at start-up instead of at the first log or save."""
    for name, (low, hint) in _TRAIN_LOW.items():
        value = getattr(job.train, name)
        if value < low:
            raise ValueError(f"train.{name} must be >= {low}, got {value}{hint}")
    if not job.train.out.strip():
        raise ValueError("train.out must name a folder")


def resolve_config_path(path: str | Path) -> Path:
    """A path as given, or a name in recipes/configs (``tiny`` → recipes/configs/tiny.toml)."""
    p = Path(path)
    if p.is_file():
        return p
    named = CONFIG_DIR / (p.name if p.suffix == ".toml" else f"{p.name}.toml")
    if named.is_file():
        return named
    known = sorted(q.stem for q in CONFIG_DIR.glob("*.toml"))
    raise FileNotFoundError(
        f"--config: no file {str(path)!r} and no recipe config of that name ({known})"
    )


@dataclass
class Args:
    """A config file and command line as read by the schema, before the one optimizer-aware
    step (:func:`recipes.resolve.resolve`).

    Every [model] / [data] / [train] setting is applied to ``job``. [optim]'s settings are
    kept as given (``optim``: TOML first, then the command line, a later value replacing an
    earlier one), because which of them are [optim] fields and which are options of the
    chosen optimizer, and how they parse, is the optimizer's to say."""

    job: JobConfig
    optim: dict[str, Any] = field(default_factory=dict)
    cli_optim: set[str] = field(default_factory=set)  # [optim] keys given on the command line


def read_toml(path: str | Path) -> dict[str, dict[str, Any]]:
    """The tables of a recipe config file (a path, or a name in recipes/configs)."""
    with open(resolve_config_path(path), "rb") as f:
        data = tomllib.load(f)
    for section_name, values in data.items():
        if not isinstance(values, dict):
            raise ValueError(f"{path}: top-level key {section_name!r} must be a [section] table")
    return data


def _put(args: Args, dotted: str, value: Any) -> None:
    section_name, _, name = dotted.partition(".")
    if section_name == "optim" and name:
        args.optim[name] = value
    else:
        _set(args.job, dotted, value)


def parse_args(argv: list[str] | None = None, help_lines: tuple[str, ...] = ()) -> Args:
    """Read ``--config`` and the ``--section.field value`` overrides (see the module's
    docstring); ``--help`` exits with :func:`usage` followed by ``help_lines``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pairs: list[tuple[str, str]] = []
    config_path: str | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            raise SystemExit("\n".join([usage(), *help_lines]))
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}; settings are --section.field VALUE")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ValueError(f"--{key} needs a value")
            value = argv[i + 1]
            i += 1
        i += 1
        if key == "config":
            config_path = value
        else:
            pairs.append((SHORTHANDS.get(key, key), value))
    args = Args(JobConfig())
    if config_path is not None:
        for section_name, values in read_toml(config_path).items():
            for name, value in values.items():
                _put(args, f"{section_name}.{name}", value)
    for dotted, value in pairs:
        _put(args, dotted, value)
    args.cli_optim = {d.removeprefix("optim.") for d, _ in pairs if d.startswith("optim.")}
    check_train(args.job)
    return args


def usage() -> str:
    lines = [
        "usage: python -m recipes.pretrain [--config PATH|NAME] [--optimizer NAME] [--steps N]",
        "                                  [--out DIR] [--SECTION.FIELD VALUE ...] [--debug]",
        "",
        "errors print one line; --debug (or GALORE2_DEBUG=1) shows the full traceback",
        "",
        "settings (defaults shown; a TOML config sets them per section):",
    ]
    job = JobConfig()
    for f in dataclasses.fields(job):
        section = getattr(job, f.name)
        lines += [
            f"  --{f.name}.{name} = {getattr(section, name)!r}" for name in field_names(section)
        ]
    return "\n".join(lines)
