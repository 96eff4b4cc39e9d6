"""Llama pre-training: ``python -m recipes.pretrain`` (one process) or ``torchrun -m recipes.pretrain``.

    python -m recipes.pretrain --config tiny --optimizer galore_adamw --steps 300 --out runs/tiny
    torchrun --nproc_per_node 8 -m recipes.pretrain --config llama_60m --out runs/60m

Settings: recipes/config.py (``--help`` lists them all). Under torchrun the model
is FSDP2-sharded (gloo on CPU, nccl on GPU). The run resumes from the newest
checkpoint in ``--out`` (recipes/resume.py: what may change on resume, damaged
checkpoints, refusing to mix two runs in one folder) and writes ``metrics.jsonl``,
``config.json`` and ``summary.json`` there, and at the end (rank 0) the run's loss
curves, ``loss.png`` (recipes/plot.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import ExitStack

import galore2

from . import data, optimizers, resume
from . import model as modeling
from .cli import run_cli
from .divergence import Diverged, SkipWatch, likely_causes
from .metrics import (
    Metrics,
    adamw_baseline,
    adamw_state_bytes,
    all_reduce_sum,
    optimizer_state_bytes,
    weight_bytes,
)
from .plot import write_run_plot
from .resolve import parse_args
from .runtime import evaluate, setup, teardown, train_step
from .summary import print_summary, write_config
from .tokenizer import check_vocab_size


def capture_step(opt, device, rank: int):
    """``optim.capture``: the step to call instead of ``opt.step`` — a
    :class:`galore2.CapturedStep` (its constructor refuses an optimizer whose steps cannot
    replay, naming the reasons); on a CPU, ``opt.step`` itself after that check (CUDA
    graphs need a GPU), with a note."""
    captured = galore2.CapturedStep(opt)
    if device.type == "cuda":
        return captured
    if rank == 0:
        print(f"optim.capture: CUDA graphs need a GPU; on {device.type} every step runs "
              "eagerly (capturable=True, gradients zeroed in place)")  # fmt: skip
    return opt.step


def main(
    argv: list[str] | None = None, peers: Mapping[str, optimizers.Peer] = optimizers.NO_PEERS
) -> list[dict]:
    """One run; ``peers``: optimizers of other packages it may be given by name (the
    benchmarks' ``benchmarks.peers.PEERS``)."""
    with ExitStack() as held:  # the out dir's lock, from resume.prepare until the run ends
        history, halt, world = _run(argv, peers, held)
        # _run's model, optimizer and FSDP state are gone now: a rank that destroys the
        # process group while they still hold it dies now and then at exit (SIGABRT)
        teardown(world)
    if halt is not None:
        raise Diverged(halt)
    return history


def _run(
    argv: list[str] | None, peers: Mapping[str, optimizers.Peer], held: ExitStack
) -> tuple[list[dict], str | None, int]:
    """The run up to its last log line: (metrics history, why it stopped early or None,
    world size)."""
    job = parse_args(argv)  # the one step that knows the optimizer's options
    t, o = job.train, job.optim
    if o.per_layer and o.max_grad_norm:
        raise ValueError(
            "optim.per_layer cannot clip the global gradient norm: set max_grad_norm 0"
        )
    optimizers.check_capture_schedule(o, t.steps)
    rank, world, device = setup(job)
    if o.capture and world > 1:  # FSDP2's collectives inside a graph are not checked
        raise ValueError("optim.capture runs in one process only (not under torchrun yet)")
    run = held.enter_context(resume.prepare(job))  # out dir locked and checked, settings too

    tokenizer = data.load_tokenizer(job.data.tokenizer)
    check_vocab_size(tokenizer, job.model.vocab_size)  # an error, or T5's sentinels: a warning
    train_loader, val_loader = data.build_loaders(job.data, tokenizer, t.batch_size, rank, world)
    dtype = modeling.param_dtype(job.model, device)  # built in it: never held in fp32
    model = modeling.build_model(job.model, device, dtype=dtype, world_size=world)
    opt = optimizers.build_optimizer(model, o, t.steps, peers)
    sched = optimizers.build_scheduler(opt, o, t.steps, peers)
    step_fn = capture_step(opt, device, rank) if o.capture else None
    updates = None
    if o.per_layer:
        updates = galore2.per_layer(model, opt, accumulation_steps=t.grad_accum, scheduler=sched)
    start, tokens = run.load(model, opt, sched, train_loader, device)

    n_body = modeling.n_params(model, exclude_embeddings=True)
    metrics = Metrics(
        t.out,
        rank=rank,
        total_steps=t.steps,
        start_step=start,
        flops_per_token=modeling.flops_per_token(job.model, n_body, job.data.seq_len),
        device=device,
        progress=t.progress,
    )
    metrics.total_tokens = tokens
    if rank == 0:
        write_config(t.out, job, run.all_changes)
        if o.fixed:  # resolved into job.optim: APOLLO's α, APOLLO-Mini's rank 1
            values = ", ".join(f"optim.{k}={v:g}" for k, v in o.fixed.items())
            print(f"{o.name}: {values} (fixed by the preset; other values are not used)")
    opt_bytes = None
    weights = weight_bytes(model)  # the stored format's size is fixed
    # peers keep Python objects in their state, which weights-only checkpoints refuse
    checkpoints = t.checkpoint_every >= 0 and o.name not in peers
    stop = min(t.stop_after, t.steps) if t.stop_after > 0 else t.steps
    causes = likely_causes(optimizers.setting(o, "lr"), optimizers.setting(o, "scale"))
    watch = SkipWatch(opt, t.max_skip_steps, rank=rank, world=world, device=device,
                      causes=causes, start_step=start)  # fmt: skip
    halt = None  # why the run stops early (the same on every rank; decided at log steps)
    for step in range(start + 1, stop + 1):
        loss = train_step(model, train_loader, opt, sched, updates, job, device, step_fn)
        metrics.add(loss, train_loader.tokens_per_batch * t.grad_accum * world)
        if step % t.log_every == 0 or step == stop:
            if opt_bytes is None:  # state exists after the first step; its size is fixed
                opt_bytes = int(all_reduce_sum([float(optimizer_state_bytes(opt))], device)[0])
            skips, halt = watch.at_log(step)  # the skip counters' only read
            last = step == stop or halt is not None
            extra = {"opt_state_bytes": opt_bytes, **weights, **skips}
            if t.eval_batches and (step % t.eval_every == 0 or last):
                extra["val_loss"] = evaluate(model, val_loader, t.eval_batches, device)
            metrics.log(step, sched.get_last_lr()[0], extra)
        if halt is not None:  # no checkpoint of a diverged state: the last good one stays
            break
        last = step == stop
        if checkpoints and ((t.checkpoint_every and step % t.checkpoint_every == 0) or last):
            run.save(step, model, opt, train_loader, metrics.total_tokens, device)
    metrics.close()
    if rank == 0 and isinstance(step_fn, galore2.CapturedStep):
        c = step_fn
        print(f"capture: {c.replays} steps replayed, {c.captures} graphs captured, "
              f"{c.eager_steps} steps eager (refreshes, warm-up)")  # fmt: skip
    if rank == 0 and start >= stop:
        print(
            f"{t.out}: already at step {start} of {stop}; nothing to do "
            "(use more --steps, or another --out)"
        )
    if rank == 0 and metrics.history:
        projected = optimizers.projects(o.name, peers)
        png = write_run_plot(job, modeling.n_params(model), world, projected)
        adamw = (adamw_state_bytes(model), adamw_baseline(model))  # the AdamW this run would use
        print_summary(job, metrics.history, opt_bytes, adamw[0], halt, png, adamw[1],
                      weights)  # fmt: skip
    return metrics.history, halt, world


if __name__ == "__main__":
    run_cli(main)
