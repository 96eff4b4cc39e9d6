"""Per-layer updates: step each parameter inside backward and free its gradient at once.

    updates = galore2.per_layer(model, opt, accumulation_steps=4, scheduler=sched)
    for batch in loader:
        loss = model(**batch).loss / 4
        updates.backward(loss)   # on the 4th micro-batch every parameter is updated
                                 # as soon as its gradient is final, then its .grad freed

Only one parameter's gradient is alive at a time, instead of the whole model's
(the memory GaLore does not save). ``register_post_accumulate_grad_hook`` does the
work; it also fires on FSDP2's sharded parameters once their reduce-scattered
gradient is in place, so this works on one device and under ``fully_shard``.

Semantics: micro-batches before the last one accumulate into ``.grad`` as usual;
on the last one each parameter is stepped by ``optimizer.step_param`` and its
gradient set to ``None``; the LR schedule steps once per optimizer step, after
the last micro-batch. Refused, with a clear error: global gradient clipping
(needs every gradient before any update — clip per parameter in your model, or
use the ordinary ``optimizer.step()``), and ``DistributedDataParallel`` (its
all-reduce finishes after the hooks fire — use FSDP2 or the ordinary step).

An exception inside ``backward`` (e.g. ``FloatingPointError`` from
``nonfinite="raise"``, or an out-of-memory error) abandons the optimizer step: the
micro-batch count restarts, every gradient of the optimizer's parameters is set to
``None`` (the micro-batches accumulated so far are dropped) and the LR schedule is not
stepped; the next ``backward`` starts a new optimizer step. Parameters are stepped one
at a time as their gradients become final, so an exception on the last micro-batch
leaves the update partial: with ``nonfinite="raise"`` the parameter whose gradient is
non-finite (or overflows, see :mod:`galore2.core.nonfinite`) and every parameter after
it in backward order keep their weights and state, while those stepped before it in
that backward pass keep their update. ``nonfinite="skip"`` (the default) skips only the
bad parameter; the ordinary ``optimizer.step()`` raises before any parameter changes.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from .optimizer import ChainOptimizer


class PerLayerUpdates:
    """Step each parameter inside ``backward`` and free its gradient at once.

    Registers a post-accumulate-grad hook on every trainable parameter of ``optimizer``;
    :meth:`backward` replaces ``loss.backward()`` and :meth:`remove` unregisters the hooks.
    Only one parameter's gradient is alive at a time. An exception inside ``backward``
    abandons the optimizer step (gradients dropped, schedule not stepped); parameters
    stepped before it in that backward pass keep their update.

    Args:
        model: the model whose parameters ``optimizer`` updates (refused when wrapped in
            ``DistributedDataParallel``).
        optimizer: a galore2 optimizer (it needs :meth:`ChainOptimizer.step_param`).
        accumulation_steps: micro-batches per optimizer step.
        scheduler: an LR scheduler stepped once per optimizer step, after the last micro-batch.
        max_grad_norm: refused unless ``None``: global clipping needs every gradient first.

    Raises:
        TypeError: ``optimizer`` is not a galore2 optimizer.
        ValueError: ``accumulation_steps`` is not an int >= 1, ``max_grad_norm`` is set, or the
            model is wrapped in ``DistributedDataParallel``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: ChainOptimizer,
        *,
        accumulation_steps: int = 1,
        scheduler: Any = None,
        max_grad_norm: float | None = None,
    ) -> None:
        if not isinstance(optimizer, ChainOptimizer):
            raise TypeError(
                f"optimizer must be a galore2 optimizer (it needs step_param), got "
                f"{type(optimizer).__name__}"
            )
        if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be an int >= 1, got {accumulation_steps!r}")
        if max_grad_norm is not None:
            raise ValueError(
                "max_grad_norm: global gradient clipping needs every gradient before any "
                "update, which per-layer updates never have; clip per parameter (e.g. a "
                "gradient hook in your model) or use the ordinary optimizer.step()"
            )
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise ValueError(
                "per-layer updates do not work under DistributedDataParallel: its gradient "
                "all-reduce completes after the per-parameter hooks fire, so they would see "
                "unreduced gradients; use FSDP2 (torch.distributed.fsdp.fully_shard) or the "
                "ordinary optimizer.step()"
            )
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.accumulation_steps = accumulation_steps
        self.micro_step = 0  # micro-batches seen in the current optimizer step
        self._last = False
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook)
            for group in optimizer.param_groups
            for p in group["params"]
            if p.requires_grad
        ]

    def _hook(self, p: Tensor) -> None:
        if self._last:
            self.optimizer.step_param(p)
            p.grad = None

    def backward(self, loss: Tensor, **kwargs: Any) -> bool:
        """``loss.backward()``; on the last micro-batch also updates and frees every gradient.

        Returns True when this call completed an optimizer step.
        """
        self.micro_step += 1
        self._last = self.micro_step == self.accumulation_steps
        try:
            loss.backward(**kwargs)
        except BaseException:
            self._abandon()
            raise
        finally:
            last, self._last = self._last, False
        if last:
            self.micro_step = 0
            if self.scheduler is not None:
                # The parameters were stepped (inside backward): tell torch's LR scheduler,
                # which otherwise warns that optimizer.step() was never called.
                self.optimizer._opt_called = True  # type: ignore[attr-defined]
                self.scheduler.step()
        return last

    def _abandon(self) -> None:
        """After an exception inside backward: drop this optimizer step (see the module
        docstring) so that the next ``backward`` starts a new one."""
        self.micro_step = 0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    def remove(self) -> None:
        """Unregister the hooks (back to ordinary ``optimizer.step()`` training)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


def per_layer(model: nn.Module, optimizer: ChainOptimizer, **kwargs: Any) -> PerLayerUpdates:
    """Per-layer updates for ``optimizer``'s parameters; see :class:`PerLayerUpdates`."""
    return PerLayerUpdates(model, optimizer, **kwargs)
