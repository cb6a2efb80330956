"""ModelCheckpoint writes MindSpore-named files with rotation; resume continues training with
the identical loss sequence (same data order, optimizer state and step count)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import shardwise as sw
import shardwise.train
from shardwise.checkpoint import CheckpointError


def dataset(shuffle: bool = False) -> sw.dataset.GeneratorDataset:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(24, 5, generator=g), torch.randint(0, 3, (24,), generator=g)
    rows = [(x[i], y[i]) for i in range(24)]
    return sw.dataset.GeneratorDataset(rows, ["x", "y"], shuffle=shuffle).batch(6)


def model() -> sw.Model:
    net = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    return sw.Model(net, nn.CrossEntropyLoss(), torch.optim.Adam(net.parameters(), 1e-2))


class Losses(sw.train.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_step_end(self, ctx: sw.train.RunContext) -> None:
        self.values.append(float(ctx.net_outputs))


def test_resume_gives_identical_losses(tmp_path: Path) -> None:
    sw.set_seed(0)
    full, straight = model(), Losses()
    full.train(3, dataset(), callbacks=[straight])

    sw.set_seed(0)
    first, part1 = model(), Losses()
    cfg = sw.train.CheckpointConfig(save_checkpoint_steps=4, keep_checkpoint_max=2)
    saver = sw.train.ModelCheckpoint("mlp", tmp_path, cfg)
    first.train(1, dataset(), callbacks=[part1, saver])
    assert saver.latest is not None and saver.latest.name == "mlp-1_4.safetensors"

    sw.set_seed(123)  # a different seed: everything must come from the checkpoint
    second, part2 = model(), Losses()
    done = sw.train.resume(second, saver.latest)
    assert done == 1 and second.cur_step_num == 4
    sw.set_seed(0)  # the data order is the seed's, as in the uninterrupted run
    data = dataset()
    second.train(3, data, callbacks=[part2], initial_epoch=done)
    assert part1.values + part2.values == straight.values


@pytest.mark.parametrize("epochs_per_call", [1, 2])
def test_resume_after_several_train_calls_gives_identical_losses(
    tmp_path: Path, epochs_per_call: int
) -> None:
    """train(1, data) once per epoch (or train(2) twice): every call wrote ``m-1_4`` again (the
    epoch in the name restarted per call) and `resume` set the epochs done to the call's, so
    the next train() shuffled with an earlier epoch's order. The files are named with the
    Model's epoch over all calls, which `resume` restores: the order goes on as never stopped."""
    k = epochs_per_call
    sw.set_seed(0)
    full, straight = model(), Losses()
    data = dataset(shuffle=True)
    for _ in range(3):
        full.train(k, data, callbacks=[straight])

    sw.set_seed(0)
    first, part1 = model(), Losses()
    cfg = sw.train.CheckpointConfig(save_checkpoint_steps=4, keep_checkpoint_max=10)
    saver = sw.train.ModelCheckpoint("m", tmp_path, cfg)
    data = dataset(shuffle=True)
    for _ in range(2):
        first.train(k, data, callbacks=[part1, saver])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"m-{e}_4.safetensors" for e in range(1, 2 * k + 1)]
    assert saver.latest == tmp_path / f"m-{2 * k}_4.safetensors"

    sw.set_seed(0)
    second, part2 = model(), Losses()
    data = dataset(shuffle=True)
    done = sw.train.resume(second, saver.latest)
    assert done == 2 * k and second.cur_step_num == 8 * k
    second.train(k, data, callbacks=[part2])
    assert part1.values + part2.values == straight.values

    sw.set_seed(0)  # (initial_epoch=done continues the same way)
    third, part3 = model(), Losses()
    data = dataset(shuffle=True)
    done = sw.train.resume(third, saver.latest)
    third.train(3 * k, data, callbacks=[part3], initial_epoch=done)
    assert part1.values + part3.values == straight.values


def test_resume_of_a_network_with_dropout_gives_identical_losses(tmp_path: Path) -> None:
    """Dropout draws from torch's generator, whose state the checkpoint did not hold: the
    resumed run drew other masks (the README's identical loss sequence held only without
    randomness). `resume` puts the state of the save back for the next train()."""

    def dropout_model() -> sw.Model:
        net = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 3))
        return sw.Model(net, nn.CrossEntropyLoss(), torch.optim.Adam(net.parameters(), 1e-2))

    sw.set_seed(0)
    full, straight = dropout_model(), Losses()
    full.train(3, dataset(), callbacks=[straight])

    sw.set_seed(0)
    first, part1 = dropout_model(), Losses()
    saver = sw.train.ModelCheckpoint("drop", tmp_path)
    first.train(1, dataset(), callbacks=[part1, saver])
    assert saver.latest is not None

    sw.set_seed(123)  # (another seed and other draws before the resumed train())
    second, part2 = dropout_model(), Losses()
    done = sw.train.resume(second, saver.latest)
    sw.set_seed(0)
    data = dataset()
    torch.rand(7)
    second.train(3, data, callbacks=[part2], initial_epoch=done)
    assert part1.values + part2.values == straight.values


class SeededDrop(nn.Module):
    """A seeded `sw.ops.Dropout` (its own generator) inside a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.op = sw.ops.Dropout(0.5, Seed0=3, Seed1=5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.op(x)[0]
        return out


def seeded_dropout_model() -> sw.Model:
    net = nn.Sequential(nn.Linear(5, 8), SeededDrop(), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3))
    return sw.Model(net, nn.CrossEntropyLoss(), torch.optim.Adam(net.parameters(), 1e-2))


def test_resume_continues_a_seeded_op_dropouts_own_stream(tmp_path: Path) -> None:
    """A seeded `sw.ops.Dropout` draws from a generator of its own, which the checkpoint did
    not hold: the resumed op started its stream over and the losses differed from the first
    resumed step. Its state is stored by module path and put back by `resume`."""
    sw.set_seed(0)
    full, straight = seeded_dropout_model(), Losses()
    full.train(3, dataset(), callbacks=[straight])

    sw.set_seed(0)
    first, part1 = seeded_dropout_model(), Losses()
    saver = sw.train.ModelCheckpoint("op", tmp_path)
    first.train(1, dataset(), callbacks=[part1, saver])
    assert saver.latest is not None

    sw.set_seed(123)
    second, part2 = seeded_dropout_model(), Losses()
    done = sw.train.resume(second, saver.latest)
    sw.set_seed(0)
    second.train(3, dataset(), callbacks=[part2], initial_epoch=done)
    assert part1.values + part2.values == straight.values


def test_a_file_without_op_generator_states_still_resumes(tmp_path: Path) -> None:
    """A file written before the seeded ops' states were stored (no ``op_rng`` in its extra)
    loads; those ops then draw from their seeds' start."""
    sw.set_seed(0)
    first = seeded_dropout_model()
    saver = sw.train.ModelCheckpoint("op", tmp_path)
    first.train(1, dataset(), callbacks=[saver])
    assert saver.latest is not None
    ckpt = sw.load_checkpoint(saver.latest)
    extra = {k: v for k, v in ckpt.extra.items() if k != "op_rng"}
    old = sw.save_checkpoint(
        first.network, tmp_path / "old-1_4.safetensors", step=ckpt.step, epoch=ckpt.epoch,
        optimizer=first.optimizer, extra=extra,
    )  # fmt: skip

    second, losses = seeded_dropout_model(), Losses()
    assert sw.train.resume(second, old) == 1
    second.train(2, dataset(), callbacks=[losses], initial_epoch=1)
    assert len(losses.values) == 4


def test_a_dataset_without_len_resumes_from_its_first_epoch(tmp_path: Path) -> None:
    """The first epoch's length is learnt at its end, after the last step's checkpoint was
    written with 'step 3 of 0': resume refused a genuine end-of-epoch file. It is written
    again at the epoch's end with the length."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(10, 5, generator=g), torch.randint(0, 3, (10,), generator=g)

    class Loader:  # (re-iterable, no len())
        def __iter__(self):  # type: ignore[no-untyped-def]
            return ((x[i : i + 4], y[i : i + 4]) for i in range(0, 10, 4))

    sw.set_seed(0)
    full, straight = model(), Losses()
    full.train(2, Loader(), callbacks=[straight])
    sw.set_seed(0)
    first, part1 = model(), Losses()
    saver = sw.train.ModelCheckpoint("it", tmp_path, sw.train.CheckpointConfig(3))
    first.train(1, Loader(), callbacks=[part1, saver])
    second, part2 = model(), Losses()
    done = sw.train.resume(second, tmp_path / "it-1_3.safetensors")
    second.train(2, Loader(), callbacks=[part2], initial_epoch=done)
    assert part1.values + part2.values == straight.values

    class StopAt2(sw.train.Callback):  # (stopped inside the first epoch: not its length)
        def on_train_step_end(self, ctx: sw.train.RunContext) -> None:
            if ctx.cur_step_num == 2:
                ctx.request_stop()

    saver = sw.train.ModelCheckpoint("stop", tmp_path, sw.train.CheckpointConfig(1))
    model().train(1, Loader(), callbacks=[StopAt2(), saver])
    with pytest.raises(ValueError, match=r"not saved at the end of an epoch"):
        sw.train.resume(model(), tmp_path / "stop-1_2.safetensors")


def test_rotation_and_prefix(tmp_path: Path) -> None:
    sw.set_seed(0)
    cfg = sw.train.CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=3)
    model().train(2, dataset(), callbacks=[sw.train.ModelCheckpoint("net", tmp_path, cfg)])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["net-2_2.safetensors", "net-2_3.safetensors", "net-2_4.safetensors"]
    model().train(1, dataset(), callbacks=[sw.train.ModelCheckpoint("net", tmp_path, cfg)])
    assert any(p.name.startswith("net_1-1_") for p in tmp_path.iterdir())


def test_a_callback_reused_by_later_train_calls_keeps_its_prefix(tmp_path: Path) -> None:
    """One `ModelCheckpoint` given to three train() calls: each call chose a new prefix
    (``net``, ``net_1``, ``net_2``), so keep_checkpoint_max held per call and the files piled
    up. The prefix is chosen once (MindSpore: in ``__init__``); the files of all calls count
    against keep_checkpoint_max, the oldest written deleted first (the names' epochs restart in
    each call when the files were named so). The names' epoch counts over the calls."""
    sw.set_seed(0)
    trained = model()
    saver = sw.train.ModelCheckpoint("net", tmp_path, sw.train.CheckpointConfig(3, 3))

    def files() -> list[str]:
        return sorted(p.name for p in tmp_path.iterdir())

    trained.train(2, dataset(), callbacks=[saver])  # (4 steps an epoch: steps 3, 6 and 8)
    assert files() == ["net-1_3.safetensors", "net-2_2.safetensors", "net-2_4.safetensors"]
    trained.train(1, dataset(), callbacks=[saver])  # (steps 9 and 12: the Model's epoch 3)
    assert files() == ["net-2_4.safetensors", "net-3_1.safetensors", "net-3_4.safetensors"]
    trained.train(2, dataset(), callbacks=[saver], initial_epoch=1)  # (epoch 2 again: 15, 16)
    assert files() == ["net-2_3.safetensors", "net-2_4.safetensors", "net-3_4.safetensors"]
    assert saver.latest == tmp_path / "net-2_4.safetensors"  # (rewritten: the newest)


def test_resume_rejects_mid_epoch_and_truncated(tmp_path: Path) -> None:
    sw.set_seed(0)
    cfg = sw.train.CheckpointConfig(save_checkpoint_steps=2)
    saver = sw.train.ModelCheckpoint("m", tmp_path, cfg)
    model().train(1, dataset(), callbacks=[saver])
    with pytest.raises(ValueError, match="not saved at the end of an epoch"):
        sw.train.resume(model(), tmp_path / "m-1_2.safetensors")
    latest = saver.latest
    assert latest is not None
    data = latest.read_bytes()
    latest.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=latest.name):
        sw.train.resume(model(), latest)
    previous = sw.load_checkpoint(tmp_path / "m-1_2.safetensors")  # still intact
    assert previous.epoch == 1 and previous.step == 2


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="save_checkpoint_steps=0"):
        sw.train.CheckpointConfig(save_checkpoint_steps=0)


def test_mindspores_checkpoint_config_arguments_are_named() -> None:
    """MindSpore's ``CheckpointConfig(save_checkpoint_seconds=...)`` was Python's 'unexpected
    keyword argument'; the error names it as MindSpore's, lists the arguments not supported,
    and says how to save instead."""
    with pytest.raises(
        TypeError,
        match=r"save_checkpoint_seconds, integrated_save: MindSpore's, not supported here\. "
        r"It takes save_checkpoint_steps, keep_checkpoint_max and save_optimizer only: save "
        r"every N steps .*enc_key",
    ):
        sw.train.CheckpointConfig(save_checkpoint_seconds=60, integrated_save=False)
    with pytest.raises(TypeError, match=r"unknown argument\(s\) steps\. It takes"):
        sw.train.CheckpointConfig(steps=2)
    cfg = sw.train.CheckpointConfig(3, keep_checkpoint_max=2)
    assert (cfg.save_checkpoint_steps, cfg.keep_checkpoint_max, cfg.save_optimizer) == (3, 2, True)


def test_a_call_failing_in_its_first_epoch_does_not_count_it(tmp_path: Path) -> None:
    """A train() call raising in its first step (bad batches) counted the epoch as done: a
    retry named its files from epoch 2 and shuffled with epoch 1's order (a review found it)."""
    sw.set_seed(0)
    fresh, want = model(), Losses()
    fresh.train(2, dataset(shuffle=True), callbacks=[want])

    sw.set_seed(0)
    retried, got = model(), Losses()
    with pytest.raises(TypeError, match=r"Model\.train"):
        retried.train(2, [torch.ones(3)])  # (a batch without its label)
    assert retried.epochs_done == 0
    cfg = sw.train.CheckpointConfig(save_checkpoint_steps=4, keep_checkpoint_max=10)
    saver = sw.train.ModelCheckpoint("m", tmp_path, cfg)
    retried.train(2, dataset(shuffle=True), callbacks=[got, saver])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m-1_4.safetensors", "m-2_4.safetensors"]
    assert got.values == want.values
