"""benchmarks.gpu_host: the CUDA path's host time measured on the CPU, the kernels stubbed.
What is tested is that it measures that path (counted, never timed): each row's step takes
galore2's Triton launches (stubbed), defers its flags, and runs no kernel."""

from __future__ import annotations

import sys

import pytest
import torch

if sys.platform != "linux":  # triton ships Linux wheels only
    pytest.skip("triton is only installed on Linux", allow_module_level=True)

from benchmarks import gpu_host
from galore2.core import deferred

#: Triton launches of a non-refresh step (the roofline's custom ops): GaLoreAdamW's three
#: projections, three low-rank Adams, three write-backs and its plain group's two adamw_;
#: Fira's projections take its residual's norms, APOLLO's its gradients'
#: (galore2::project_norms_each: 3 fewer each)
LAUNCHES = {"GaLoreAdamW": 11, "GaLoreAdamW8bit": 12, "APOLLO": 11, "Fira": 11}


@pytest.mark.parametrize("label", list(LAUNCHES))
def test_the_cuda_path_runs_with_its_launches_stubbed(label, monkeypatch):
    records: list[int] = []
    real = deferred.DeferredSkips.record

    def spy(self, batches):
        records.append(len(batches))
        return real(self, batches)

    monkeypatch.setattr(deferred.DeferredSkips, "record", spy)
    model = gpu_host._model()
    with gpu_host.cuda_path() as launches, torch.no_grad():
        opt = gpu_host.makers([label])[label](model)
        for _ in range(3):  # the first refreshes (per matrix, partly on the torch path)
            opt.step()
        weights = [p.detach().clone() for p in model.parameters()]
        before, records[:] = launches[0], []
        opt.step()
        assert launches[0] - before == LAUNCHES[label]
        # no kernel wrote the projections the check read: the stand-in reads say usable
        assert opt.nonfinite_skips == 0
    assert records and all(n > 0 for n in records)  # its flags deferred: no host read
    # no kernel ran, and nothing took a torch path: every weight kept its bits
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), weights, strict=True))


def test_it_refuses_to_run_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"), gpu_host.cuda_path():
        pass
