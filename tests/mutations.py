"""Mutation harness: do the tests notice small, plausible bugs in galore2's core?

    python -m tests.mutations                 # every mutation
    python -m tests.mutations --only NAME,... # some of them
    python -m tests.mutations --list          # names, files and tests

Each mutation is one edit of galore2's source: a small code snippet inside a named function
or class (``where``: ``"Class.method"``, ``"function"``; found by parsing the source, see
:func:`locate`), which must occur exactly once in that definition. The definition is looked
for in ``path`` first, then anywhere in the package ``path`` lies in, so moving a function
to another file does not break its mutations; a missing or ambiguous definition or snippet
makes the harness fail loudly instead of silently testing nothing. An entry without
``where`` (module-level code only, see tests/core/test_mutation_harness.py) is located
in its whole file. For each mutation the repository
(galore2/, tests/, recipes/, tools/, pyproject.toml) is copied to a temporary directory,
the edit is applied there and pytest runs the tests listed for it (``-x``, with
``PYTHONPATH`` set to the copy). The mutation is *killed* when pytest reports a failure,
*survived* when every listed test passes. Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("galore2", "tests", "recipes", "benchmarks", "tools", "pyproject.toml")
TIMEOUT_S = 1800


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    pattern: str  # exact source snippet, found exactly once
    replacement: str
    tests: tuple[str, ...]  # pytest paths / node ids that should kill it
    doc: str = ""
    where: str = ""  # qualified name of the enclosing def/class ("GaLore.step", "adamw_step")


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "galore_decay_order",
        "galore2/optim/galore.py",
        "    takes_decay = True  # folds",
        "    takes_decay = False  # folds",
        ("tests/optim/test_reference_galore_torch.py",),
        "projected matrices decay before the update instead of after it (GaLore is not "
        "handed the step's decay factor: fold dropped)",
        where="GaLore",
    ),
    Mutation(
        "galore_scale",
        "galore2/optim/galore.py",
        'factor = group["scale"] * decay',
        "factor = 1.0 * decay",
        ("tests/optim/test_reference_galore_torch.py",),
        "the low-rank update ignores the scale α",
        where="GaLore._back",
    ),
    Mutation(
        "side_rule",
        "galore2/projectors/base.py",
        "return RIGHT if m >= n else LEFT",
        "return RIGHT if m > n else LEFT",
        ("tests/projectors/test_projectors.py", "tests/optim/test_reference_galore_torch.py"),
        "square matrices project on the left (galore-torch: right)",
        where="choose_side",
    ),
    Mutation(
        "plain_decay_order",
        "galore2/core/apply.py",
        "    if decay != 1.0:\n        p.mul_(decay)\n    p.add_(u, alpha=-lr)",
        "    p.add_(u, alpha=-lr)\n    if decay != 1.0:\n        p.mul_(decay)",
        ("tests/core/test_adamw_equivalence.py",),
        "dense updates decay after the update (torch.optim.AdamW: before)",
        where="apply_update",
    ),
    Mutation(
        "bias_correction",
        "galore2/optim/adam_paths.py",
        "bias_correction2_sqrt = math.sqrt(bias_correction(beta2, t))",
        "bias_correction2_sqrt = 1.0",
        ("tests/core/test_adamw_equivalence.py",),
        "Adam (per tensor, and batched at one host step) without the second moment's bias "
        "correction",
        where="corrections",
    ),
    Mutation(
        "foreach_moments",
        "galore2/optim/adam.py",
        "weights, decays = 1 - beta1, beta2",
        "weights, decays = 1 - beta1, beta1",
        ("tests/core/test_foreach.py",),
        "foreach Adam's second moment decays with β₁",
        where="ScaleByAdam._directions",
    ),
    Mutation(
        "batched_decay",
        "galore2/core/apply.py",
        "            torch._foreach_mul_(ps, decay)\n",
        "            pass\n",
        ("tests/core/test_foreach.py",),
        "the batched (foreach) step drops the weight decay of dense updates",
        where="apply_updates",
    ),
    Mutation(
        "moments_rotation",
        "galore2/optim/projection.py",
        "x = (C * C if squared else C) @ x",
        "x = (C * C if squared else C).mT @ x",
        ("tests/optim/test_project_rotation.py",),
        "moments rotated with Cᵀ instead of C = P_newᵀ·P_old on a refresh",
        where="Projection.rotation.rotate",
    ),
    Mutation(
        "orthonormalization",
        "galore2/projectors/_sketch.py",
        "        Q, ok = cholesky_qr2(Y, placement)\n",
        "        Q, ok = Y, torch.tensor(True)\n",
        ("tests/projectors/test_projectors.py",),
        "randomized / warm-started bases are not orthonormalized",
        where="certified.fast",
    ),
    Mutation(
        "sketch_rotation",
        "galore2/projectors/_sketch.py",
        "return Y @ top_eigvecs(B @ B.mT, rank, Y.dtype)",
        "return Y[:, :rank]",
        ("tests/projectors/test_projectors.py",),
        "randomized left basis: the sketch's first r directions, not B = YᵀG's top r",
        where="left_basis",
    ),
    Mutation(
        "cholesky_qr_passes",
        "galore2/projectors/_sketch.py",
        "Q = torch.linalg.solve_triangular(R, Q1, upper=True, left=False)",
        "Q = Q1",
        ("tests/projectors/test_projectors.py",),
        "CholeskyQR2 runs one pass (loses orthogonality on ill-conditioned input)",
        where="cholesky_qr2",
    ),
    Mutation(
        "qr_certificate",
        "galore2/projectors/_sketch.py",
        "near = torch.linalg.matrix_norm(gram - eye) <= _CERTIFY",
        "near = torch.linalg.matrix_norm(gram - eye) <= math.inf",
        ("tests/projectors/test_projectors.py",),
        "CholeskyQR2 trusted on any finite result (rank-deficient or too ill-conditioned sketches)",
        where="cholesky_qr2",
    ),
    Mutation(
        "sign_alignment",
        "galore2/projectors/base.py",
        "signs = torch.where(dots < 0, -1.0, 1.0)",
        "signs = torch.where(dots < 0, 1.0, 1.0)",
        ("tests/projectors/test_projectors.py",),
        "refreshed basis columns keep arbitrary signs",
        where="align_signs",
    ),
    Mutation(
        "block_axis_8bit",
        "galore2/storage/dynamic8.py",
        'dim = 0 if layout == "cols" else 1',
        'dim = 1 if layout == "cols" else 0',
        ("tests/storage/test_moment_storage.py", "tests/optim/test_adam8bit.py"),
        "8-bit moments blocked along the other axis",
        where="block_dim",
    ),
    Mutation(
        "stable_wd_sigma",
        "galore2/optim/weights.py",
        "sigma = stats.second_moment_mean.clamp(min=0.0).sqrt()",
        "sigma = stats.second_moment_mean.clamp(min=0.0)",
        (
            "tests/optim/test_ranger_modules.py::"
            "test_stable_weight_decay_reaches_every_parameter_with_sigma_from_adam_states",
            "tests/optim/test_ranger21.py",
        ),
        "stable weight decay divides by σ² instead of σ",
        where="StableWeightDecay._factor",
    ),
    Mutation(
        "fsdp_reduce_scatter",
        "galore2/optim/projection.py",
        "R = plan.placement.reduce_scatter_cols(R)",
        "R = R.chunk(plan.placement.world, dim=1)[plan.placement.rank].contiguous()",
        ("tests/fsdp/test_fsdp.py::test_fsdp_matches_single_process",),
        "left side: each rank keeps its columns of its own partial PᵀG (reduction dropped)",
        where="LeftProjection.reduce",
    ),
    Mutation(
        "limiter_norm_local",
        "galore2/optim/residual.py",
        "norm = plan.placement.reduce(sq)[0].sqrt() / bias",
        "norm = sq[0].sqrt() / bias",
        ("tests/fsdp/test_fsdp_lowrank.py::test_lowrank_modules_match_single_process",),
        "FSDP: the norm-growth limiter compares this rank's ‖S_i‖ (all-reduce dropped)",
        where="_limit",
    ),
    Mutation(
        "apollo_tensor_local",
        "galore2/optim/residual.py",
        "sums = plan.placement.reduce(sums)",
        "sums = sums",
        ("tests/fsdp/test_fsdp_lowrank.py::test_lowrank_modules_match_single_process",),
        "FSDP: APOLLO-Mini's ‖N‖_F/‖R‖_F of a RIGHT matrix from this rank's rows only",
        where="_combine",
    ),
    Mutation(
        "muon_gram_local",
        "galore2/optim/muon.py",
        "reduce = ctx.placement.reduce if sharded is not None else (lambda t: t)",
        "reduce = lambda t: t",
        ("tests/fsdp/test_fsdp_lowrank.py::test_lowrank_modules_match_single_process",),
        "FSDP: Muon orthogonalizes each rank's shard alone (Gram all-reduce dropped)",
        where="ScaleByMuon.update",
    ),
    Mutation(
        "muon_local_shape",
        "galore2/optim/muon.py",
        "return m, cols",
        "return rows, cols",
        ("tests/fsdp/test_fsdp_lowrank.py::test_lowrank_modules_match_single_process",),
        "FSDP: Muon's lr adjustment of a row-sharded direction from the local shard's rows",
        where="_global_2d",
    ),
    Mutation(
        "muon_replicated_reduce",
        "galore2/optim/muon.py",
        '"replicate": -1}',
        '"replicate": 0}',
        ("tests/fsdp/test_fsdp_lowrank.py::test_lowrank_modules_match_single_process",),
        "FSDP: Muon all-reduces the Gram matrix of a replicated r×r direction (proj_type=full)",
    ),
    Mutation(
        "muon_param_layout",
        "galore2/optim/muon.py",
        'return _sharded_dim(int(state["muon.split_dim"]), placement)',
        "return 0",
        ("tests/fsdp/test_fsdp_lowrank.py::test_lowrank_modules_match_single_process",),
        "FSDP: Muon splits every direction on dim 0 (update's context: the parameter's layout)",
        where="_split_of",
    ),
    Mutation(
        "muon_param_shape",
        "galore2/optim/muon.py",
        "        return rows, int(ctx.global_shape.numel() // m)\n    return rows, cols",
        "        return rows, int(ctx.global_shape.numel() // m)\n"
        "    return m, int(ctx.global_shape.numel() // m)",
        ("tests/optim/test_galore_muon.py",),
        "Muon's lr adjustment and short side from the parameter's m×n, not the direction's",
        where="_global_2d",
    ),
    Mutation(
        "resume_counters",
        "galore2/core/optimizer.py",
        "self.state[p][key] = value.detach().to(device=device, copy=True)",
        "self.state[p][key] = value.detach().to(device=device, "
        "dtype=p.dtype if value.dim() == 0 else value.dtype, copy=True)",
        (
            "tests/core/test_optimizer_contract.py",
            "tests/optim/test_ranger_modules.py::test_resume_mid_lookahead_cycle_is_bit_identical",
        ),
        "load_state_dict casts int64 counters and seeds to the parameter's dtype",
        where="ChainOptimizer.load_state_dict",
    ),
    Mutation(
        "newest_checkpoint",
        "galore2/checkpoint/__init__.py",
        "step = max(found)",
        "step = min(found)",
        ("tests/fsdp/test_checkpoint_helper.py",),
        "load_checkpoint loads the oldest complete checkpoint",
        where="_folder",
    ),
    Mutation(
        "lookahead_alpha",
        "galore2/optim/weights.py",
        "slow.lerp_(w, alpha)",
        "slow.lerp_(w, 1.0 - alpha)",
        ("tests/optim/test_ranger_modules.py", "tests/optim/test_ranger21.py"),
        "lookahead moves the slow weights by 1 − α",
        where="Lookahead._sync",
    ),
    # ---- issue 27: Ranger21's modules on the batched path (foreach=True) -------------------
    Mutation(
        "batched_agc_clip",
        "galore2/optim/gradient.py",
        "factor = limit.div_(g_norm).nan_to_num_(nan=1.0).clamp_max_(1.0)",
        "factor = limit.div_(g_norm).nan_to_num_(nan=1.0).clamp_max_(2.0)",
        ("tests/optim/test_ranger_batched.py",),
        "batched AGC scales units under the limit up to it",
        where="AdaptiveGradientClipping.apply_many",
    ),
    Mutation(
        "batched_lookahead_alpha",
        "galore2/optim/weights.py",
        "torch._foreach_lerp_(slows, ws, float(LOOKAHEAD_ALPHA.of(group)))",
        "torch._foreach_lerp_(slows, ws, 1.0 - float(LOOKAHEAD_ALPHA.of(group)))",
        ("tests/optim/test_ranger_batched.py",),
        "batched lookahead moves the slow weights by 1 − α",
        where="Lookahead.apply_many",
    ),
    Mutation(
        "batched_pnm_passive",
        "galore2/optim/pnm.py",
        "torch._foreach_add_(out, passive, alpha=-beta0 / (norm * bc_passive))",
        "torch._foreach_add_(out, passive, alpha=beta0 / (norm * bc_passive))",
        ("tests/optim/test_ranger_batched.py",),
        "batched PNM adds the passive momentum instead of subtracting it",
        where="ScaleByPNM._foreach",
    ),
    # ---- issue 30: behaviours no test pinned, and the checkpoint folder's one run ----------
    Mutation(
        "older_step_vs_oldest",
        "galore2/checkpoint/runs.py",
        "if existing and existing[-1][0] > step:",
        "if existing and existing[0][0] > step:",
        (
            "tests/fsdp/test_checkpoint_runs.py::"
            "test_older_step_is_compared_with_the_newest_checkpoint",
        ),
        "a save is compared with the oldest checkpoint in the folder, not the newest",
        where="choose",
    ),
    Mutation(
        "checkpoint_takeover",
        "galore2/checkpoint/runs.py",
        "run_id = _implicit(root, step, optimizer, existing, by_step)",
        "run_id = (by_step[existing[-1][0]] if existing else None) or new_run_id()",
        ("tests/fsdp/test_checkpoint_runs.py::test_another_model_cannot_take_over_a_folder",),
        "a save without run_id takes the id of the folder's newest checkpoint, whoever saves",
        where="choose",
    ),
    Mutation(
        "recordless_options_unchecked",
        "galore2/checkpoint/__init__.py",
        "layout.check_options(folder, state, options)",
        "layout.check_options(folder, state, None)",
        ("tests/fsdp/test_checkpoint_runs.py::test_refused_load_without_record_changes_nothing",),
        "a checkpoint without galore2.json is loaded before its group options are compared",
        where="_optimizer_state",
    ),
    Mutation(
        "shard_size_one_way",
        "galore2/checkpoint/files.py",
        "elif size != files[n][0]:",
        "elif size < files[n][0]:",
        (
            "tests/fsdp/test_checkpoint_records.py::"
            "test_a_shard_that_grew_is_refused_without_checksums",
        ),
        "a shard that grew passes the size check (verify=False loads it)",
        where="verify",
    ),
    # ---- issue 39 items 2, 4, 5, 26: refused loads change nothing, a folder's one writer ----
    Mutation(
        "refused_load_keeps_init_state",
        "galore2/checkpoint/__init__.py",
        "            optimizer.state.clear()",
        "            pass",
        (
            "tests/fsdp/test_checkpoint_refusals.py::"
            "test_a_load_refused_by_dcp_leaves_a_fresh_optimizer_fresh",
        ),
        "a load refused by DCP leaves the state of its zero-gradient step in a fresh optimizer",
        where="load_checkpoint",
    ),
    Mutation(
        "owner_by_run_id",
        "galore2/checkpoint/runs.py",
        "if here and held in (origin.run_id, None):",
        "if held == origin.run_id or (here and held is None):",
        (
            "tests/fsdp/test_checkpoint_refusals.py::"
            "test_an_optimizer_loaded_from_a_copy_cannot_save_into_the_original",
        ),
        "an optimizer loaded from a copy of a folder saves into the original (same run id)",
        where="_implicit",
    ),
    Mutation(
        "recordless_folder_taken",
        "galore2/checkpoint/runs.py",
        "if here and held in (origin.run_id, None):",
        "if held in (origin.run_id, None):",
        (
            "tests/fsdp/test_checkpoint_refusals.py::"
            "test_an_optimizer_of_another_run_cannot_take_a_folder_without_records",
        ),
        "an optimizer of another run saves into a folder whose newest checkpoint has no record",
        where="_implicit",
    ),
    Mutation(
        "stray_counts_toward_keep",
        "galore2/checkpoint/__init__.py",
        "            if _complete(p):",
        "            if True:",
        (
            "tests/fsdp/test_checkpoint_refusals.py::"
            "test_a_stray_step_folder_neither_counts_toward_keep_nor_is_deleted",
        ),
        "a stray step-N folder is listed as a checkpoint (counts toward keep, is pruned)",
        where="list_checkpoints",
    ),
    Mutation(
        "refresh_due_before_replan",
        "galore2/core/optimizer.py",
        "        self._check_settings(self.param_groups)  # as step() does first: edits re-planned",
        "        pass",
        (
            "tests/core/test_capture_schedule.py::"
            "test_refresh_due_is_exactly_the_steps_that_refresh",
        ),
        "due_for_refresh (CapturedStep's eager/replay choice) reads the schedule before an "
        "edited update_proj_gap is re-planned (issue 39 item 6)",
        where="ChainOptimizer.due_for_refresh",
    ),
    Mutation(
        "gap_edit_moves_a_due_refresh",
        "galore2/optim/refresh.py",
        "        if due <= step:  # due at the next step, or pending",
        "        if due < step:  # due at the next step, or pending",
        (
            "tests/optim/test_refresh_schedule.py::"
            "test_gap_edit_keeps_a_due_or_pending_refresh_due",
        ),
        "issue 39 #25: an edit of update_proj_gap moves a refresh due at the very next step "
        "onto the new schedule",
        where="replan",
    ),
    Mutation(
        "gap_edit_moves_a_pending_refresh",
        "galore2/optim/refresh.py",
        "        if due <= step:  # due at the next step, or pending (retried): it stays due\n"
        "            continue\n",
        "",
        (
            "tests/optim/test_refresh_schedule.py::"
            "test_gap_edit_keeps_a_due_or_pending_refresh_due",
        ),
        "issue 39 #25: an edit of update_proj_gap moves a refresh pending after a failed one "
        "(or due at the next step) onto the new schedule",
        where="replan",
    ),
    Mutation(
        "gap_edit_pending_gap_unbounded",
        "galore2/optim/refresh.py",
        'if group["adaptive_refresh"] and "galore.gap" in state:  # keep it in the new range',
        'if group["adaptive_refresh"] and "galore.gap" in state and due > step:  # keep it',
        (
            "tests/optim/test_refresh_schedule.py::"
            "test_cap_edit_while_a_refresh_is_pending_bounds_the_adaptive_gap",
        ),
        "issue 39 #25: a pending parameter's adaptive gap is left outside the edited range "
        "(max_update_proj_gap cut: the next gap stays the old one)",
        where="replan",
    ),
    Mutation(
        "capture_lr_not_a_setting",
        "galore2/core/capture.py",
        '_NOT_SETTINGS = frozenset({"params", "param_names", "initial_lr", "name"})',
        '_NOT_SETTINGS = frozenset({"params", "param_names", "initial_lr", "name", "lr"})',
        ("tests/core/test_capture.py::test_a_scheduled_lr_is_a_changed_setting",),
        "issue 39 #23: CapturedStep replays a graph captured with another lr (lr not among "
        "the settings a replay compares); on a GPU also test_replays_follow_an_lr_scheduler",
    ),
    Mutation(
        "capture_settings_by_identity",
        "galore2/core/capture.py",
        "{k: _frozen(v) for k, v in g.items() if k not in _NOT_SETTINGS}",
        "{k: v for k, v in g.items() if k not in _NOT_SETTINGS}",
        ("tests/core/test_capture.py::test_a_scheduled_lr_is_a_changed_setting",),
        "issue 39 #23: a tensor lr an LR scheduler rewrites in place compares equal to the "
        "captured one (the same object): the graph replays its stale lr",
        where="CapturedStep._group_settings",
    ),
    Mutation(
        "tt_plain_gets_rank",
        "galore2/integrations/torchtitan/common.py",
        "return {k: v for k, v in options.items() if k not in galore_keys}",
        "return dict(options)",
        (
            "tests/integrations/test_torchtitan.py::"
            "test_config_builds_the_container_torchtitan_expects",
        ),
        "torchtitan: the plain group (embeddings, head, norms) gets GaLore's rank, gap, scale",
        where="plain_options",
    ),
    Mutation(
        "tt_api_by_version_guess",
        "galore2/integrations/torchtitan/__init__.py",
        'if hasattr(optimizer_module, "ParamGroupConfig"):',
        'if hasattr(optimizer_module, "OptimizersContainer"):',
        ("tests/integrations/test_torchtitan_api.py",),
        "issue 39 #14: torchtitan 0.2.x's optimizer module taken for 0.3.x's API",
        where="api_of",
    ),
    Mutation(
        "tt_wheel_for_torch_2_11",
        "benchmarks/torchtitan_wheel.py",
        'TORCHTITAN = (("0.3.0", (2, 12)), ("0.2.2", (0, 0)))',
        'TORCHTITAN = (("0.3.0", (2, 11)), ("0.2.2", (0, 0)))',
        ("tests/benchmarks/test_torchtitan_wheel.py",),
        "issue 39 #14: the GPU session installs torchtitan 0.3.0 on torch 2.11 (it cannot "
        "import DataParallelMeshDims there)",
    ),
    Mutation(
        "scaled_update_mask_ignored",
        "galore2/core/apply.py",
        "return ScaledUpdate(u.G, u.factor * ok, u.shape)",
        "return ScaledUpdate(u.G, u.factor, u.shape)",
        ("tests/core/test_scaled_update.py::test_masked_apply_leaves_a_masked_weight_and_steps_the_other",),
        "the capturable path applies APOLLO's scaled gradient of a masked parameter",
        where="_masked",
    ),
    Mutation(
        "scaled_update_undecayed",
        "galore2/core/apply.py",
        "target.mul_(decay)",
        "pass",
        (
            "tests/core/test_scaled_update.py::test_a_16_bit_weight_takes_the_update_rounded_once",
            "tests/core/test_scaled_update.py::"
            "test_apollo_batched_bf16_weights_match_the_per_tensor_path",
        ),
        "a weight taking APOLLO's scaled gradient as its operands is not decayed",
        where="apply_update",
    ),
    Mutation(
        "teardown_with_the_model_alive",
        "recipes/pretrain.py",
        "    return metrics.history, halt, world",
        "    teardown(world)\n    return metrics.history, halt, world",
        (
            "tests/recipes/test_recipe.py::"
            "test_the_process_group_goes_after_the_model_and_optimizer",
        ),
        "the process group is destroyed while the run's FSDP model and optimizer still hold "
        "it: a torchrun rank aborts now and then at exit (SIGABRT)",
        where="_run",
    ),
    Mutation(
        "run_folder_unlocked",
        "recipes/resume.py",
        "        held.enter_context(writer_lock(out, RUNNING))",
        "        pass",
        (
            "tests/recipes/test_run_folder.py::"
            "test_a_second_process_on_a_run_folder_is_refused_and_changes_nothing",
        ),
        "a run does not hold its out dir: a second process resuming there drops the first's "
        "metrics rows and rewrites its config.json (issue 39 item 3)",
        where="prepare",
    ),
    Mutation(
        "skip_streak_total",
        "recipes/divergence.py",
        "self.streak = self.streak + steps if every_step else 0",
        "self.streak = self.streak + steps if every_step else self.streak",
        ("tests/recipes/test_divergence_streak.py",),
        "the divergence stop counts every skipping step, not consecutive ones",
        where="SkipWatch.at_log",
    ),
    Mutation(
        "skip_streak_window_any",
        "recipes/divergence.py",
        "default=0) >= steps  # fmt: skip",
        "default=0) >= 1  # fmt: skip",
        ("tests/recipes/test_divergence_streak.py",),
        "a log window with skips at some of its steps extends the streak by all of them",
        where="SkipWatch.at_log",
    ),
    Mutation(
        "adamw_baseline_fp32",
        "recipes/metrics.py",
        "2 * p.numel() * (fixed or p.element_size()) + 4",
        "2 * p.numel() * (fixed or 4) + 4",
        ("tests/recipes/test_metrics_timing.py",),
        "the summary's AdamW baseline counts fp32 moments whatever the parameters' dtype",
        where="adamw_state_bytes",
    ),
    Mutation(
        "resume_seed_free",
        "recipes/resume.py",
        '"train.grad_accum", "train.seed"))',
        '"train.grad_accum"))',
        ("tests/recipes/test_resume.py::test_resume_with_another_train_seed_is_refused",),
        "a resume with another train.seed is accepted (the epoch shuffle changes)",
    ),
    Mutation(
        "hf_weight_decay_setting",
        "galore2/integrations/transformers.py",
        '(optimizer_wide.get("weight_decay", args.weight_decay), True),',
        "(args.weight_decay, True),",
        (
            "tests/integrations/test_hf_trainer.py::"
            "test_weight_decay_setting_reaches_the_decayed_groups_only",
        ),
        "HF: weight_decay from optim_args / create_optimizer never reaches the decayed groups",
        where="_build",
    ),
    Mutation(
        "hf_no_decay_groups",
        "galore2/integrations/transformers.py",
        "            (0.0, False),\n",
        '            (optimizer_wide.get("weight_decay", args.weight_decay), False),\n',
        (
            "tests/integrations/test_hf_trainer.py::"
            "test_weight_decay_setting_reaches_the_decayed_groups_only",
        ),
        "HF: biases and norm weights are decayed by the galore2 weight_decay setting",
        where="_build",
    ),
    Mutation(
        "polar_cutoff",
        "galore2/optim/muon.py",
        "keep = lam > lam.amax(dim=-1, keepdim=True).clamp(min=0) * POLAR_RTOL",
        "keep = lam > 0",
        (
            "tests/optim/test_muon.py::"
            "test_polar_of_a_rank_deficient_product_drops_the_null_directions",
        ),
        "Muon's exact polar factor inverts rounding-level eigenvalues (no relative cutoff)",
        where="polar",
    ),
    Mutation(
        "plan_recompute",
        "galore2/plan/formulas.py",
        "a * t * shapes.vocab_size + bwd + (layer if checkpointing else 0)",
        "a * t * shapes.vocab_size + bwd",
        ("tests/plan/test_formulas_pinned.py",),
        "the planner's checkpointed peak leaves out the recomputed layer",
        where="activation_bytes",
    ),
    Mutation(
        "plan_fp32_reduce_scatter",
        "galore2/plan/formulas.py",
        "out += unit + (unit * 4 // p if p < 4 else 0)",
        "out += unit",
        ("tests/plan/test_formulas_pinned.py",),
        "the planner leaves out FSDP's fp32 reduce-scatter input of a bf16 unit's gradient",
        where="Footprint.gradients",
    ),
    Mutation(
        "alias_options_refused",
        "galore2/core/resume.py",
        "old, new = _normalized(option, saved[name]), group[name]",
        "old, new = saved[name], group[name]",
        (
            "tests/core/test_load_state_dict.py::"
            "test_alias_option_values_of_an_older_release_load_silently",
        ),
        "an older release's alias option values (state_dtype 'bf16') are refused on load",
        where="compare_groups",
    ),
    Mutation(
        "subnormal_scale",
        "galore2/storage/basis.py",
        "ok = amax >= _TINY * self.qmax",
        "ok = amax > 0",
        (
            "tests/storage/test_basis_quant.py::"
            "test_a_group_with_subnormal_absmax_stores_scale_zero",
        ),
        "a quantized-basis group with subnormal absmax stores a subnormal scale",
        where="QuantizedBasis.encode",
    ),
    Mutation(
        "gap_change_ignored",
        "galore2/core/resume.py",
        "if keys & diff:",
        "if keys & diff and False:",
        ("tests/optim/test_refresh_schedule.py",),
        "a changed update_proj_gap keeps the old schedule's next refresh (issue 30 item 4)",
        where="Settings.check",
    ),
    Mutation(
        "frozen_edit_ignored",
        "galore2/core/resume.py",
        "bad = [k for k in self.frozen if k in diff]",
        "bad = []",
        ("tests/optim/test_refresh_schedule.py",),
        "a rank edited in param_groups mid-run is silently ignored",
        where="Settings.check",
    ),
    Mutation(
        "left_gather_undeclared",
        "galore2/optim/projection.py",
        'Collective("all_gather", shape, inner, "LeftProjection.back: N (Adam direction)"),',
        "",
        ("tests/optim/test_projection.py",),
        "the traffic model forgets the left side's per-step all-gather of N",
        where="LeftProjection.step_collectives",
    ),
    Mutation(
        "staggered_phase",
        "galore2/optim/refresh.py",
        "return _at_phase(step + (gap + 1) // 2, gap, index)",
        "return step + gap",
        ("tests/optim/test_refresh_schedule.py",),
        "refresh_schedule='staggered' refreshes every matrix together",
        where="next_refresh",
    ),
    Mutation(
        "bf16_projection_ignored",
        "galore2/projectors/base.py",
        'if precision == "bf16" and G.dtype == torch.float32:',
        'if precision == "bf16" and G.dtype == torch.float64:',
        ("tests/projectors/test_precision.py",),
        "proj_precision='bf16' projects in fp32",
        where="projection_precision",
    ),
    Mutation(
        "batched_limiter_gamma",
        "galore2/optim/residual.py",
        "ratio = torch.clamp(norm / (prev + _EPS), min=gamma).div_(gamma)",
        "ratio = torch.clamp(norm / (prev + _EPS), min=gamma)",
        ("tests/optim/test_batched_rules.py",),
        "batched Fira / APOLLO: the norm-growth limiter divides by γ× the previous norm's ratio",
        where="_limit_buckets",
    ),
    Mutation(
        "batched_fira_right_residual",
        "galore2/optim/residual.py",
        "else bmm(Gs, r, Bs.mT, alpha=c_res)",
        "else bmm(Gs, r, Bs.mT, alpha=-c_res)",
        ("tests/optim/test_batched_rules.py",),
        "batched Fira: a right basis's residual is G + R·Qᵀ",
        where="_combine_buckets",
    ),
    Mutation(
        "stacked_entry_one_correction",
        "galore2/optim/adam_paths.py",
        "scales.append(scale[a:b].view(shape))",
        "scales.append(scale[a].expand(shape))",
        ("tests/core/test_packing.py",),
        "a stacked entry's members all get its first member's bias correction",
        where="per_entry",
    ),
    Mutation(
        "stacked_state_stale",
        "galore2/optim/lowrank_batch.py",
        "return packing.addresses(ts) == self.addresses",
        "return True",
        ("tests/core/test_packing.py",),
        "a batch's stacked state is kept after its tensors were re-pointed elsewhere",
        where="_InnerStacks.holds",
    ),
    Mutation(
        "stacked_grads_written",
        "galore2/core/packing.py",
        "return base is None or _SCRATCH.get(id(base)) is base",
        "return True",
        ("tests/core/test_packing.py",),
        "the back-projection is written into gradients that were viewed as a stack",
        where="writable",
    ),
    Mutation(
        "masked_update_stack_unmasked",
        "galore2/core/masked.py",
        "masked = _zeroed(view, pick, flags, packing.writable(view))",
        "masked = view",
        ("tests/core/test_packing.py", "tests/core/test_capturable.py"),
        "a capturable step applies a masked parameter's update when it is an entry of a stack",
        where="masked_updates",
    ),
    Mutation(
        "premasked_back_unmasked",
        "galore2/optim/lowrank_batch.py",
        "scale = mask if factor == 1.0 else mask * factor",
        "scale = mask.clamp(min=1.0) if factor == 1.0 else mask.clamp(min=1.0) * factor",
        ("tests/core/test_packing.py", "tests/core/test_capturable.py"),
        "a capturable step's back-projection of a stack is marked masked but was not masked",
        where="back",
    ),
    Mutation(
        "derived_stale",
        "galore2/core/masked.py",
        "                fn(base, out=result)",
        "                pass",
        ("tests/core/test_packing.py", "tests/core/test_capturable.py"),
        "a capturable step's Adam weights kept from an earlier step's flags",
        where="derive",
    ),
    Mutation(
        "inner_context_param_layout",
        "galore2/optim/lowrank_plan.py",
        "firsts = [ctxs[st.idx[0]].inner_view(st.batch.kind.layout) for st in stacked]",
        "firsts = [ctxs[st.idx[0]] for st in stacked]",
        ("tests/optim/test_inner_context.py",),
        "a stacked entry's inner rules see the parameter's layout at update, not the direction's",
        where="stacked_ctxs",
    ),
    Mutation(
        "adam_mask_ignored_batched",
        "galore2/optim/adam.py",
        "weights, decays = masked_weights(flags, exp_avgs[0].dtype, beta1, beta2)",
        "weights, decays = 1 - beta1, masked_weights(flags, exp_avgs[0].dtype, beta1, beta2)[1]",
        ("tests/core/test_capturable.py",),
        "a capturable step's batched Adam moves a masked direction's first moment",
        where="ScaleByAdam._directions",
    ),
    Mutation(
        "adam_mask_ignored_single",
        "galore2/optim/adam_paths.py",
        "(weight,), (decay,) = masked_weights([mask], exp_avg.dtype, beta1, beta2)",
        "weight, decay = masked_weights([mask], exp_avg.dtype, beta1, beta2)[0][0], beta2",
        ("tests/core/test_capturable.py",),
        "a capturable step's per-tensor Adam decays a masked direction's second moment",
        where="adam_single",
    ),
    Mutation(
        "stacked_mask_first_member",
        "galore2/optim/lowrank_plan.py",
        "out.append(first.with_mask(view))",
        "out.append(first)",
        ("tests/core/test_packing.py",),
        "a stacked entry's moments are masked by its first member's flag only",
        where="stacked_ctxs",
    ),
    Mutation(
        "adam_mask_bf16",
        "galore2/optim/adam.py",
        "if masks and masks[0] is not None and self.masked_keys(group):",
        "if masks and masks[0] is not None:",
        ("tests/core/test_capture_ready.py",),
        "Adam masks bfloat16 moments by tensor weights: capturable runs leave the host bits",
        where="ScaleByAdam._masks",
    ),
    Mutation(
        "flag_pick_stale",
        "galore2/core/masked.py",
        "self.last[0] is flags and self.last[1] == flags._version:",
        "self.last[0] is flags:",
        ("tests/core/test_packing.py",),
        "a stacked entry's flags picked from the flag buffer are last step's",
        where="_Flags.__call__",
    ),
    Mutation(
        "stacked_grads_written_fira",
        "galore2/optim/residual.py",
        "kept = not b.owned and Gs.data_ptr() == b.G.data_ptr()",
        "kept = False",
        ("tests/core/test_packing.py",),
        "Fira / APOLLO write their residual into gradients viewed as a stack",
        where="_combine_buckets",
    ),
    Mutation(
        "batch_bases_stale",
        "galore2/optim/lowrank_batch.py",
        "if self.stack is not None and self._current(key):",
        "if self.stack is not None:",
        ("tests/optim/test_batch_plan.py",),
        "batched GaLore: a basis written since it was stacked (refresh, load) is read stale",
        where="ShapeBatch.bases",
    ),
    Mutation(
        "batch_due_ignored",
        "galore2/optim/lowrank_batch.py",
        "out.append([j for j in range(k) if is_due(steps[start + j], nexts[start + j])])",
        "out.append([])",
        ("tests/optim/test_batch_plan.py",),
        "batched GaLore: a matrix due for a refresh stays in its shape batch (never refreshed)",
        where="BatchPlan.due",
    ),
    Mutation(
        "batched_8bit_pack_axis",
        "galore2/storage/dynamic8.py",
        "idx = (r // BLOCK) * cols + c",
        "idx = r * -(-cols // BLOCK) + c // BLOCK",
        ("tests/optim/test_batched_rules.py", "tests/optim/test_adam8bit.py"),
        "batched 8-bit Adam: directions blocked along dim 0 packed as if blocked along rows",
        where="pack_index",
    ),
    Mutation(
        "batched_newton_schulz_norm",
        "galore2/optim/muon.py",
        "X = X / torch.linalg.vector_norm(X, dim=(1, 2), keepdim=True).clamp_(min=NS_EPS)",
        "X = X / torch.linalg.vector_norm(X, dim=2, keepdim=True).clamp_(min=NS_EPS)",
        ("tests/optim/test_batched_rules.py",),
        "batched Muon: each row normalized instead of the matrix",
        where="newton_schulz",
    ),
    Mutation(
        "batched_adafactor_weight",
        "galore2/optim/adafactor.py",
        'weight = float(k) ** group["beta2_decay"]',
        "weight = 1.0",
        ("tests/optim/test_batched_rules.py",),
        "batched Adafactor: the second-moment estimate forgets everything each step (β̂₂ = 0)",
        where="ScaleByAdafactor._step_many",
    ),
    Mutation(
        "masked_restore",
        "galore2/core/masked.py",
        "torch.where(b.flags(bad), saved, current, out=current)",
        "torch.where(b.flags(bad), current, current, out=current)",
        ("tests/core/test_capturable.py",),
        "capturable: a masked parameter's state is not put back (its moments decay)",
        where="Snapshot.restore",
    ),
    Mutation(
        "device_bias_correction",
        "galore2/optim/adam.py",
        "torch.div(bc[0], bc[1].sqrt(), out=both[0])",
        "torch.div(bc[0], bc[1], out=both[0])",
        ("tests/core/test_capture_ready.py",),
        "capturable foreach Adam: the second bias correction is not square-rooted",
        where="ScaleByAdam._batch",
    ),
    Mutation(
        "capturable_pnm_parity",
        "galore2/optim/pnm.py",
        "c_pos, c_neg = torch.where(odd, c_a, c_p), torch.where(odd, c_p, c_a)",
        "c_pos, c_neg = c_a, c_p",
        ("tests/core/test_capture_rules.py",),
        "capturable PNM: exp_avg always weighted as the active buffer (parity of t ignored)",
        where="ScaleByPNM._coefficients",
    ),
    Mutation(
        "capturable_adafactor_rho",
        "galore2/optim/adafactor.py",
        "factor = t.sqrt_().reciprocal_().div_(lr).clamp_(max=1.0)",
        "factor = t.sqrt_().reciprocal_().div_(lr)",
        ("tests/core/test_capture_rules.py",),
        "capturable Adafactor: ρ_t = 1/√t even above lr (min(lr, ·) dropped)",
        where="_device_counts",
    ),
    # ---- the moments mixin (galore2/optim/moments.py): Adam's and PNM's shared code --------
    Mutation(
        "moment_rule_sum_uncorrected",
        "galore2/optim/moments.py",
        'return v.sum(dtype=torch.float64) / bias_correction(group["betas"][1], t)',
        "return v.sum(dtype=torch.float64)",
        (
            "tests/optim/test_ranger_modules.py::"
            "test_stable_weight_decay_reaches_every_parameter_with_sigma_from_adam_states",
        ),
        "stable weight decay's σ sums the second moment without its bias correction",
        where="MomentRule.second_moment_sum",
    ),
    Mutation(
        "moment_rule_batch_counted_twice",
        "galore2/optim/moments.py",
        "return packed.add_(1).tolist()",
        "return packed.add_(2).tolist()",
        ("tests/core/test_foreach.py",),
        "a batch's host step counters advance by two per step (its bias corrections run ahead)",
        where="MomentRule.count_steps",
    ),
    Mutation(
        "snapshot_fits_keyerror",
        "galore2/core/masked.py",
        "_entry = dict.get  # None",
        "_entry = dict.__getitem__  # None",
        ("tests/core/test_capturable.py::test_snapshot_fits_answers_false_for_another_parameter_at_a_position",),
        "issue 39 15b: Snapshot.fits raises KeyError when the parameter at a position has "
        "other state keys (a changed set of parameters with gradients)",
    ),
    Mutation(
        "masked_bucket_every_by_length",
        "galore2/core/masked.py",
        "every = list(owners) == list(range(flags))",
        "every = len(owners) == flags",
        ("tests/core/test_masked_property.py::test_masked_step_is_the_skip_step_on_each_finding[16]",),
        "issue 39 #16: a snapshot bucket whose owner list has as many entries as the group "
        "has flags is taken as every flag in order (a 2-parameter group: one parameter's "
        "two moments)",
        where="_Flags.__init__",
    ),
    Mutation(
        "masked_dense_flag_by_chunk_index",
        "galore2/core/masked.py",
        "[oks[positions[j]] for j in rest]",
        "[oks[j] for j in rest]",
        ("tests/core/test_masked_property.py::test_masked_step_is_the_skip_step_on_each_finding[17]",),
        "issue 39 #17: unstacked dense updates take the flag at their index in the chunk, "
        "not their parameter's (a NaN in a bias or norm gain)",
        where="masked_updates",
    ),
    Mutation(
        "tucker_back_unscaled",
        "galore2/optim/projection.py",
        "return self.projector.project_back(N, state, self.plan, dtype).mul_(factor)",
        "return self.projector.project_back(N, state, self.plan, dtype)",
        ("tests/projectors/test_tucker.py::test_tucker_update_carries_scale_and_weight_decay",),
        "issue 39 #24: a Tucker weight's update loses its factor α·(1 − lr·λ)",
        where="TuckerProjection.back",
    ),
    Mutation(
        "masked_bucket_unsaved_if_any_key_skipped",
        "galore2/core/masked.py",
        "None if b.keys <= skip",
        "None if b.keys & skip",
        (
            "tests/core/test_capturable.py::"
            "test_muon_square_matrix_momentum_put_back_with_its_basis_skipped",
        ),
        "issue 39 #18: a snapshot bucket is left unsaved when any of its keys is skipped "
        "(GaLoreMuon: a square matrix's momentum shares a bucket with its right basis)",
        where="Snapshot.save",
    ),
    Mutation(
        "masked_unstacked_not_written_back",
        "galore2/core/masked.py",
        "                torch._foreach_copy_(b.tensors, list(current.unbind()))",
        "                pass",
        ("tests/core/test_masked_property.py::test_masked_step_is_the_skip_step_on_each_finding[19]",),
        "issue 39 #19: an unstacked snapshot bucket is restored into a copy never written "
        "back (Adafactor's state of a unique shape; every bucket under FSDP)",
        where="Snapshot.restore",
    ),
    Mutation(
        "masked_grad_buckets_kept",
        "galore2/core/step_masked.py",
        "flags.write(ok, bad, batch.reused)",
        "flags.write(ok, bad, True)",
        ("tests/core/test_masked_property.py::test_masked_step_is_the_skip_step_on_each_finding[20]",),
        "issue 39 #20: the gradients' buckets kept while the set of parameters with "
        "gradients changes at the same count",
        where="MaskedPath.step",
    ),
    Mutation(
        "masked_skip_counter_kept",
        "galore2/core/step_masked.py",
        "key = self.skip_keys.get(batch.key) if batch.reused else None",
        "key = self.skip_keys.get(batch.key)",
        ("tests/core/test_masked_property.py::test_masked_step_is_the_skip_step_on_each_finding[20]",),
        "issue 39 #20: the device skip counter kept while the set of parameters with "
        "gradients changes at the same count (skips charged to the wrong parameter)",
        where="MaskedPath._count_skips",
    ),
    Mutation(
        "stacked_first_batch_flags",
        "galore2/core/masked.py",
        "view = flags[start : start + k]",
        "view = flags[:k]",
        ("tests/core/test_masked_property.py::test_masked_step_is_the_skip_step_on_each_finding[21]",),
        "issue 39 #21: every stacked entry takes the first shape batch's flags (a NaN in a "
        "member of the second batch)",
        where="member_flags",
    ),
    Mutation(
        "masked_host_counters_snapshotted",
        "galore2/core/step_masked.py",
        "                and not _counter(t)\n",
        "",
        ("tests/core/test_masked_property.py::test_masked_step_is_the_skip_step_on_each_finding[21]",),
        "issue 39 #22: host counters (galore.step, next_refresh) snapshotted and put back "
        "for a masked parameter on the CPU (then set back twice: by the snapshot and by the "
        "skips' read, behind the skip path's)",
        where="MaskedPath._snapshot",
    ),
    Mutation(
        "norm_loss_moves_masked",
        "galore2/optim/weights.py",
        "            scale = masked_factor(scale, spread)",
        "            pass",
        ("tests/core/test_capturable.py::test_ranger21_weight_modules_leave_a_masked_parameter",),
        "issue 39 item 1: batched norm loss moves a masked parameter's weights",
        where="NormLoss.apply_many",
    ),
    Mutation(
        "stable_decay_moves_masked",
        "galore2/optim/weights.py",
        "factors = masked_factor(factor, masks).unbind()",
        "factors = masked_factor(factor, None).expand(len(ctxs)).unbind()",
        ("tests/core/test_capturable.py::test_ranger21_weight_modules_leave_a_masked_parameter",),
        "issue 39 item 1: batched stable weight decay moves a masked parameter's weights",
        where="StableWeightDecay.apply_many",
    ),
    Mutation(
        "batched_factors_unscaled",
        "galore2/optim/lowrank_batch.py",
        "LowRankUpdate(a, b, shape, factor)",
        "LowRankUpdate(a, b, shape, 1.0)",
        ("tests/optim/test_lowrank_update.py",),
        "batched GaLore's factored updates lose α·(1 − lr·λ)",
        where="factors",
    ),
    Mutation(
        "fused_adam_step_shifted",
        "galore2/kernels/ops.py",
        "t = torch.full((), float(step),",
        "t = torch.full((), float(step + 1),",
        ("tests/optim/test_lowrank_update.py",),
        "batched Adam's fused kernel bias-corrects with the next step's count",
        where="adam_directions",
    ),
    Mutation(
        "masked_device_counters_advance",
        "galore2/core/masked.py",
        "                self.counters.restore(self.flags.bad)",
        "                pass",
        ("tests/core/test_masked_counts.py",),
        "issue 38 item 2: a masked parameter's device step counters (Adam's) advance as if "
        "it had stepped",
        where="MaskedStep.__exit__",
    ),
    Mutation(
        "masked_host_counters_not_set_back",
        "galore2/core/step_masked.py",
        "                        state[key] -= n  # in place",
        "                        pass  # in place",
        ("tests/core/test_masked_counts.py",),
        "issue 38 item 2: GaLore's host step counter keeps a masked step (its refresh "
        "comes early)",
        where="MaskedPath.flush_skips",
    ),
    Mutation(
        "masked_refresh_without_flush",
        "galore2/core/step.py",
        "        self.masked.due_flush(batches)\n",
        "",
        ("tests/core/test_masked_counts.py",),
        "issue 38 item 2: a refresh decided on host counters that still count masked steps",
        where="StepEngine._run_and_apply",
    ),
    Mutation(
        "masked_sigma_counts_masked",
        "galore2/core/modules.py",
        "        if ctx.mask is not None:  # a masked step",
        "        if False:  # a masked step",
        ("tests/core/test_masked_counts.py",),
        "issue 38 item 2: stable weight decay's σ counts a masked parameter's second moment",
        where="compute_stats",
    ),
    Mutation(
        "due_for_refresh_without_flush",
        "galore2/core/step_masked.py",
        "        if self.pending_skips and any(state_of.get(p) for p in found):",
        "        if False:",
        ("tests/core/test_masked_counts.py::test_due_for_refresh_is_the_skip_paths_with_skips_pending",),
        "issue 38 item 2: due_for_refresh answers from host counters that count masked steps",
        where="MaskedPath.due_for_refresh",
    ),
    Mutation(
        "int8_weight_round_to_nearest",
        "galore2/storage/basis.py",
        "else torch.floor(c.add_(noises[n]))",
        "else torch.round(c)",
        (
            "tests/weights/test_int8_weights.py::test_stochastic_rounding_is_unbiased",
            "tests/weights/test_int8_weights.py::"
            "test_update_below_the_step_moves_the_weight_in_expectation",
        ),
        "int8 weights are re-quantized to nearest: sub-step updates are lost",
        where="QuantizedBasis.encode",
    ),
    Mutation(
        "int8_weight_nonfinite_written",
        "galore2/storage/weights.py",
        "ok = torch.stack([torch.isfinite(x[b]).all() for b in blocks]).all()",
        "ok = torch.ones((), dtype=torch.bool, device=x.device)",
        ("tests/weights/test_int8_weights.py::test_a_non_finite_write_leaves_codes_and_scales",),
        "a non-finite int8 weight write reaches the codes",
        where="Int8WeightStore.write",
    ),
    Mutation(
        "int8_weight_not_written_back",
        "galore2/core/stored.py",
        "found[0].write(x)",
        "pass",
        ("tests/weights/test_int8_weights.py::test_every_preset_trains_int8_weights",),
        "the apply stage never re-quantizes: int8 weights do not train",
        where="Writes.commit",
    ),
    Mutation(
        "int8_weights_all_copies_at_once",
        "galore2/core/stored.py",
        "    if whole or not stored:",
        "    if True:",
        (
            "tests/weights/test_writeback_peak.py::"
            "test_the_step_holds_one_working_copy_at_a_time",
        ),
        "optimizer.step() holds an fp32 working copy of every int8 weight at once",
        where="parts",
    ),
    Mutation(
        "nonfinite_fold_flag_ignored",
        "galore2/core/step.py",
        "tested[i] = small",
        "tested[i] = torch.zeros_like(small)",
        ("tests/core/test_nonfinite_fold.py",),
        "the non-finite test folded into the projection tests nothing: a projected matrix's "
        "R stands for its gradient, but its flag is always usable (a NaN reaches its state)",
        where="StepEngine._screened",
    ),
    Mutation(
        "nonfinite_fold_batch_misattributed",
        "galore2/optim/lowrank_screen.py",
        "for i, r in zip(st.idx, st.R.unbind(0), strict=True):",
        "for i, r in zip(st.idx, st.R.unbind(0)[::-1], strict=True):",
        ("tests/core/test_nonfinite_fold.py",),
        "a shape batch's projections are tested under each other's names: the wrong member "
        "of the batch is skipped",
        where="screen",
    ),
    Mutation(
        "adamw_list_first_block",
        "galore2/kernels/adamw.py",
        "offs = (pid - first) * BLOCK + tl.arange(0, BLOCK)",
        "offs = pid * BLOCK + tl.arange(0, BLOCK)",
        ("tests/kernels/test_triton_kernels.py::"
         "test_triton_adamw_list_is_one_launch_with_the_bits_of_one_launch_a_weight",),
        "the list kernel's blocks ignore where their weight's blocks start: every weight but "
        "the first is read and written at the wrong offsets",
        where="_adamw_list_kernel",
    ),
    Mutation(
        "adamw_list_stale_table",
        "galore2/kernels/adamw.py",
        'key = ("adamw", *addresses, *sizes)',
        'key = ("adamw", *sizes)',
        ("tests/kernels/test_triton_kernels.py::"
         "test_triton_adamw_list_is_one_launch_with_the_bits_of_one_launch_a_weight",),
        "the list kernel's table is kept by sizes alone: new gradients elsewhere are read "
        "at the old addresses",
        where="_list_table",
    ),
    Mutation(
        "lowrank_list_stale_table",
        "galore2/kernels/tables.py",
        "return kept((name, len(lists), *sizes, *deltas), device, make)",
        "return kept((name, len(deltas)), device, make)",
        ("tests/kernels/test_lowrank_list.py::test_a_moved_list_gets_a_new_table",),
        "the list kernels' tables are kept by the lists' length alone: gradients that "
        "moved are read at the old addresses",
        where="offsets",
    ),
    Mutation(
        "lowrank_list_first_entry",
        "galore2/kernels/lowrank_list.py",
        "    a_off = tl.load(table + e)",
        "    a_off = tl.load(table)",
        ("tests/kernels/test_lowrank_list.py::test_each_entry_is_the_single_matrix_kernel",),
        "every entry of a grouped launch multiplies the first entry's A (one basis for a "
        "whole shape batch)",
        where="_lowrank_list_kernel",
    ),
    Mutation(
        "lowrank_basis_truncated",
        "galore2/kernels/lowrank.py",
        "            a = to_bf16(a)",
        "            a = a.to(tl.bfloat16)",
        ("tests/kernels/test_lowrank_list.py::test_a_float32_operand_is_rounded_as_it_is_read",),
        "a float32 basis read by the grouped kernel is rounded to bf16 by the interpreter's "
        "cast (truncation), not to nearest: not the bits of casting it first",
        where="tile_product",
    ),
    Mutation(
        "ops_lowrank_unrounded",
        "galore2/kernels/ops_lowrank.py",
        "p.addmm_(_in(As[i], p.dtype), _in(Bs[i], p.dtype), beta=beta, alpha=alpha)",
        "p.addmm_(As[i], Bs[i], beta=beta, alpha=alpha)",
        ("tests/kernels/test_lowrank_list.py::test_the_torch_path_is_an_mm_and_an_addmm_per_entry",),
        "the torch path of galore2::addmm_each_ multiplies a float32 basis with bf16 "
        "factors as they are (an error, or other bits than the kernel's)",
        where="_addmm_each",
    ),
    Mutation(
        "along_data_without_grouped",
        "galore2/optim/lowrank_batch.py",
        "    return u.numel() >= MIN_ALONG_DATA_ELEMENTS or grouped_would_run(u)",
        "    return u.numel() >= MIN_ALONG_DATA_ELEMENTS",
        ("tests/kernels/test_lowrank_list.py::test_galore_goes_along_the_data_on_the_grouped_kernels",
         "tests/benchmarks/test_roofline.py::test_350m_budgets"),
        "where the grouped kernels run, shape batches are still stacked (gradients copied, "
        "dense updates written and read: 2.2x the bytes)",
        where="along_data",
    ),
    Mutation(
        "grouped_bases_stacked",
        "galore2/optim/lowrank_batch.py",
        "        if isinstance(projector, RandomProjector) or not grouped_would_run(u):",
        "        if True:",
        ("tests/benchmarks/test_roofline.py::test_350m_budgets",),
        "the grouped path stacks and casts the bases at every step instead of reading the "
        "stored ones as they are",
        where="ShapeBatch._stored_each",
    ),
    Mutation(
        "direct_versions_unbumped",
        "galore2/kernels/direct.py",
        "        bump_versions(list(_tensors(tuple(args[i] for i in mutated))))\n",
        "",
        ("tests/kernels/test_direct.py",),
        "a custom op called directly leaves its mutated tensors' version counters where they "
        "were (autograd cannot see a Triton kernel's writes)",
        where="direct",
    ),
    Mutation(
        "along_data_for_every_batch",
        "galore2/optim/lowrank_batch.py",
        "return u.numel() >= MIN_ALONG_DATA_ELEMENTS or",
        "return True or",
        ("tests/benchmarks/test_roofline.py::test_350m_stacked_budgets",),
        "where the grouped kernels do not run, every shape batch still goes along the "
        "data: two launches per matrix, the host-bound step measured on an H200",
        where="along_data",
    ),
    Mutation(
        "deferred_counters_kept",
        "galore2/core/deferred.py",
        "                        state[key] -= 1  # in place: a packed counter stays in its pack",
        "                        pass",
        ("tests/core/test_deferred.py::test_a_deferred_skip_leaves_what_the_skip_leaves",),
        "a deferred skip is counted but the step counters the step advanced for the skipped "
        "parameter are not set back (bias corrections and the refresh schedule run ahead)",
        where="DeferredSkips.settle",
    ),
    Mutation(
        "deferred_skip_uncounted",
        "galore2/core/deferred.py",
        "                state[SKIPS] += 1",
        "                pass",
        ("tests/core/test_deferred.py::test_a_deferred_skip_leaves_what_the_skip_leaves",),
        "a deferred batch's unusable gradient is left out but never counted as a skip",
        where="DeferredSkips.settle",
    ),
    Mutation(
        "adamw_list_ignores_keep",
        "galore2/kernels/adamw.py",
        "        n = tl.where(tl.load(keep_ptr + t) != 0, n, 0)",
        "        n = n",
        ("tests/kernels/test_keep_flags.py::test_adamw_writes_only_the_kept_weights",),
        "the AdamW list kernel writes a weight flagged out (its NaN gradient reaches the "
        "weight and moments)",
        where="_adamw_list_kernel",
    ),
    Mutation(
        "lowrank_list_ignores_keep",
        "galore2/kernels/lowrank_list.py",
        "        if tl.load(keep_ptr + flag) == 0:",
        "        if tl.load(keep_ptr + flag) == 2:",
        ("tests/kernels/test_keep_flags.py::test_addmm_each_writes_only_the_kept_weights",),
        "the grouped write-back writes a weight flagged out",
        where="_lowrank_list_kernel",
    ),
    Mutation(
        "directions_ignore_keep_at",
        "galore2/kernels/adamw.py",
        "            member = tl.load(at_ptr + member, mask=mask, other=0)",
        "            member = member",
        ("tests/kernels/test_keep_flags.py::test_directions_write_only_the_kept_members",),
        "the directions kernel reads a stack member's flag at its index in the stack, not "
        "at its position in the group's flags (another matrix's flag)",
        where="_directions_kernel",
    ),
    Mutation(
        "apply_drops_keep",
        "galore2/core/apply.py",
        "keep = updates[idx[0]].keep  # type: ignore[union-attr]",
        "keep = None",
        ("tests/core/test_deferred.py::test_a_deferred_skip_leaves_what_the_skip_leaves",),
        "a deferred step writes every shape batch's update, the unusable gradient's too",
        where="_flags",
    ),
    Mutation(
        "defers_with_a_read_left",
        "galore2/core/step.py",
        "if checked and all(map(self._defers, checked))",
        "if checked and any(map(self._defers, checked))",
        ("tests/benchmarks/test_roofline.py::test_host_reads",),
        "a step defers some groups' flags while another group reads its own anyway (a copy "
        "more, no read less; or a group whose kernels do not take the flags)",
        where="StepEngine._run",
    ),
    Mutation(
        "directions_one_count",
        "galore2/kernels/adamw.py",
        "        inv_bc1 = tl.load(bc_ptr + offs // per, mask=mask, other=1.0)",
        "        inv_bc1 = inv_bc1",
        ("tests/kernels/test_keep_flags.py::test_directions_at_each_members_own_step",),
        "a stack whose members count different steps takes the first member's 1/bc1 for all",
        where="_directions_kernel",
    ),
    Mutation(
        "scaled_updates_one_by_one",
        "galore2/core/apply.py",
        "    return [idx for idx in by.values() if len(idx) > 1]",
        "    return []",
        ("tests/core/test_batched_budget.py",),
        "APOLLO's scaled gradients applied by one addcmul_ per weight again, not one grouped "
        "launch per shape batch (7 launches a layer on Llama)",
        where="_scaled_lists",
    ),
    Mutation(
        "residual_rules_stacked",
        "galore2/optim/lowrank_plan.py",
        "return not (ctxs and ctxs[0].mask is not None)",
        "return not residual.active(group) and not (ctxs and ctxs[0].mask is not None)",
        ("tests/optim/test_batched_rules.py::test_along_the_data_equals_per_tensor_path",),
        "APOLLO's and Fira's gradients stacked again where their batches may go along the "
        "data",
        where="along",
    ),
    Mutation(
        "residual_checks_g",
        "galore2/optim/galore.py",
        'if group["rank"] is None:',
        'if group["rank"] is None or residual.active(group):',
        ("tests/benchmarks/test_roofline.py::test_per_layer_bytes_and_kernels",),
        "Fira's and APOLLO's non-finite check reads each gradient again instead of R",
        where="GaLore.screened",
    ),
    Mutation(
        "scaled_norms_other_side",
        "galore2/optim/residual.py",
        "side = 1 if dim == 2 else 0",
        "side = 0 if dim == 2 else 1",
        ("tests/optim/test_batched_rules.py::test_along_the_data_equals_per_tensor_path",),
        "along the data, the limiter reads the gradients' (or residuals') norms over the "
        "wrong side",
        where="_scaled_norm_each",
    ),
    Mutation(
        "scaled_op_no_decay",
        "galore2/kernels/ops_scaled.py",
        "            t.mul_(beta)",
        "            pass",
        ("tests/kernels/test_ops_scaled.py",),
        "the grouped scaled update's torch path drops the weight decay",
        where="_scaled_add_each",
    ),
    Mutation(
        "scaled_kernel_beta_unrounded",
        "galore2/kernels/scaled_list.py",
        "    if not BETA_ONE:",
        "    if False:",
        ("tests/kernels/test_scaled_list.py",),
        "the scaled kernel ignores β (no decay, no rounding of β·p first)",
        where="_scaled_kernel",
    ),
    Mutation(
        "norms_kernel_no_row_mask",
        "galore2/kernels/scaled_list.py",
        "mask = ((r0 + lr) < R)[:, None] & c_ok[None, :]",
        "mask = c_ok[None, :] | ((r0 + lr) < R)[:, None]",
        ("tests/kernels/test_scaled_list.py",),
        "the norms kernel reads rows past the matrix",
        where="_norms_kernel",
    ),
    Mutation(
        "scaled_table_by_address_only",
        "galore2/kernels/tables.py",
        "return kept((name, len(lists), *sizes, *deltas), device, make)",
        "return kept((name, len(lists), *deltas), device, make)",
        ("tests/kernels/test_scaled_list.py",),
        "a kept offsets table reused for tensors of another element size at the same addresses",
        where="offsets",
    ),
    Mutation(
        "fira_x_sign",
        "galore2/optim/residual.py",
        "X = torch.addcmul(Ns[j], Rs[j], factor, value=c_res / scale,",
        "X = torch.addcmul(Ns[j], Rs[j], factor, value=-c_res / scale,",
        ("tests/optim/test_batched_rules.py::test_along_the_data_equals_per_tensor_path",),
        "Fira along the data adds the residual's in-subspace part P·R instead of removing it",
        where="_combine_buckets",
    ),
    Mutation(
        "fira_limiter_residual_sign",
        "galore2/optim/residual.py",
        "channel = residual_norms_each(b.G, *b.factors(R), c, side)",
        "channel = residual_norms_each(b.G, *b.factors(R), -c, side)",
        ("tests/optim/test_batched_rules.py::test_along_the_data_equals_per_tensor_path",),
        "Fira's limiter along the data measures G + P·R, not the residual G − P·R",
        where="_scaled_norm_each",
    ),
    Mutation(
        "residual_updates_one_by_one",
        "galore2/core/apply.py",
        "    return [idx for idx in by.values() if len(idx) > 1]",
        "    return []",
        ("tests/optim/test_batched_rules.py::test_along_the_data_equals_per_tensor_path",),
        "Fira's updates along the data applied per weight (an addmm_ and an addcmul_ each), "
        "not one grouped launch per shape batch",
        where="_residual_lists",
    ),
    Mutation(
        "scaled_epilogue_without_gamma",
        "galore2/kernels/lowrank.py",
        "res = res + (gamma * g.to(tl.float32)) * f",
        "res = res + g.to(tl.float32) * f",
        ("tests/kernels/test_fira_kernels.py",),
        "the grouped back-projection adds the scaled gradient without its coefficient γ "
        "(−lr): Fira's residual at the wrong scale",
        where="lowrank_tile",
    ),
    Mutation(
        "scaled_epilogue_first_gradient",
        "galore2/kernels/lowrank_list.py",
        "g_entry = g_ptr + tl.load(table + 4 * count + e)",
        "g_entry = g_ptr + tl.load(table + 4 * count)",
        ("tests/kernels/test_fira_kernels.py",),
        "every weight of a shape batch takes the first matrix's scaled gradient",
        where="_lowrank_list_kernel",
    ),
    Mutation(
        "scaled_epilogue_first_factor",
        "galore2/kernels/lowrank_list.py",
        "f_entry = f_ptr + e.to(tl.int64) * s_fe",
        "f_entry = f_ptr",
        ("tests/kernels/test_fira_kernels.py",),
        "every weight of a shape batch takes the first matrix's scaling factors",
        where="_lowrank_list_kernel",
    ),
    Mutation(
        "residual_norms_of_the_difference",
        "galore2/kernels/residual_list.py",
        "x = g + c * prod",
        "x = g - prod",
        ("tests/kernels/test_fira_kernels.py",),
        "the residual kernel ignores its coefficient ('fira_reference': G − α·P·R)",
        where="_residual_norms_kernel",
    ),
    Mutation(
        "channel_norms_fp64_in_fp32",
        "galore2/kernels/ops_scaled.py",
        "wide = torch.float32 if g.dtype != torch.float64 else None",
        "wide = torch.float32",
        ("tests/kernels/test_ops_scaled.py",),
        "the channel norms' torch path asks float32 sums of float64 gradients (torch refuses "
        "the narrowing: APOLLO along the data fails on float64 weights)",
        where="_channel_norms",
    ),
    Mutation(
        "adam8bit_keep_ignored",
        "galore2/kernels/adam8bit.py",
        "n_other = tl.where(tl.load(keep_ptr + flag_at) != 0, n_other, 0)",
        "n_other = n_other",
        ("tests/kernels/test_keep_flags.py::test_adam8bit_stack_writes_only_the_kept_members",),
        "the 8-bit kernel writes a matrix flagged out (a deferred step's unusable gradient)",
        where="_adam8bit_kernel",
    ),
    Mutation(
        "adam8bit_bf16_truncated",
        "galore2/kernels/adam8bit.py",
        "tl.store(out_ptr + offs, to_bf16(d), mask=mask)",
        "tl.store(out_ptr + offs, d.to(tl.bfloat16), mask=mask)",
        ("tests/kernels/test_keep_flags.py::test_adam8bit_stack_writes_only_the_kept_members",),
        "the 8-bit kernel's bf16 directions cast without rounding to nearest (the "
        "interpreter truncates)",
        where="_adam8bit_kernel",
    ),
    Mutation(
        "adam8bit_stacked_keep_dropped",
        "galore2/optim/adam8bit.py",
        "keep, at = run[0].keep, None",
        "keep, at = None, None",
        ("tests/core/test_deferred.py::test_a_deferred_skip_leaves_what_the_skip_leaves",),
        "a deferred step's 8-bit shape stacks are stepped without their flags: a skipped "
        "matrix's moments take its NaN gradient",
        where="_step_stacked",
    ),
    Mutation(
        "adamw8bit_group_wrong_flags",
        "galore2/optim/adamw8bit_step.py",
        "flags = keep.index_select(0, upload(rest, keep.device))",
        "flags = keep.index_select(0, upload(list(range(len(rest))), keep.device))",
        ("tests/core/test_deferred.py::test_a_deferred_skip_leaves_what_the_skip_leaves",),
        "the plain group's float32-moment tensors read the flags of the group's first tensors, "
        "not their own",
        where="adamw8bit_group",
    ),
    Mutation(
        "adamw8bit_group_keep_dropped",
        "galore2/optim/adamw8bit_step.py",
        "group[\"eps\"], steps[i], lr, decay, keep,",
        "group[\"eps\"], steps[i], lr, decay, None,",
        ("tests/core/test_deferred.py::test_a_deferred_skip_leaves_what_the_skip_leaves",),
        "a deferred step's plain tensor with 8-bit moments is stepped without its flag",
        where="adamw8bit_group",
    ),
    Mutation(
        "eightbit_directions_not_rounded",
        "galore2/optim/lowrank_plan.py",
        "ctxs = _rounded_members(stacks, ctxs)",
        "ctxs = list(ctxs)",
        ("tests/benchmarks/test_roofline.py::test_350m_8bit_step_on_fused_ops",),
        "8-bit shape stacks write float32 directions that the back-projection then casts",
        where="run_inner",
    ),
    Mutation(
        "adamw8bit_decay_unrounded",
        "galore2/kernels/adam8bit.py",
        "p = to_bf16(p.to(tl.float32) * decay)",
        "p = p.to(tl.float32) * decay",
        ("tests/kernels/test_adam8bit_fused.py::test_adamw8bit_step_is_adam8bit_step_then_the_torch_passes",),
        "the fused 8-bit AdamW step decays the weight without its own rounding to bf16 (the "
        "separate multiply's)",
        where="_adam8bit_kernel",
    ),
    Mutation(
        "adam8bit_strided_out_uninitialised",
        "galore2/kernels/adam8bit.py",
        "res = out.contiguous()",
        "res = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)",
        ("tests/kernels/test_adam8bit_fused.py::test_stack_keep_leaves_a_strided_out_entry_unwritten",),
        "a strided out goes through an uninitialised buffer copied back whole: a flagged-out "
        "member's entries get garbage",
        where="_step",
    ),
    Mutation(
        "scaled_list_keep_at_ignored",
        "galore2/kernels/scaled_list.py",
        "flag = tl.load(at_ptr + e) if HAS_AT else e",
        "flag = e",
        ("tests/kernels/test_keep_flags.py::test_scaled_updates_write_only_the_kept_weights",),
        "APOLLO's grouped update reads each weight's flag at its index, not at its position",
        where="_scaled_kernel",
    ),
    Mutation(
        "addmm_scaled_list_keep_dropped",
        "galore2/kernels/lowrank_list.py",
        "BETA_ZERO=beta == 0, HAS_KEEP=keep is not None, HAS_AT=keep_at is not None,",
        "BETA_ZERO=beta == 0, HAS_KEEP=False, HAS_AT=keep_at is not None,",
        ("tests/kernels/test_keep_flags.py::test_scaled_updates_write_only_the_kept_weights",),
        "the grouped matmul's launch (Fira's update, the back-projection) writes a weight "
        "flagged out",
        where="_launch",
    ),
    Mutation(
        "scaled_add_torch_keep_ignored",
        "galore2/kernels/ops_scaled.py",
        "taken = set(kept(keep, len(ps), keep_at))",
        "taken = set(range(len(ps)))",
        ("tests/kernels/test_keep_flags.py::test_scaled_updates_write_only_the_kept_weights",),
        "scaled_add_each_'s torch path writes a weight flagged out",
        where="_scaled_add_each",
    ),
    Mutation(
        "addmm_scaled_torch_keep_ignored",
        "galore2/kernels/ops_lowrank.py",
        "taken = set(kept(keep, len(ps), keep_at))",
        "taken = set(range(len(ps)))",
        ("tests/kernels/test_keep_flags.py::test_scaled_updates_write_only_the_kept_weights",),
        "addmm_scaled_each_'s torch path writes a weight flagged out",
        where="_addmm_scaled_each",
    ),
    Mutation(
        "limiter_keep_ignored",
        "galore2/optim/residual.py",
        "new = torch.where(keep.index_select(0, upload(at, keep.device)), new, prev)",
        "new = new",
        ("tests/core/test_deferred.py::test_a_deferred_skip_leaves_what_the_skip_leaves",),
        "a deferred step's norm-growth limiter records a flagged-out matrix's (NaN) norm",
        where="_limit_buckets",
    ),
    Mutation(
        "along_n_unrounded_on_host_skip",
        "galore2/optim/lowrank_combine.py",
        "            Ns = Ns.to(dtype)",
        "            Ns = Ns",
        ("tests/core/test_deferred.py::test_deferred_steps_count_as_the_skip_path_counts",),
        "APOLLO's φ from a float32 N where the rule's path could not round it (a host-indexed "
        "skip step): the runs part by more than a rounding",
        where="combine_many",
    ),
    Mutation(
        "project_norms_kernel_residual_sign",
        "galore2/kernels/project_norms_list.py",
        "x = x + c * tl.dot(p, r_op, input_precision=PRECISION)",
        "x = x - c * tl.dot(p, r_op, input_precision=PRECISION)",
        ("tests/kernels/test_project_norms_list.py",),
        "the fused projection's kernel measures G − c·P·R, not Fira's residual G + c·P·R",
        where="_project_norms_kernel",
    ),
    Mutation(
        "project_norms_kernel_unrounded_r_norms",
        "galore2/kernels/project_norms_list.py",
        "    r32 = r_low.to(tl.float32)",
        "    r32 = acc",
        ("tests/kernels/test_project_norms_list.py",),
        "R's channel norms taken of the float32 product, not of the R stored (rounded)",
        where="_project_norms_kernel",
    ),
    Mutation(
        "project_norms_torch_residual_sign",
        "galore2/kernels/ops_scaled.py",
        "        norms.copy_(_residual_norms(Gs, Bs, outs, c, 0))",
        "        norms.copy_(_residual_norms(Gs, Bs, outs, -c, 0))",
        ("tests/kernels/test_ops_scaled.py::test_project_norms_torch_path",),
        "project_norms_each's torch path measures G − c·P·R for a left basis",
        where="_project_norms",
    ),
    Mutation(
        "fira_fused_norms_swapped",
        "galore2/optim/lowrank_batch.py",
        "            return None, held, held, R, (norms[0], norms[1])",
        "            return None, held, held, R, (norms[1], norms[0])",
        ("tests/optim/test_batched_rules.py::test_norms_taken_with_the_projection",),
        "Fira's φ divides by the residual's norms and its limiter measures R's",
        where="ShapeBatch.project",
    ),
    Mutation(
        "fira_fused_phi_from_residual",
        "galore2/optim/residual.py",
        "    den = [_norms(r, d) if b.norms is None else b.norms[1]",
        "    den = [_norms(r, d) if b.norms is None else b.norms[0]",
        ("tests/optim/test_batched_rules.py::test_norms_taken_with_the_projection",),
        "Fira's φ = ‖N‖/‖R‖ takes the residual's norms for R's where the projection took both",
        where="_combine_buckets",
    ),
    Mutation(
        "adam_entries_share_a_path",
        "galore2/optim/adam.py",
        "        if unmasked and not rounded and len(us) > 1 and keeps is None:",
        "        if False:",
        ("tests/core/test_deferred.py::test_a_skip_leaves_the_other_shape_batches_bits",),
        "a host-indexed skip step's batch that lost a matrix sends every entry of Adam's "
        "batch down its foreach path: the other shape batches' bits change",
        where="ScaleByAdam._directions",
    ),
    Mutation(
        "fira_products_at_float32_fma",
        "galore2/optim/products.py",
        "        return tf32_matmuls(True)",
        "        return nullcontext()",
        ("tests/optim/test_products.py",),
        "Fira's and Muon's float32 products outside galore2's kernels run at float32 FMA's "
        "rate on a GPU (a seventh of TF32's)",
        where="fast_float32",
    ),
    Mutation(
        "muon_newton_schulz_at_float32_fma",
        "galore2/optim/muon.py",
        "                with fast_float32(given[0]) if same else nullcontext():",
        "                with nullcontext():",
        ("tests/optim/test_products.py",),
        "Muon's batched Newton–Schulz runs at float32 FMA's rate on a GPU",
        where="ScaleByMuon.update_many",
    ),
    Mutation(
        "matrices_alone_unrounded",
        "galore2/optim/galore.py",
        "        rounds = len(self.inner) == 1 and not residual.active(group)",
        "        rounds = False",
        ("tests/benchmarks/test_roofline.py::test_7b_matrices_alone_write_rounded_directions",),
        "a matrix projected alone has Adam write a float32 direction its update casts to bf16 "
        "(zeroed, written, read and cast: 1.49x fused AdamW's bytes a layer at Llama-7B)",
        where="GaLore.update_many",
    ),
    Mutation(
        "sharded_matrices_rounded",
        "galore2/optim/lowrank_plan.py",
        "        and not projection.plan.placement.distributed\n",
        "\n",
        ("tests/optim/test_batch_plan.py::test_which_matrices_alone_have_their_direction_rounded",),
        "a sharded matrix's N rounded before its all-gather (the gather's dtype changes)",
        where="rounds_alone",
    ),
    Mutation(
        "cross_checks_skipped",
        "galore2/core/options.py",
        "    check_across(checks, out)\n",
        "",
        ("tests/core/test_errors.py", "tests/core/test_cross_checks.py"),
        "a group is added without its checks across keys (power_iters=0 with the power "
        "projector, capturable with nonfinite='raise'...)",
        where="resolve",
    ),
    Mutation(
        "view_not_strict",
        "galore2/core/options.py",
        "        if key not in self._keys:",
        "        if False:",
        ("tests/core/test_cross_checks.py",),
        "a check's view hands out keys its check does not declare (an undeclared dependence "
        "on another owner's option goes unnoticed)",
        where="Seen._declared",
    ),
    Mutation(
        "nonfinite_check_dropped",
        "galore2/core/nonfinite.py",
        'CrossCheck(("capturable", "nonfinite"), _host_sees_raise),',
        "",
        ("tests/core/test_capturable.py",),
        "capturable=True with nonfinite='raise' accepted (the host never sees the decision)",
        where="NonFinitePolicy",
    ),
    Mutation(
        "galore_checks_partial",
        "galore2/optim/galore.py",
        "*residual.CHECKS, *schedule.CHECKS)",
        "*schedule.CHECKS)",
        ("tests/optim/test_residual.py",),
        "GaLore runs its projector, basis and schedule checks but not the residual's (Fira "
        "and APOLLO together, Fira on a random basis accepted)",
        where="GaLore",
    ),
    Mutation(
        "validate_override_ignored",
        "galore2/core/module.py",
        "        if own is not None and own is not Module.validate:",
        "        if False:",
        ("tests/core/test_cross_checks.py",),
        "a module's overridden validate(group) is silently never called",
        where="refuse_validate_overrides",
    ),
    Mutation(
        "complex_check_eager",
        "galore2/core/optimizer.py",
        "        if not bad:\n            return\n",
        "",
        ("tests/core/test_cross_checks.py",),
        "every module is asked its complex problem for every group, complex or not",
        where="ChainOptimizer._check_complex",
    ),
)


def _definitions(source: str) -> dict[str, list[tuple[int, int]]]:
    """Every def/class of ``source`` by qualified name -> its (start, end) character spans."""
    lines = source.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    found: dict[str, list[tuple[int, int]]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                span = (starts[first - 1], starts[child.end_lineno])
                found.setdefault(name, []).append(span)
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def locate(m: Mutation, root: Path = ROOT) -> tuple[str, int]:
    """(the file relative to ``root``, the pattern's character offset in it). With ``where``
    the definition is looked for in ``m.path``, then in every file of its package; it must be
    defined once and hold the pattern exactly once. Raises ``SystemExit`` naming the entry
    otherwise."""
    if not m.where:
        source = (root / m.path).read_text()
        count = source.count(m.pattern)
        if count != 1:
            raise SystemExit(
                f"mutation {m.name!r}: pattern found {count} times in {m.path} (expected "
                f"once); update tests/mutations.py:\n{m.pattern}"
            )
        return m.path, source.index(m.pattern)
    package = root / Path(m.path).parts[0]
    candidates = [root / m.path] if (root / m.path).is_file() else []
    hits: list[tuple[str, str, tuple[int, int]]] = []
    for file in candidates + sorted(p for p in package.rglob("*.py") if p not in candidates):
        source = file.read_text()
        if m.where.rsplit(".", 1)[-1] not in source:
            continue
        for span in _definitions(source).get(m.where, []):
            hits.append((str(file.relative_to(root)), source, span))
        if hits and file in candidates:
            break
    if len(hits) != 1:
        raise SystemExit(
            f"mutation {m.name!r}: {m.where!r} is defined {len(hits)} times in {m.path} and "
            f"{package.name}/ (expected once); update tests/mutations.py"
        )
    rel, source, (start, end) = hits[0]
    count = source.count(m.pattern, start, end)
    if count != 1:
        raise SystemExit(
            f"mutation {m.name!r}: pattern found {count} times in {m.where} ({rel}; expected "
            f"once); update tests/mutations.py:\n{m.pattern}"
        )
    return rel, source.index(m.pattern, start, end)


def mutated_source(m: Mutation, root: Path = ROOT) -> tuple[str, str]:
    """(the file relative to ``root``, its source with the mutation applied); raises if the
    mutation cannot be located (:func:`locate`)."""
    rel, at = locate(m, root)
    source = (root / rel).read_text()
    return rel, source[:at] + m.replacement + source[at + len(m.pattern) :]


def _copy_repo(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)


def run_one(m: Mutation, timeout: float = TIMEOUT_S) -> tuple[str, float, str]:
    """(outcome, seconds, pytest's last lines): outcome is killed, survived, timeout
    (counted as killed) or error (pytest could not run the tests: not a kill)."""
    rel, source = mutated_source(m)
    with tempfile.TemporaryDirectory(prefix=f"galore2-mut-{m.name}-") as tmp:
        dest = Path(tmp)
        _copy_repo(dest)
        (dest / rel).write_text(source)
        env = {**os.environ, "PYTHONPATH": str(dest), "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests]
        start = time.perf_counter()
        try:
            out = subprocess.run(
                cmd, cwd=dest, env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return "timeout", time.perf_counter() - start, ""
        seconds = time.perf_counter() - start
    tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-3:])
    outcome = {0: "survived", 1: "killed"}.get(out.returncode, "error")
    return outcome, seconds, tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated mutation names")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = ap.parse_args(argv)
    chosen = list(MUTATIONS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        known = {m.name: m for m in MUTATIONS}
        unknown = [n for n in names if n not in known]
        if unknown:
            ap.error(f"unknown mutations {unknown}; see --list")
        chosen = [known[n] for n in names]
    for m in chosen:  # every pattern is checked before anything runs
        mutated_source(m)
    if args.list:
        for m in chosen:
            rel, _ = locate(m)
            where = f"{rel}:{m.where}" if m.where else rel
            print(f"{m.name:22s} {where}  [{', '.join(m.tests)}]\n{'':22s} {m.doc}")
        return 0
    killed = 0
    for m in chosen:
        outcome, seconds, tail = run_one(m)
        killed += outcome in ("killed", "timeout")
        print(f"{m.name:22s} {outcome:8s} {seconds:7.1f}s", flush=True)
        if outcome == "error":
            print("    " + tail.replace("\n", "\n    "), flush=True)
    print(f"score: {killed}/{len(chosen)} killed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
