"""DCP checkpoints reshard: save under FSDP2 at world 2, resume at world 1 and 3; a damaged
shard fails every rank (no hang)."""

from __future__ import annotations

from ..dist import spawn
from . import dcp_cases


def test_save_at_2_resume_at_1_and_3(tmp_path):
    spawn(dcp_cases.save_then_continue, 2, str(tmp_path))
    spawn(dcp_cases.load_then_continue, 1, str(tmp_path))
    spawn(dcp_cases.load_then_continue, 3, str(tmp_path))
    shard = tmp_path / "flat1" / "step-00000010" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    spawn(dcp_cases.damaged_fails_on_every_rank, 2, str(tmp_path))


def test_sharded_state_is_checked_by_global_shape_and_a_changed_rank_refused(tmp_path):
    spawn(dcp_cases.sharded_load_checks, 2, str(tmp_path))
