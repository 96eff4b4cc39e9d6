"""Fira, APOLLO / APOLLO-Mini and GaLoreMuon under FSDP2 (CPU, gloo): world 2 and 3 equal one
process (both projection sides, uneven row splits, 3 refreshes), Fira with 8-bit moments and
int8 bases too, and a DCP checkpoint saved at world 2 resumes at world 3 as if never
interrupted (see lowrank_fsdp_cases)."""

from __future__ import annotations

import pytest

from ..dist import spawn
from . import lowrank_fsdp_cases as cases

# The limiter's norm must reshard (Fira); Muon's momentum is the only moment (GaLoreMuon).
DCP_CONFIGS = ("fira-svd", "muon-newton_schulz")


@pytest.mark.parametrize("world", [2, 3])
def test_lowrank_modules_match_single_process(world):
    spawn(cases.run_all, world)


def test_dcp_save_at_2_resume_at_3(tmp_path):
    spawn(cases.dcp_save, 2, str(tmp_path), DCP_CONFIGS)
    spawn(cases.dcp_load, 3, str(tmp_path), DCP_CONFIGS)


@pytest.mark.slow
def test_dcp_every_config_resumes_at_1_and_3(tmp_path):
    names = tuple(cases.CONFIGS)
    spawn(cases.dcp_save, 2, str(tmp_path), names)
    spawn(cases.dcp_load, 1, str(tmp_path), names)
    spawn(cases.dcp_load, 3, str(tmp_path), names)


@pytest.mark.slow
def test_hsdp_matches_single_process():
    names = ("fira-svd", "muon-newton_schulz", "muon-polar")  # configs that store bases
    spawn(cases.hsdp_matches_single_process, 4, names, timeout=300)
