"""Checkpoint verification on real files: truncation, a flipped byte, a rank that never finished."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from training.checkpoint_files import STATE_FILE, problem, write_file_list


def make_checkpoint(root: Path, step: int, world: int = 2) -> Path:
    """Each rank saves its own directory and lists it; Ray Train merges the ranks' directories into one."""
    ckpt = root / f"checkpoint_{step:06d}"
    for rank in range(world):
        part = root / f"rank{rank}-step{step}"
        (part / f"step{step}").mkdir(parents=True)
        (part / f"step{step}" / f"zero_pp_rank_{rank}_optim_states.pt").write_bytes(os.urandom(4096 + rank))
        if rank == 0:
            (part / STATE_FILE).write_text(json.dumps({"step": step}))
        write_file_list(part, rank)
        shutil.copytree(part, ckpt, dirs_exist_ok=True)
    return ckpt


def test_whole_checkpoint_verifies(tmp_path):
    assert problem(make_checkpoint(tmp_path, 50), world=2) is None


def test_truncated_shard_is_named(tmp_path):
    ckpt = make_checkpoint(tmp_path, 100)
    shard = ckpt / "step100" / "zero_pp_rank_1_optim_states.pt"
    os.truncate(shard, shard.stat().st_size // 2)
    assert "step100/zero_pp_rank_1_optim_states.pt has 2,048 bytes, 4,097 were written" == problem(ckpt, world=2)


def test_flipped_byte_and_missing_rank_list(tmp_path):
    ckpt = make_checkpoint(tmp_path, 100)
    shard = ckpt / "step100" / "zero_pp_rank_0_optim_states.pt"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert "does not match its digest" in problem(ckpt, world=2)
    assert "_files.rank2.json is missing" in problem(make_checkpoint(tmp_path / "b", 7), world=3)


def test_each_rank_reads_only_its_own_files(tmp_path):
    ckpt = make_checkpoint(tmp_path, 100)
    os.truncate(ckpt / "step100" / "zero_pp_rank_1_optim_states.pt", 10)
    assert problem(ckpt, world=2, ranks=range(0, 1)) is None
    assert "zero_pp_rank_1" in problem(ckpt, world=2, ranks=range(1, 2))
