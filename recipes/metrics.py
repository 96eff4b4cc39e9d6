"""Run metrics: JSONL log, progress bar, throughput, MFU, peak memory, optimizer-state bytes.

``DIR/metrics.jsonl`` gets one JSON object per log step (rank 0 only) with at
least ``step``, ``loss``, ``lr``, ``tokens_per_s``, ``tokens``; eval steps add
``val_loss``; GPU runs add ``mfu`` and ``peak_mem_gb`` (``max_memory_allocated``),
CPU runs ``peak_rss_gb``. ``opt_state_bytes`` is the whole job's optimizer state
(summed over ranks), ``weight_bytes`` the whole model's parameters as stored
(:func:`weight_bytes`: int8 codes + scales with ``--model.weight_bits 8``) and
``dense_weight_bytes`` the same parameters dense. A window holding a non-finite loss logs
``loss`` as ``NaN`` or ``Infinity`` (as Python's json writes them), adds
``nonfinite_losses`` (steps × ranks of the window whose loss was not finite) and warns;
skipped updates are recipes/divergence.py's fields.

``tokens_per_s`` (and ``mfu``, derived from it) is the window's tokens over its wall time.
A window ends after the device has finished its work: the host read of the window's
losses (``tolist``, and on CUDA a ``torch.cuda.synchronize`` before it) comes first, then
the clock is read, and the next window starts at that same instant. Windows follow one
another with no gap, so every microsecond of the training loop is charged to one of them
(work still queued on the device at a log point included): the run's wall time is the
sum of its windows plus setup and what follows the last log step (the final
checkpoint, the summary). A window's time includes whatever ran in it: an
evaluation at its log step, and a checkpoint saved at the previous log step.

A resumed run (``start_step`` > 0) first drops the rows after ``start_step`` (steps
logged between the checkpoint and the interruption, done again now), replacing the file
atomically, so every step appears once. :func:`read_metrics` keeps the last row of a
step anyway, for files written before that.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from galore2.core.stored import store_of

# Dense bf16 peak FLOP/s by device-name substring (vendor datasheets, no sparsity).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """This rank's optimizer-state bytes: galore2's own count, else every tensor the state
    holds (also inside objects such as galore-torch's projectors), each storage once
    (bitsandbytes shares one code map between all its parameters' states)."""
    own = getattr(optimizer, "state_bytes", None)
    if callable(own):
        return int(own()["total"])
    seen: set[int] = set()
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            held = vars(v).values() if hasattr(v, "__dict__") and not torch.is_tensor(v) else [v]
            for t in held:
                if isinstance(t, DTensor):
                    t = t.to_local()
                if not isinstance(t, torch.Tensor):
                    continue
                storage = t.untyped_storage()
                key = storage.data_ptr() if storage.nbytes() else id(t)
                if key not in seen:
                    seen.add(key)
                    total += storage.nbytes()
    return total


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """The whole model's parameter bytes (every rank's: a sharded parameter's global size).
    ``weight_bytes``: as stored — an int8 layer's (``galore2.quantize_weights``,
    ``--model.weight_bits 8``) codes and scales, every other parameter in its dtype;
    ``dense_weight_bytes``: the same parameters all dense in their dtypes (the run without
    int8 weights, bf16 ones in a bf16 run)."""
    stored = dense = 0
    for p in model.parameters():
        n = p.numel() * p.element_size()  # an int8 layer's shell: its logical shape
        found = store_of(p)
        dense += n
        stored += n if found is None else found.nbytes()
    return {"weight_bytes": stored, "dense_weight_bytes": dense}


def adamw_state_bytes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """What torch's AdamW would hold for ``model``: two moments per element plus a float32
    step scalar. torch's AdamW keeps its moments in each parameter's dtype (bf16 moments
    for bf16 weights), which ``dtype`` None counts; a ``dtype`` counts them in that one."""
    fixed = None if dtype is None else torch.empty((), dtype=dtype).element_size()
    return sum(
        2 * p.numel() * (fixed or p.element_size()) + 4
        for p in model.parameters()
        if p.requires_grad
    )


def adamw_baseline(model: torch.nn.Module) -> str:
    """Which AdamW :func:`adamw_state_bytes` counts for ``model``: "torch AdamW with bf16
    moments" (the parameters' dtypes, as torch keeps them)."""
    names = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                     if p.requires_grad})  # fmt: skip
    return "torch AdamW with " + "/".join(names.get(d, d) for d in dtypes) + " moments"


def memory_fields(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"peak_mem_gb": torch.cuda.max_memory_allocated(device) / 1e9}
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return {"peak_rss_gb": rss_kb * scale / 1e9}


class Metrics:
    """Accumulates losses between log steps and writes ``metrics.jsonl`` on rank 0."""

    def __init__(
        self,
        out: str | Path,
        *,
        rank: int,
        total_steps: int,
        start_step: int,
        flops_per_token: float,
        device: torch.device,
        progress: bool,
    ) -> None:
        self.rank = rank
        self.device = device
        self.flops_per_token = flops_per_token
        self.peak = peak_flops(device)
        self.path = Path(out) / "metrics.jsonl"
        if rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if start_step == 0 and self.path.exists():
                self.path.unlink()  # a fresh run; a resumed run appends
            elif self.path.exists():
                truncate_after(self.path, start_step)
        self._losses: list[float] = []
        self._tokens = 0
        self._t0 = time.perf_counter()
        self.total_tokens = 0
        self.history: list[dict[str, Any]] = []
        self.bar = None
        if progress and rank == 0:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def add(self, loss: torch.Tensor, tokens: int) -> None:
        """Record one optimizer step's loss (a tensor, synced only at log time) and its tokens
        (all ranks together)."""
        self._losses.append(loss.detach())
        self._tokens += tokens
        self.total_tokens += tokens
        if self.bar is not None:
            self.bar.update(1)

    def log(self, step: int, lr: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Reduce over ranks, write one JSONL line, return it (every rank gets the same dict).

        The window ends once the device is done (the host read, then the clock) and the
        next one starts at that instant: see the module docstring."""
        local, bad = float("nan"), 0.0
        if self._losses:  # one host read: the window's mean loss and its non-finite count
            losses = torch.stack(self._losses).float()
            bad_t = (~torch.isfinite(losses)).sum().float()
            read = torch.stack([losses.mean(), bad_t])
            if self.device.type == "cuda":  # every stream's work, not only the loss's
                torch.cuda.synchronize(self.device)
            local, bad = read.tolist()
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        elapsed = max(now - self._t0, 1e-9)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        loss_sum, bad = all_reduce_sum([local, bad], self.device)
        rec: dict[str, Any] = {
            "step": step,
            "loss": loss_sum / world,
            "lr": lr,
            "tokens_per_s": self._tokens / elapsed,
            "tokens": self.total_tokens,
        }
        if self.peak is not None:
            rec["mfu"] = rec["tokens_per_s"] * self.flops_per_token / (self.peak * world)
        if bad:
            rec["nonfinite_losses"] = int(bad)
            if self.rank == 0:
                warnings.warn(
                    f"step {step}: the training loss was not finite (NaN/Inf) {int(bad)} "
                    f"time(s) in this log window (steps × ranks); logged loss {rec['loss']}",
                    RuntimeWarning,
                    stacklevel=2,
                )
        rec.update(memory_fields(self.device))
        rec.update({k: v for k, v in (extra or {}).items() if v is not None})  # absent, not null
        self.write(rec)
        self._losses, self._tokens = [], 0
        self._t0 = now  # no gap: what follows (writing, a checkpoint) is the next window's
        return rec

    def write(self, rec: dict[str, Any]) -> None:
        self.history.append(rec)
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.bar is not None:
            shown = {k: rec[k] for k in ("loss", "val_loss", "tokens_per_s") if k in rec}
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()})

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics file; a torn last line (a run killed mid-write) is left out."""
    lines = path.read_text().splitlines()
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines):
                break
            raise ValueError(f"{path}:{i}: not a JSON object: {e}") from None
    return rows


def truncate_after(path: str | Path, step: int) -> None:
    """Keep the rows of ``path`` with ``step`` <= ``step`` (write a new file, then replace)."""
    path = Path(path)
    kept = [r for r in _rows(path) if r.get("step", 0) <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl`` (or of that file), one per step in step order:
    where a step was logged twice (a run resumed before the truncation existed), the
    last row wins."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    last = {r["step"]: r for r in _rows(p)}
    return [last[s] for s in sorted(last)]
