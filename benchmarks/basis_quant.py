"""Quantized GaLore bases: bytes per entry and the error they add (``basis_dtype``).

``python -m benchmarks.run --tasks basis_quant``: 4096×1024 synthetic, r=256; tiny Llama,
r=32. ``--quick``: 1024×256, r=64; tiny Llama at init (smoke).

For each storage format — fp32 (reference), bf16, int8 and int4 with groups of
256 along the rank axis, int4 with groups of 64, each int format with and without
the random Hadamard rotation — a basis B is encoded and decoded exactly as the
optimizer stores it (``galore2.storage.basis``) and compared with B:

* bytes per basis entry: stored bytes (codes + fp32 scales) / (rows · r);
* reconstruction error ‖B − B̃‖_F / ‖B‖_F;
* projection error ‖B·Bᵀ·G − B̃·B̃ᵀ·G‖_F / ‖B·Bᵀ·G‖_F (G·B·Bᵀ for a right basis): how
  far the rank-r gradient GaLore works with moves.

Two sets of bases, both exact top-r singular vectors:

* synthetic: G = U·diag(s)·Vᵀ + E, 4096×1024, U (4096×256) and V (1024×256) random
  orthonormal, s_i = 1/(1 + i/32) (a decaying spectrum), E Gaussian noise of 3%
  relative norm projected off U and V, so that B = U is G's exact top-256 left
  singular basis (E's singular values ≈ 0.01 < s_255 ≈ 0.11);
* tiny Llama: the gradients of the recipe's ``tiny`` model (``recipes/configs/tiny.toml``:
  byte-level Llama, dim 128, 4 layers, ffn 352) on one batch of the embedded corpus,
  taken after 5 AdamW steps (lr 1e-3; none with ``--quick``), for every attention and
  MLP weight (28 matrices), each projected on its ``std`` side at r=32 (bases 128×32,
  ``torch.linalg.svd``).
  Errors are pooled: sqrt(Σ‖error‖² / Σ‖reference‖²) over the matrices. With r=32 a
  row is a single group (32 < 64), so the two int4 group sizes coincide.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from galore2.projectors import LEFT, RIGHT, Plan, choose_side
from galore2.storage.basis import FORMATS, Quantization, basis_zeros

from ._common import render, table

FULL_SIZE = {"m": 4096, "n": 1024, "rank": 256, "llama_steps": 5}
QUICK_SIZE = {"m": 1024, "n": 256, "rank": 64, "llama_steps": 0}
LLAMA_RANK = 32
# (label, basis_dtype, basis_group_size, basis_hadamard)
FORMATS_RUN = [
    ("fp32", "fp32", 256, False),
    ("bf16", "bf16", 256, False),
    ("int8 g256", "int8", 256, False),
    ("int8 g256 + H", "int8", 256, True),
    ("int4 g256", "int4", 256, False),
    ("int4 g256 + H", "int4", 256, True),
    ("int4 g64", "int4", 64, False),
    ("int4 g64 + H", "int4", 64, True),
]


def decaying_matrix(m: int, n: int, rank: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """(G, U): G = U·diag(s)·Vᵀ + E, m×n, with U (m×rank), V (n×rank) random orthonormal,
    s_i = 1/(1 + i/32), and E Gaussian noise of 3% relative norm projected off U and V
    (so E's singular values, ≈ 0.01, sit far below s_rank ≈ 0.11 and U is exactly G's
    top-``rank`` left singular basis — no SVD of G needed)."""
    gen = torch.Generator().manual_seed(seed)
    U = torch.linalg.qr(torch.randn(m, rank, generator=gen)).Q
    V = torch.linalg.qr(torch.randn(n, rank, generator=gen)).Q
    s = 1.0 / (1.0 + torch.arange(rank, dtype=torch.float32) / 32.0)
    S = (U * s) @ V.mT
    N = torch.randn(m, n, generator=gen)
    N = N - U @ (U.mT @ N)
    N = N - (N @ V) @ V.mT
    return S + N * (0.03 * S.norm() / N.norm()), U


def top_basis(G: Tensor, side: int, rank: int) -> Tensor:
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    return U[:, :rank] if side == LEFT else Vh[:rank].mT


def project(B: Tensor, G: Tensor, side: int) -> Tensor:
    return B @ (B.mT @ G) if side == LEFT else (G @ B) @ B.mT


def roundtrip(B: Tensor, basis: str, group_size: int, hadamard: bool, seed: int) -> Tensor:
    """B as the optimizer's state would return it (encoded, stored, decoded)."""
    rows, r = B.shape
    plan = Plan(LEFT, rows, rows, r, B.device, basis=basis, group_size=group_size,
                hadamard=hadamard, basis_seed=seed)  # fmt: skip
    fmt, state = FORMATS[basis], {}
    fmt.allocate(state, "proj.left", (rows, plan.rank), "rows", basis_zeros(plan), plan)
    fmt.store(state, "proj.left", B, plan)
    out = fmt.load(state, "proj.left", plan)
    assert out is not None
    return out


def measure(pairs: list[tuple[Tensor, Tensor, int]]) -> dict[str, tuple[float, float, float]]:
    """label → (bytes per entry, pooled reconstruction error, pooled projection error)
    over (basis, gradient, side) triples."""
    refs = [project(B, G, side) for B, G, side in pairs]
    out = {}
    for label, basis, group_size, hadamard in FORMATS_RUN:
        nbytes = entries = rec = rec_ref = proj = proj_ref = 0.0
        for i, ((B, G, side), ref) in enumerate(zip(pairs, refs, strict=True)):
            rows, r = B.shape
            nbytes += FORMATS[basis].nbytes((rows, r), params=Quantization(group_size, hadamard))
            entries += rows * r
            Bq = roundtrip(B, basis, group_size, hadamard, seed=1000 + i)
            rec += float((B - Bq).square().sum())
            rec_ref += float(B.square().sum())
            proj += float((ref - project(Bq, G, side)).square().sum())
            proj_ref += float(ref.square().sum())
        out[label] = (nbytes / entries, (rec / rec_ref) ** 0.5, (proj / proj_ref) ** 0.5)
    return out


def llama_gradients(steps: int) -> list[tuple[str, Tensor]]:
    """(name, gradient) of every attention/MLP weight of the recipe's tiny Llama on one
    batch, after ``steps`` AdamW steps."""
    from recipes import data
    from recipes.model import build_model
    from recipes.resolve import parse_args

    job = parse_args(["--config", "tiny"])
    torch.manual_seed(job.train.seed)
    tokenizer = data.load_tokenizer(job.data.tokenizer)
    loader, _ = data.build_loaders(job.data, tokenizer, job.train.batch_size)
    model = build_model(job.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps + 1):
        opt.zero_grad(set_to_none=True)
        model(**loader.next_batch()).loss.backward()
        if step < steps:
            opt.step()
    return [
        (name, p.grad.detach().clone())
        for name, p in model.named_parameters()
        if p.grad is not None and p.dim() == 2 and ("self_attn" in name or "mlp" in name)
    ]


def basis_quant(quick: bool) -> str:
    size = QUICK_SIZE if quick else FULL_SIZE
    m, n, rank = size["m"], size["n"], size["rank"]
    start = time.perf_counter()
    G, U = decaying_matrix(m, n, rank)
    synthetic = measure([(U, G, LEFT)])

    grads = llama_gradients(size["llama_steps"])
    pairs = []
    for _, g in grads:
        side = choose_side(tuple(g.shape), "std", LLAMA_RANK)
        assert side in (LEFT, RIGHT)
        pairs.append((top_basis(g, side, LLAMA_RANK), g, side))
    llama = measure(pairs)
    seconds = time.perf_counter() - start

    rows = []
    for label, *_ in FORMATS_RUN:
        b, rec, proj = synthetic[label]
        _, lrec, lproj = llama[label]
        rows.append([label, f"{b:.4f}", f"{b / 4:.3f}", f"{rec:.2e}", f"{proj:.2e}",
                     f"{lrec:.2e}", f"{lproj:.2e}"])  # fmt: skip
    headers = ["basis", f"bytes/entry (r={rank})", "÷ fp32", "synthetic ‖B−B̃‖/‖B‖",
               "synthetic proj. error", "tiny Llama ‖B−B̃‖/‖B‖", "tiny Llama proj. error"]  # fmt: skip
    return render("basis_quant", rank=rank, m=m, n=n, llama_rank=LLAMA_RANK,
                  matrices=len(pairs), llama_steps=size["llama_steps"], seconds=seconds,
                  threads=torch.get_num_threads(), table=table(headers, rows))  # fmt: skip
