"""How `Model` reads its data: `train` called once per epoch takes each call's data order from
the next epoch, as one `train(E, ...)` call and a hand-written loop calling ``set_epoch(e)`` see
it; `eval` over a DataLoader's ``DistributedSampler`` counts this rank's real rows; the
contract's argument names (API.md) beside MindSpore's."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw

EPOCHS = 3


class Rows(nn.Linear):
    """A linear layer recording the rows (their first feature) of every batch it is given."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(3, 2)
        self.seen: list[list[float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x[:, 0].tolist())
        return super().forward(x)


def _generator_dataset() -> tuple[Any, Callable[[int], None]]:
    torch.manual_seed(0)  # (the pipeline's shuffle seed)
    x, y = torch.arange(8.0).unsqueeze(1).repeat(1, 3), torch.zeros(8, dtype=torch.int64)
    ds = sw.dataset.GeneratorDataset([(x[i], y[i]) for i in range(8)], ["x", "y"]).batch(4)
    return ds, ds.set_epoch


def _distributed_loader() -> tuple[Any, Callable[[int], None]]:
    x, y = torch.arange(8.0).unsqueeze(1).repeat(1, 3), torch.zeros(8, dtype=torch.int64)
    data = torch.utils.data.TensorDataset(x, y)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=0, seed=0)
    return torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler), sampler.set_epoch


def _train(calls: Iterable[tuple[int, int]], form: Callable[[], Any], own: bool) -> list[Any]:
    """The batches a Model trains on over `calls` of ``train(epoch, data, initial_epoch=..)``
    (`own`: the user calls the sampler's ``set_epoch(e)`` before each, the DDP idiom)."""
    data, set_epoch = form()
    net = Rows()
    model = sw.Model(net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), 0.1))
    for done, (epoch, initial) in enumerate(calls):
        if own:
            set_epoch(done)
        model.train(epoch, data, initial_epoch=initial)
    return net.seen


@pytest.mark.parametrize("form", [_generator_dataset, _distributed_loader])
def test_one_train_call_per_epoch_sees_each_epochs_order(form: Callable[[], Any]) -> None:
    """``for e in range(E): model.train(1, data)`` trained on epoch 0's order every time (each
    call counted its epochs from 0 and told the dataset / sampler so, undoing a user's own
    ``set_epoch(e)``); it now sees epochs 0 .. E-1, as one ``train(E, data)`` call and a plain
    loop do. ``initial_epoch`` places a call's epochs as it places the epoch numbers."""
    data, set_epoch = form()
    loop: list[Any] = []
    for e in range(EPOCHS):
        set_epoch(e)
        loop += [batch[0][:, 0].tolist() for batch in data]
    assert loop[: len(loop) // EPOCHS] != loop[len(loop) // EPOCHS :][: len(loop) // EPOCHS]
    assert _train([(EPOCHS, 0)], form, own=False) == loop
    assert _train([(1, 0)] * EPOCHS, form, own=False) == loop
    assert _train([(1, 0)] * EPOCHS, form, own=True) == loop
    assert _train([(1, 0), (EPOCHS, 1)], form, own=False) == loop


CASES = [(1, 2, False), (1, 3, False), (0, 3, False), (1, 4, True)]


@pytest.mark.parametrize(("rank", "batch", "drop_last"), CASES)
def test_eval_over_a_distributed_sampler_leaves_its_padding_out(
    rank: int, batch: int, drop_last: bool
) -> None:
    """A DataLoader over a ``DistributedSampler`` (11 rows, 2 replicas) pads rank 1's rows with
    row 0 again: `Model.eval` counted it (rank 1's accuracy over 6 rows, 5 of them its own). It
    counts this rank's real rows now, as a hand-written loop over them does (a ``drop_last``
    batch sampler drops the padding with the short last batch; nothing more is left out)."""
    torch.manual_seed(0)
    net, loss_fn = nn.Linear(3, 2), nn.CrossEntropyLoss()
    x = torch.randn(11, 3)
    with torch.no_grad():
        y = net(x).argmax(-1)
    y[1::4] = 1 - y[1::4]  # (rows 1, 5, 9 wrong; row 0, rank 1's padding, right)
    data = torch.utils.data.TensorDataset(x, y)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=rank, shuffle=False)
    batches = torch.utils.data.BatchSampler(sampler, batch_size=batch, drop_last=drop_last)
    loader = torch.utils.data.DataLoader(data, batch_sampler=batches)
    real = list(range(rank, 11, 2))
    if drop_last:
        real = real[: len(real) // batch * batch]
    with torch.no_grad():
        hits = (net(x[real]).argmax(-1) == y[real]).double().mean().item()
        losses = [loss_fn(net(x[real[i : i + batch]]), y[real[i : i + batch]]).item()
                  for i in range(0, len(real), batch)]  # fmt: skip
    got = sw.Model(net, loss_fn, metrics={"accuracy", "loss"}).eval(loader)
    assert got["accuracy"] == pytest.approx(hits, rel=1e-12)
    assert got["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-6)


def test_the_contracts_argument_names() -> None:
    """API.md's names: ``train(epoch, dataset=...)``, ``eval(dataset=...)`` and
    ``load_param_into_net(net, params=...)`` beside MindSpore's (``train_dataset``,
    ``valid_dataset``, ``parameter_dict``); one of the two, else a TypeError."""
    data, _ = _generator_dataset()
    one, other = Rows(), Rows()
    for net, kw in ((one, "train_dataset"), (other, "dataset")):
        model = sw.Model(net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), 0.1))
        model.train(1, **{kw: data})
    assert one.seen == other.seen and len(one.seen) == 2
    assert torch.equal(one.weight, other.weight)
    model = sw.Model(one, nn.CrossEntropyLoss(), metrics={"accuracy"})
    assert model.eval(dataset=data) == model.eval(valid_dataset=data) == model.eval(data)
    with pytest.raises(TypeError, match="pass the dataset once"):
        model.eval(data, dataset=data)
    with pytest.raises(TypeError, match=r"Model\.train: missing the dataset"):
        sw.Model(one, nn.CrossEntropyLoss(), torch.optim.SGD(one.parameters(), 0.1)).train(1)
    fresh = Rows()
    entries = {"weight": one.weight.detach(), "bias": one.bias.detach()}
    assert sw.load_param_into_net(fresh, params=entries) == ([], [])
    assert torch.equal(fresh.weight, one.weight)
    with pytest.raises(TypeError, match="pass the entries once"):
        sw.load_param_into_net(fresh, entries, params=entries)


def test_train_on_a_dataset_without_batches_is_refused() -> None:
    # 6 rows, batch(8, drop_remainder=True): no batch, and train() returned without training
    rows = [(torch.full((3,), float(i)), torch.tensor(i % 2)) for i in range(6)]
    ds = sw.dataset.GeneratorDataset(rows, ["x", "y"]).batch(8, drop_remainder=True)
    net = Rows()
    model = sw.Model(net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), 0.1))
    with pytest.raises(
        ValueError,
        match=r"no batch in an epoch \(6 rows, batch\(8, drop_remainder=True\): 0 batches",
    ):
        model.train(2, ds)
    assert net.seen == [] and model.cur_step_num == 0

    def nothing() -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        return iter(())

    with pytest.raises(ValueError, match="yields no batch in an epoch, so nothing would train"):
        model.train(1, nothing())  # (no len(): known after the first epoch)


def test_a_used_up_iterator_is_refused_in_a_later_epoch() -> None:
    """A one-shot generator trained epoch 1 of train(3, ...) only: epochs 2 and 3 yielded
    nothing, ran 0 steps and were counted as done, without a word."""
    batches = [(torch.full((2, 3), float(i)), torch.tensor([0, 1])) for i in range(2)]
    net = Rows()
    model = sw.Model(net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), 0.1))
    with pytest.raises(ValueError) as refused:
        model.train(EPOCHS, (b for b in batches))
    message = str(refused.value)
    for words in ("a generator", "no batch in epoch 2", "has 2", "list of batches", "DataLoader"):
        assert words in message, message
    assert net.seen == [[0.0, 0.0], [1.0, 1.0]]  # (epoch 1 trained, nothing after it)
    assert model.epochs_done == 1 and model.cur_step_num == 2
    used_up = iter(batches)
    model.train(1, used_up)
    with pytest.raises(ValueError, match=r"an iterator yields its batches once.*list of batches"):
        model.train(1, used_up)  # (a later call given the same iterator)
    model.train(EPOCHS, batches)  # (a list: every epoch from the start)
    assert model.cur_step_num == 4 + 2 * EPOCHS
