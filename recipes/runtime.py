"""The recipe's moving parts: process setup, one optimizer step, evaluation."""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist

from .config import JobConfig
from .metrics import all_reduce_sum

_OWNED: list[bool] = []  # non-empty while this module owns the process group


def setup(job: JobConfig) -> tuple[int, int, torch.device]:
    """(rank, world size, device); starts the process group under torchrun (gloo / nccl)."""
    world = (
        dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    )
    if job.train.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"train.device must be auto, cpu or cuda; got {job.train.device!r}")
    if job.train.device == "cuda" and not torch.cuda.is_available():
        why = "is built without CUDA" if torch.version.cuda is None else "sees no CUDA device"
        raise ValueError(
            f"train.device cuda: this torch ({torch.__version__}) {why}; "
            "use --train.device cpu, or auto (CUDA when there is one)"
        )
    cuda = job.train.device == "cuda" or (job.train.device == "auto" and torch.cuda.is_available())
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
        _OWNED.append(True)
    if job.train.threads:
        torch.set_num_threads(job.train.threads)
    torch.manual_seed(job.train.seed)  # identical on every rank: same init, replicated RNG
    return (dist.get_rank() if world > 1 else 0), world, device


def teardown(world: int) -> None:
    """Every rank meets the others before the process group goes (gloo aborts otherwise);
    what still holds the group (FSDP states, DTensors in reference cycles) is freed first."""
    if world > 1 and dist.is_initialized():
        gc.collect()
        dist.barrier()
        if _OWNED:  # a group the caller created is the caller's to destroy
            _OWNED.clear()
            dist.destroy_process_group()


def train_step(
    model, loader, optimizer, scheduler, updates, job: JobConfig, device, step=None
) -> torch.Tensor:
    """One optimizer step over ``grad_accum`` micro-batches; returns the mean loss (a tensor).

    With per-layer ``updates`` the parameters are stepped inside backward (and the
    schedule advanced by it); otherwise: clip (optional), step, schedule, zero. ``step``
    (``optim.capture``: a :class:`galore2.CapturedStep`) replaces ``optimizer.step``;
    the gradients are then zeroed in place, as a CUDA graph reads the same tensors.
    """
    accum = job.train.grad_accum
    total = torch.zeros((), device=device)
    for _ in range(accum):
        batch = {k: v.to(device, non_blocking=True) for k, v in loader.next_batch().items()}
        loss = model(**batch).loss / accum
        if updates is not None:
            updates.backward(loss)
        else:
            loss.backward()
        total += loss.detach()
    if updates is None:
        if job.optim.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), job.optim.max_grad_norm)
        (step or optimizer.step)()
        scheduler.step()
        optimizer.zero_grad(set_to_none=step is None)
    return total


@torch.no_grad()
def evaluate(model, val_loader, n_batches: int, device: torch.device) -> float | None:
    """Mean validation loss over the first ``n_batches`` batches of every rank; None when
    that is no batch at all (``n_batches`` 0): never a made-up 0."""
    model.eval()
    total, rows = torch.zeros((), device=device, dtype=torch.float64), 0
    for b in val_loader.batches(n_batches):  # the last batch may be short: weight by rows
        n = b["input_ids"].shape[0]
        total += model(**{k: v.to(device) for k, v in b.items()}).loss.double() * n
        rows += n
    model.train()
    total_all, rows_all = all_reduce_sum([total.item(), float(rows)], device)
    return total_all / rows_all if rows_all else None
