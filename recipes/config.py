"""Recipe configuration: TOML files read into dataclasses, any field overridable from the CLI.

    python -m recipes.pretrain --config recipes/configs/tiny.toml \\
        --optimizer galore_adamw --steps 200 --out runs/tiny --optim.rank 32 --data.seq_len 128

A TOML file has one table per section (``[model]``, ``[data]``, ``[optim]``,
``[train]``); every key must be a field of that section (typos are errors, not
silently ignored). On the command line ``--section.field VALUE`` overrides a field;
``--optimizer``, ``--steps`` and ``--out`` are shorthands for ``--optim.name``,
``--train.steps`` and ``--train.out``. Values are parsed by the field's type
(``true``/``false`` for booleans, ``none`` for optional fields, comma-separated
lists).
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

    The fields below are the recipe's own and those every contender shares (peers from
    other packages read them too). Any other option of a galore2 optimizer is set as
    ``--optim.KEY VALUE`` (or ``KEY = VALUE`` under ``[optim]``): it lands in ``options``
    and is parsed and validated by the option's own declaration
    (``galore2.<Optimizer>.all_options()``), so every option of the chosen optimizer is
    settable and an unknown key is an error naming the allowed ones.
    """

    name: str = "galore_adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    # GaLore settings every projected contender shares (ignored by the others)
    rank: int = 128
    update_proj_gap: int = 200
    scale: float = 0.25
    proj_type: str = "std"
    target_modules: list[str] = field(default_factory=lambda: ["attn", "mlp"])
    per_layer: bool = False  # update each parameter inside backward (frees its gradient)
    max_grad_norm: float = 0.0  # 0: no clipping (per_layer refuses clipping)
    # schedule: linear warmup, then cosine to min_lr_ratio·lr (GaLore's pre-training setup)
    warmup_steps: int = 0
    warmup_ratio: float = 0.1  # used when warmup_steps == 0
    min_lr_ratio: float = 0.1
    num_iterations: int = 0  # 0: train.steps (Ranger21's schedule length)
    # any other option of the galore2 optimizer, by name (--optim.projector power, ...)
    options: dict[str, Any] = field(default_factory=dict)


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


# Each listed field's lowest allowed value, checked as the field is set (TOML or CLI).
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


def _set(job: JobConfig, dotted: str, value: Any, optimizer: str | None = None) -> None:
    section_name, _, name = dotted.partition(".")
    sections = {f.name for f in dataclasses.fields(job)}
    if section_name not in sections or not name:
        raise ValueError(
            f"unknown setting {dotted!r}: use SECTION.FIELD with SECTION in {sorted(sections)}"
        )
    section = getattr(job, section_name)
    names = [f.name for f in dataclasses.fields(section) if f.name != "options"]
    from .optimizers import is_own_option  # the optimizer factory knows which keys it owns

    if section_name == "optim" and is_own_option(optimizer or section.name, name):
        section.options[name] = value  # e.g. Adafactor's eps pair / beta1, not Adam's fields
    elif name in names:
        setattr(section, name, _parse(value, _field_type(section, name), dotted))
    elif section_name == "optim":  # an option of the chosen optimizer: checked by check_options
        section.options[name] = value
    else:
        raise ValueError(f"unknown setting {dotted!r}; [{section_name}] has: {', '.join(names)}")


def check_options(job: JobConfig) -> None:
    """Parse and validate ``optim.options`` against the chosen optimizer's declarations."""
    from .optimizers import parse_options  # the optimizer factory owns the names

    job.optim.options = parse_options(job.optim.name, job.optim.options)


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


def override(job: JobConfig, dotted: str, value: Any) -> None:
    """Set ``SECTION.FIELD`` of ``job`` from a CLI / TOML value, parsed to the field's type."""
    _set(job, dotted, value)


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


def load_toml(job: JobConfig, path: str | Path) -> JobConfig:
    with open(resolve_config_path(path), "rb") as f:
        data = tomllib.load(f)
    optim = data.get("optim")
    optimizer = optim.get("name") if isinstance(optim, dict) else None
    for section_name, values in data.items():
        if not isinstance(values, dict):
            raise ValueError(f"{path}: top-level key {section_name!r} must be a [section] table")
        for name, value in values.items():
            _set(job, f"{section_name}.{name}", value, optimizer)
    check_options(job)
    return job


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Build a JobConfig from ``--config`` and ``--section.field value`` overrides; the
    [optim] fields the chosen preset fixes (:func:`recipes.optimizers.preset_fields`) are
    set to its values (given on the command line, they are an error, not ignored)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pairs: list[tuple[str, str]] = []
    config_path: str | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            raise SystemExit(usage())
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
    job = JobConfig()
    if config_path is not None:
        load_toml(job, config_path)
    named = [v for d, v in pairs if d == "optim.name"]
    optimizer = named[-1] if named else job.optim.name
    for dotted, value in pairs:
        _set(job, dotted, value, optimizer)
    check_options(job)
    check_train(job)
    from .optimizers import apply_preset_fields, preset_fields  # APOLLO-Mini's rank 1…

    given = {d.removeprefix("optim.") for d, _ in pairs if d.startswith("optim.")}
    fixed = {k: v for k, v in preset_fields(job.optim.name).items() if k in given}
    if fixed:  # a value the user chose would not be used: refuse instead of ignoring it
        key, value = next(iter(fixed.items()))
        raise ValueError(
            f"--optim.{key}: optimizer {job.optim.name!r} fixes optim.{key}={value:g} (its "
            f"definition); for another value use galore_adamw with the same options, e.g. "
            "--optimizer galore_adamw --optim.projector random --optim.scale_type channel"
        )
    apply_preset_fields(job.optim)
    return job


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
        for g in dataclasses.fields(section):
            if g.name != "options":
                lines.append(f"  --{f.name}.{g.name} = {getattr(section, g.name)!r}")
    from .optimizers import option_lines

    lines += ["", "options of galore2 optimizers (--optim.KEY VALUE; see docs/guides/galore-options.md):"]
    lines += option_lines()
    return "\n".join(lines)
