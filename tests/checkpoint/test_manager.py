"""Per-rank directories, MindSpore-style names, keep_checkpoint_max rotation, latest."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.checkpoint import (
    CheckpointManager,
    checkpoint_dir_for_rank,
    checkpoint_filename,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    parse_checkpoint_filename,
    unused_prefix,
)


def test_rank_directory(tmp_path: Path) -> None:
    assert checkpoint_dir_for_rank(tmp_path, 0, 1) == tmp_path
    assert checkpoint_dir_for_rank(str(tmp_path), 5, 8) == tmp_path / "rank_5"
    with pytest.raises(ValueError, match="rank"):
        checkpoint_dir_for_rank(tmp_path, 8, 8)
    with pytest.raises(ValueError, match="world_size"):
        checkpoint_dir_for_rank(tmp_path, 0, 0)


def test_names() -> None:
    assert checkpoint_filename("checkpoint", 1, 1875) == "checkpoint-1_1875.safetensors"
    assert parse_checkpoint_filename("lenet-10_3.safetensors", "lenet") == (10, 3)
    assert parse_checkpoint_filename("lenet_1-10_3.safetensors", "lenet") is None
    assert parse_checkpoint_filename("lenet-10_3.ckpt", "lenet") is None


def test_rotation_keeps_the_newest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, prefix="net", keep_checkpoint_max=3, rank=1, world_size=2)
    data = {"w": torch.ones(2)}
    for epoch in (1, 2):
        for step in (5, 10):
            manager.save(data, epoch=epoch, step=step, extra={"loss": 0.5})
    names = [p.name for p in manager.checkpoints()]
    assert names == ["net-1_10.safetensors", "net-2_5.safetensors", "net-2_10.safetensors"]
    assert manager.directory == tmp_path / "rank_1"
    latest = manager.latest()
    assert latest is not None and latest.name == "net-2_10.safetensors"
    ckpt = load_checkpoint(latest)
    assert (ckpt.epoch, ckpt.step, ckpt.extra) == (2, 10, {"loss": 0.5})


def test_latest_with_verify_skips_a_broken_newest_file(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_checkpoint_max=None)
    manager.save({"w": torch.ones(2)}, epoch=1, step=1)
    newest = manager.save({"w": torch.zeros(2)}, epoch=1, step=2)
    newest.write_bytes(newest.read_bytes()[:20])
    assert latest_checkpoint(tmp_path) == newest
    good = latest_checkpoint(tmp_path, verify=True)
    assert good is not None and good.name == "checkpoint-1_1.safetensors"
    assert torch.equal(load_checkpoint(good)["w"], torch.ones(2))


def test_helpers_on_missing_or_other_files(tmp_path: Path) -> None:
    assert list_checkpoints(tmp_path / "nope") == []
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "checkpoint-1_1.safetensors").write_bytes(b"")
    (tmp_path / "other-1_1.safetensors").write_bytes(b"")
    assert unused_prefix(tmp_path, "checkpoint") == "checkpoint_1"
    assert unused_prefix(tmp_path, "fresh") == "fresh"
    with pytest.raises(ValueError, match="keep_checkpoint_max"):
        CheckpointManager(tmp_path, keep_checkpoint_max=0)
    with pytest.raises(ValueError, match="prefix"):
        CheckpointManager(tmp_path, prefix="")
