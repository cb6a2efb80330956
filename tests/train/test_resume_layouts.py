"""`sw.train.resume` given one rank's file of a multi-rank job finds the other ranks' files in
both layouts a job writes: ``ckpt/rank_<r>/`` (one directory for every rank) and
``<r>/rank_<r>/`` (``ModelCheckpoint(directory=str(rank_id))`` on each rank, as seed 002 and
examples/quick_start.py save). The second was looked for in ``<r>/`` alone, so every rank's
resume failed ("the checkpoint is of 2 ranks but the files of rank_1 are missing").

The rank files are a 1-epoch `Model`'s checkpoint cut for 2 ranks by `sw.checkpoint.transform`
(each rank a block of the rows of the first weight); the real 2-process save in the seed's
layout is tests/multiprocess/test_model_resume_real.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import shardwise as sw
from shardwise.checkpoint import CheckpointError, CheckpointStrategy
from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.planner import ParamPlan

from .test_checkpoint_callback import Losses, dataset, model

NAME = "mlp-1_4.safetensors"


def two_rank_checkpoint(tmp_path: Path) -> tuple[Path, list[float]]:
    """A 2-rank job's checkpoint of epoch 1 in ``rank_<r>/`` folders, and the losses of
    epochs 2-3 of the uninterrupted run."""
    sw.set_seed(0)
    straight = Losses()
    model().train(3, dataset(), callbacks=[straight])
    sw.set_seed(0)
    saver = sw.train.ModelCheckpoint("mlp", tmp_path / "one", sw.train.CheckpointConfig(4))
    model().train(1, dataset(), callbacks=[saver])
    m = DeviceMatrix((2,), ("mp",))
    rows = {"0.weight": ParamPlan(TensorLayout(m, ((0,), ())), (8, 5))}
    sw.checkpoint.transform(tmp_path / "one", tmp_path / "ckpt", CheckpointStrategy(2, m, rows))
    return tmp_path / "ckpt", straight.values[4:]


def resumed_losses(rank_file: Path) -> list[float]:
    sw.set_seed(123)  # (everything comes from the checkpoint)
    second, losses = model(), Losses()
    done = sw.train.resume(second, rank_file)
    sw.set_seed(0)
    second.train(3, dataset(), callbacks=[losses], initial_epoch=done)
    return losses.values


def test_resume_finds_the_ranks_of_both_layouts(tmp_path: Path) -> None:
    ckpt, expected = two_rank_checkpoint(tmp_path)
    assert resumed_losses(ckpt / "rank_1" / NAME) == pytest.approx(expected, rel=1e-5, abs=0)
    seed = tmp_path / "seed"  # (ModelCheckpoint(directory=str(rank)) on each rank)
    for r in range(2):
        shutil.copytree(ckpt / f"rank_{r}", seed / str(r) / f"rank_{r}")
    for r in range(2):
        got = resumed_losses(seed / str(r) / f"rank_{r}" / NAME)
        assert got == pytest.approx(expected, rel=1e-5, abs=0)
    assert sw.checkpoint.checkpoint_folder(seed / "1" / "rank_1" / NAME) == seed
    net = model().network
    assert sw.checkpoint.load_distributed(net, seed, name=NAME) == ([], [])


def test_a_missing_rank_names_both_layouts(tmp_path: Path) -> None:
    ckpt, _ = two_rank_checkpoint(tmp_path)
    seed = tmp_path / "seed"
    shutil.copytree(ckpt / "rank_1", seed / "1" / "rank_1")
    with pytest.raises(CheckpointError) as refused:
        sw.train.resume(model(), seed / "1" / "rank_1" / NAME)
    message = str(refused.value)
    layouts = ("<folder>/rank_<r>/", "<folder>/<r>/rank_<r>/")
    for words in ("of 2 ranks", "rank_0 are missing", *layouts):
        assert words in message, message
