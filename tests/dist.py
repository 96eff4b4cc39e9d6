"""What the distributed tests share: gloo ranks, a small model, sharding, data, training, and
"the sharded run equals one process" checks.

Spawning
    ``spawn(fn, world, *args, timeout=600)`` runs ``fn(rank, world, *args)`` on ``world`` CPU
    processes with a gloo process group. A raise in any rank fails the call with that rank's
    traceback; ranks still running at the deadline (one blocked in a collective) are killed
    and ``TimeoutError`` names the worker. After ``fn`` returns, every rank frees its garbage
    and meets the others at a barrier before the group is destroyed: a rank that tears gloo
    down while its peers still talk to it otherwise dies now and then at exit (SIGABRT,
    "terminate called without an active exception") after the body has passed.
    The ranks are kept between the calls of one test file (importing torch and galore2
    costs each fresh process seconds of CPU; the suite spawns about fifty times): each call
    starts from the parent's environment, the seed it started with and float32 as the
    default dtype, and a new process group; another file's calls, a failure or a timeout
    get new ranks. A body that patches a class or module puts back what it found. New
    ranks are forked from a forkserver: a fresh interpreter that imported this module
    (torch, galore2) once and ran nothing else, so a rank starts as a fresh process would,
    less the imports (the test process's patches never reach it).

Building
    ``make_model()`` (7×10 left, 13×7 right, 5×13 left, biases plain), ``data(step)``,
    ``cpu_mesh(world)``, ``shard(model, mesh, units)`` (FSDP2 on a 1-D mesh, HSDP on a 2-D one),
    ``optimizer(model, settings)`` (GaLoreAdamW over ``galore2.param_groups``).

Training and comparing
    ``train(model, opt, steps, rank, world)`` gives rank r its 1/world of each batch;
    ``sharded_vs_single(...)`` trains a copy in one process and a wrapped copy on the ranks;
    ``assert_params_match``, ``max_change``, ``assert_same_across``, ``refresh_counts``,
    ``full``, ``full_params``, ``full_state`` read the results back.
"""

from __future__ import annotations

import atexit
import copy
import gc
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import galore2

# ---- spawning ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        gc.collect()  # DDP reducers, FSDP states, DTensors holding groups: gone before teardown
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _serve(rank: int, inbox: Any, outbox: Any) -> None:
    """A pooled rank: run each task it is handed, as a fresh process would, and report."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    seed, environ = torch.initial_seed(), dict(os.environ)
    while (task := inbox.get()) is not None:
        world, port, env, fn, args = task
        # what a fresh process starts from: the parent's environment, the seed torch drew at
        # start, float32 as the default dtype
        os.environ.clear()
        os.environ.update({**environ, **env})
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.float32)
        try:
            _run_rank(rank, world, port, fn, args)
        except BaseException:  # reported to the parent, which fails the test
            outbox.put((rank, traceback.format_exc()))
            return  # a failed rank may leave gloo or globals broken: the pool is discarded
        outbox.put((rank, None))


class _Pool:
    """Ranks kept alive between ``spawn`` calls (each import of torch and galore2 costs a
    fresh process seconds of CPU); discarded on any failure or timeout."""

    def __init__(self) -> None:
        # forkserver: ranks are forked from one server process per test process that has
        # imported torch and galore2 once (this module; nothing run, no threads started),
        # instead of each importing them (seconds of CPU per rank, about a hundred ranks per
        # suite); everything else a rank starts from is reset by ``_serve`` at each call
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload([__name__])
        self.outbox = self.ctx.Queue()
        self.ranks: list[tuple[Any, Any]] = []  # (process, inbox)
        self.owner = ""  # the test file whose calls the ranks serve

    def grow(self, world: int) -> None:
        while len(self.ranks) < world:
            inbox = self.ctx.SimpleQueue()
            proc = self.ctx.Process(
                target=_serve, args=(len(self.ranks), inbox, self.outbox), daemon=True
            )
            proc.start()
            self.ranks.append((proc, inbox))

    def close(self, *, idle: bool = False) -> None:
        """End the ranks: idle ones are asked to exit and given a few seconds (a rank killed
        right after it reported may still hold the outbox's write lock, which would block
        every later rank's report), then any still alive are killed. The outbox is never
        reused: a closed pool is dropped."""
        if idle:
            for proc, inbox in self.ranks:
                if proc.is_alive():
                    inbox.put(None)
            for proc, _ in self.ranks:
                proc.join(timeout=10)
        for proc, _ in self.ranks:
            if proc.is_alive():
                proc.kill()
            proc.join()
        self.ranks.clear()


_POOL: _Pool | None = None


@atexit.register
def _close_pool() -> None:
    if _POOL is not None:
        _POOL.close(idle=True)


def _errors(pool: _Pool, world: int, done: set[int], rank: int, error: str) -> str:
    """Every rank's traceback, in rank order: the first to report is often a peer that lost
    its connection, not the rank that raised (waits a few seconds for the others)."""
    errors = {rank: error}
    until = time.monotonic() + 5.0
    while len(done) < world and time.monotonic() < until:
        try:
            other, text = pool.outbox.get(timeout=max(0.01, until - time.monotonic()))
        except queue.Empty:
            break
        done.add(other)
        if text is not None:
            errors[other] = text
    return "".join(f"\n(rank {r}):\n{errors[r]}" for r in sorted(errors))


def spawn(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 600) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; fail on any rank's raise or
    after ``timeout`` seconds."""
    global _POOL
    what = f"{fn.__module__}.{fn.__qualname__} on {world} rank{'s' * (world > 1)}"
    # a test file's calls share ranks, another file's get new ones (and a new outbox): what a
    # body leaves behind (a patched class, a library's singleton) reaches only its own file
    where = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0]
    if _POOL is not None and _POOL.owner != where:
        _POOL.close(idle=True)
        _POOL = None
    if _POOL is None:
        _POOL = _Pool()
        _POOL.owner = where
    pool = _POOL
    pool.grow(world)
    port = _free_port()
    env = dict(os.environ)
    for _proc, inbox in pool.ranks[:world]:
        inbox.put((world, port, env, fn, args))
    deadline = time.monotonic() + timeout
    done: set[int] = set()
    try:
        while len(done) < world:
            try:
                wait = max(0.01, min(1.0, deadline - time.monotonic()))
                rank, error = pool.outbox.get(timeout=wait)
            except queue.Empty:
                dead = [r for r, (p, _) in enumerate(pool.ranks[:world]) if not p.is_alive()]
                if dead:
                    codes = [pool.ranks[r][0].exitcode for r in dead]
                    raise AssertionError(
                        f"{what} failed: rank {dead[0]} exited ({codes[0]})"
                    ) from None
                if time.monotonic() >= deadline:
                    alive = [r for r in range(world) if r not in done]
                    raise TimeoutError(
                        f"{what} did not finish in {timeout:g} s; ranks {alive} still running "
                        "(probably blocked in a collective)"
                    ) from None
                continue
            done.add(rank)
            if error is not None:
                raise AssertionError(f"{what} failed{_errors(pool, world, done, rank, error)}")
    except BaseException:
        pool.close()
        _POOL = None
        raise


# ---- model, mesh, sharding, data, optimizer --------------------------------------------------

STEPS, GAP, RANK, BATCH = 20, 8, 3, 12  # refreshes at steps 0, 8, 16


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    # 7×10 (left, uneven for 2 and 3 ranks), 13×7 (right), 5×13 (left), biases plain.
    return nn.Sequential(nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))


def cpu_mesh(*shape: int, names: tuple[str, ...] | None = None):
    """A CPU device mesh: ``cpu_mesh(world)`` for FSDP2, ``cpu_mesh(2, 2, names=...)`` for HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def shard(model: nn.Module, mesh, units: Iterable[nn.Module] | None = None) -> nn.Module:
    """``fully_shard`` each unit (default: the Linear children), then the root.

    ``mesh`` is a device mesh (1-D: FSDP2, 2-D: HSDP) or a world size (a 1-D mesh)."""
    from torch.distributed.fsdp import fully_shard

    if isinstance(mesh, int):
        mesh = cpu_mesh(mesh)
    if units is None:
        units = [m for m in model.children() if isinstance(m, nn.Linear)]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def data(step: int, *, seed: int = 100, batch: int = BATCH, d_in: int = 10, d_out: int = 5):
    g = torch.Generator().manual_seed(seed + step)
    return torch.randn(batch, d_in, generator=g), torch.randn(batch, d_out, generator=g)


def optimizer(model: nn.Module, settings: dict) -> galore2.GaLoreAdamW:
    groups = galore2.param_groups(model, rank=RANK, update_proj_gap=GAP, **settings)
    return galore2.GaLoreAdamW(groups, lr=1e-2, weight_decay=0.05)


# ---- training ------------------------------------------------------------------------------


def split(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a batch (its 1/world)."""
    per = t.shape[0] // world
    return t[rank * per : (rank + 1) * per]


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int | Iterable[int] = STEPS,
    rank: int = 0,
    world: int = 1,
    *,
    data: Callable[[int], tuple[Any, Any]] = data,
    loss: Callable[[Any, Any], torch.Tensor] = nn.functional.mse_loss,
) -> None:
    """``zero_grad``, ``loss(model(x), y).backward()``, ``step`` for each step; with
    ``world > 1`` rank r trains on its 1/world of each batch."""
    for step in range(steps) if isinstance(steps, int) else steps:
        x, y = data(step)
        if world > 1:
            x, y = split(x, rank, world), split(y, rank, world)
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()


def sharded_vs_single(
    rank: int,
    world: int,
    wrap: Callable[[nn.Module], nn.Module],
    build_opt: Callable[[nn.Module], torch.optim.Optimizer],
    *,
    model: Callable[[], nn.Module] = make_model,
    run: Callable[..., Any] = train,
) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer]:
    """Train ``model()`` in this process and a copy wrapped by ``wrap`` (``fully_shard``,
    DDP…) on the ranks, from the same weights and batches (``run(module, opt)`` and
    ``run(wrapped, opt, rank=rank, world=world)``). The optimizer is built after wrapping, on the
    module whose parameters the wrapper trains. Returns ``(module, opt, reference, ref_opt)``."""
    reference = model()
    module = copy.deepcopy(reference)
    ref_opt = build_opt(reference)
    run(reference, ref_opt)
    wrapped = wrap(module)
    opt = build_opt(module)
    run(wrapped, opt, rank=rank, world=world)
    return module, opt, reference, ref_opt


# ---- reading results back ------------------------------------------------------------------


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every rank calls it); ``t`` otherwise."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def assert_params_match(
    model: nn.Module, reference: nn.Module, atol: float = 1e-5, what: str = ""
) -> None:
    """Every parameter of ``model`` (sharded or not) within ``atol`` of ``reference``'s."""
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        diff = (full(p) - full(q)).abs().max().item()
        assert diff <= atol, f"{what}: {name} differs by {diff:.2e}"


def max_change(model: nn.Module, initial: nn.Module) -> float:
    """The largest element change of any parameter from ``initial`` (did it train?)."""
    return max(
        (full(p) - full(q)).abs().max().item()
        for p, q in zip(model.parameters(), initial.parameters(), strict=True)
    )


def assert_same_across(t: torch.Tensor, what: str, group: dist.ProcessGroup | None = None) -> None:
    """``t`` is bitwise the same on every rank of ``group`` (default: the world)."""
    t = t.detach().contiguous()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    for r, part in enumerate(parts):
        assert torch.equal(part, parts[0]), f"{what}: rank {r} differs from rank 0"


def refresh_counts(opt: torch.optim.Optimizer) -> list[int]:
    """``galore.refreshes`` of every projected parameter, in state order."""
    return [int(s["galore.refreshes"]) for s in opt.state.values() if "galore.refreshes" in s]


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded and cloned (a collective: all ranks call it)."""
    return {n: full(p).detach().clone() for n, p in model.named_parameters()}


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict]:
    """Every parameter and state tensor, unsharded (a collective: all ranks call it)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = {"param": full(p).detach().clone()}
        out[name].update({k: full(v).clone() for k, v in opt.state[p].items()})
    return out
