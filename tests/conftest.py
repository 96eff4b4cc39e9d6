import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Without a GPU, Triton kernels run under Triton's CPU interpreter (tests/test_triton_kernels.py).
# triton reads this when a kernel is defined, so it is set before anything imports triton.
# Automatic kernel selection still never picks Triton for CPU tensors (galore2.kernels.dispatch).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# README's command runs the suite on pytest-xdist workers, one per core: one torch thread each,
# so that two workers' thread pools never fight over the cores (every test holds at any thread
# count). The processes a test starts inherit the same default through OMP_NUM_THREADS (one
# that sets its own thread count still does): a child with a thread per core, beside two busy
# workers, spends about as much CPU waiting for its threads as working (the tiny fit_24gb
# child: 27 s of CPU with two threads, 15 s with one, on the loaded 2-core machine).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
