"""LossMonitor's line byte for byte, TimeMonitor, Model's loop bookkeeping and its errors."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
import shardwise.train


def _data(steps: int, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(batch, 3, generator=g), torch.randint(0, 2, (batch,), generator=g))
        for _ in range(steps)
    ]


def _model() -> sw.Model:
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    return sw.Model(
        net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), 0.1), metrics={"accuracy"}
    )


def _rows() -> sw.dataset.GeneratorDataset:
    """Unbatched rows (a label of shape [] each)."""
    return sw.dataset.GeneratorDataset([(x[0], y[0]) for x, y in _data(2, 1)], ["x", "y"])


def _aux_model() -> sw.Model:
    """A network returning ``(logits, aux)``."""
    net = nn.Linear(3, 2)
    aux = nn.Module()
    aux.forward = lambda x: (net(x), net.weight.sum())  # type: ignore[method-assign]
    return sw.Model(aux, metrics={"accuracy"})


class Losses(sw.train.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, int, float]] = []

    def on_train_step_end(self, ctx: sw.train.RunContext) -> None:
        self.seen.append((ctx.cur_epoch_num, ctx.step_in_epoch, float(ctx.net_outputs)))


def test_loss_monitor_line_byte_for_byte(capsys: pytest.CaptureFixture[str]) -> None:
    losses = Losses()
    _model().train(2, _data(5), callbacks=[sw.train.LossMonitor(2), losses])
    out = capsys.readouterr().out.splitlines()
    every_second = losses.seen[1::2]  # (every 2 steps of the run, across epochs: MindSpore's)
    want = [f"epoch: {e} step: {s}, loss is {loss!r}" for e, s, loss in every_second]
    assert out == want
    assert len(out) == 5 and out[0].startswith("epoch: 1 step: 2, loss is ")
    assert out[2].startswith("epoch: 2 step: 1, loss is ")
    assert re.fullmatch(r"epoch: 2 step: 5, loss is \d\.\d+", out[-1])


def test_loss_monitor_value_is_python_float_repr(capsys: pytest.CaptureFixture[str]) -> None:
    ctx = sw.train.RunContext(nn.Linear(1, 1), None, None, 1, 100, cur_epoch_num=1, cur_step_num=20)
    ctx.net_outputs = torch.tensor(2.241283893585205)
    sw.train.LossMonitor(20).on_train_step_end(ctx)
    assert capsys.readouterr().out == "epoch: 1 step: 20, loss is 2.241283893585205\n"


def test_loss_monitor_stops_on_nan() -> None:
    ctx = sw.train.RunContext(nn.Linear(1, 1), None, None, 1, 10, cur_epoch_num=1, cur_step_num=3)
    ctx.net_outputs = torch.tensor(float("nan"))
    with pytest.raises(ValueError, match=r"epoch: 1 step: 3\. Invalid loss nan"):
        sw.train.LossMonitor().on_train_step_end(ctx)


def test_loss_monitor_bad_argument() -> None:
    with pytest.raises(ValueError, match="per_print_times=-1 must be >= 0"):
        sw.train.LossMonitor(-1)


def test_loss_monitor_zero_never_prints_and_a_reused_one_prints_again(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """MindSpore's ``LossMonitor(0)`` prints nothing (it was refused); one monitor reused for a
    second model, whose steps count from 1 again, printed nothing over its whole run."""
    _model().train(1, _data(3), callbacks=[sw.train.LossMonitor(0)])
    assert capsys.readouterr().out == ""
    monitor = sw.train.LossMonitor(2)
    for _ in range(2):
        _model().train(2, _data(3), callbacks=[monitor])
        lines = capsys.readouterr().out.splitlines()
        assert [line.split(",")[0] for line in lines] == [
            "epoch: 1 step: 2",
            "epoch: 2 step: 1",
            "epoch: 2 step: 3",
        ]


def test_classic_hooks_and_mindspores_context_fields() -> None:
    """A callback written with MindSpore's classic hooks (``step_end``, ``epoch_end`` ...) ran
    and did nothing; ``cb_params`` lacked ``train_network``, ``list_callback`` and others."""

    class Classic(sw.train.Callback):
        def __init__(self) -> None:
            self.calls: list[str] = []

        def begin(self, run_context: Any) -> None:
            self.calls.append("begin")

        def step_end(self, run_context: Any) -> None:
            params = run_context.original_args()
            assert params.train_network is params.network and params.mode == "train"
            assert params.list_callback == [self] and params.device_number == 1
            assert params.parallel_mode == "stand_alone" and not params.dataset_sink_mode
            self.calls.append(f"step_end {params.cur_step_num}")

        def epoch_end(self, run_context: Any) -> None:
            self.calls.append("epoch_end")

        def end(self, run_context: Any) -> None:
            self.calls.append("end")

    classic = Classic()
    _model().train(1, _data(2), callbacks=[classic])
    assert classic.calls == ["begin", "step_end 1", "step_end 2", "epoch_end", "end"]


def test_train_takes_mindspores_sink_size() -> None:
    """MindSpore's order ``train(epoch, dataset, callbacks, dataset_sink_mode, sink_size,
    initial_epoch)``: sink_size was missing, so a positional 5th argument became
    initial_epoch (-1: an error; 50: fifty epochs silently skipped)."""
    losses = Losses()
    _model().train(2, _data(2), [losses], False, 50)
    assert [e for e, _, _ in losses.seen] == [1, 1, 2, 2]
    _model().train(1, _data(2), sink_size=-1)
    with pytest.raises(ValueError, match=r"sink_size=0 must be -1 or an int >= 1"):
        _model().train(1, _data(2), sink_size=0)


def test_a_data_loader_over_an_iterable_dataset_trains() -> None:
    """``len()`` of such a DataLoader raises TypeError (it crashed Model.train); its length is
    learnt in the first epoch, as for any dataset without one."""

    class Rows(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            yield from ((x[i], y[i]) for x, y in _data(3) for i in range(len(x)))

    losses = Losses()
    _model().train(2, torch.utils.data.DataLoader(Rows(), batch_size=4), callbacks=[losses])
    assert [(e, s) for e, s, _ in losses.seen] == [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3)]


@pytest.mark.parametrize("form", ["sampler", "batch_sampler"])
def test_a_distributed_samplers_epoch_is_set_each_epoch(form: str) -> None:
    """A DataLoader over a ``DistributedSampler`` (shuffle on; also inside a ``BatchSampler``)
    is told each epoch, as a DDP loop calls ``sampler.set_epoch(e)``: it yielded the same order
    every epoch."""
    x, y = torch.arange(8.0).unsqueeze(1).repeat(1, 3), torch.zeros(8, dtype=torch.int64)
    data = torch.utils.data.TensorDataset(x, y)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=0, seed=0)
    if form == "sampler":
        loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    else:
        batches = torch.utils.data.BatchSampler(sampler, batch_size=4, drop_last=False)
        loader = torch.utils.data.DataLoader(data, batch_sampler=batches)
    order: list[list[float]] = []

    class Rows(nn.Linear):
        def forward(self, rows: torch.Tensor) -> torch.Tensor:
            order.append(rows[:, 0].tolist())
            return super().forward(rows)

    net = Rows(3, 2)
    sw.Model(net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), 0.1)).train(3, loader)
    assert len(order) == 3 and order[0] != order[1] != order[2], order
    sampler.set_epoch(1)  # (epoch 2 was the sampler's epoch 1)
    assert [float(i) for i in sampler] == order[1]


def test_time_monitor(capsys: pytest.CaptureFixture[str]) -> None:
    _model().train(1, _data(3), callbacks=[sw.train.TimeMonitor()])
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(r"epoch time: \d+\.\d{3} ms, per step time: \d+\.\d{3} ms", line)


def test_steps_count_across_epochs_and_initial_epoch() -> None:
    losses = Losses()
    model = _model()
    model.train(3, _data(4), callbacks=[losses], initial_epoch=1)
    assert [(e, s) for e, s, _ in losses.seen] == [(e, s) for e in (2, 3) for s in (1, 2, 3, 4)]
    assert model.cur_step_num == 8


def test_set_seed_makes_training_repeatable() -> None:
    def run() -> list[float]:
        sw.set_seed(3)
        net = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 2))
        losses = Losses()
        sw.Model(net, nn.CrossEntropyLoss(), torch.optim.Adam(net.parameters())).train(
            1, _data(4), callbacks=[losses]
        )
        return [x for _, _, x in losses.seen]

    assert run() == run()
    with pytest.raises(ValueError, match="seed=-1"):
        sw.set_seed(-1)


def test_eval_in_a_simulated_world() -> None:
    """Every rank evaluating the whole batch gives one device's accuracy; each rank its own
    rows is a ValueError naming the fixes (it failed inside torch's per-rank ints)."""
    from shardwise.testing import simulated_world

    (x, _), model = _data(1, 8)[0], _model()
    y = model.network(x).argmax(-1).detach()
    y[4:] = 1 - y[4:]  # (rank 0's rows all right, rank 1's all wrong)
    want = model.eval([(x, y)])
    assert want == {"accuracy": 0.5}
    assert sw.Model(model.network, metrics="accuracy").eval([(x, y)]) == want  # (one name)
    with simulated_world(2) as world:
        world.replicate(model.network)
        assert model.eval([(world.same(x), world.same(y))]) == want
        with pytest.raises(ValueError, match="each rank of this simulated world counted its own"):
            model.eval([(world.rows(x), world.rows(y))])


def test_eval_accuracy() -> None:
    torch.manual_seed(0)
    net = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        net.weight.copy_(torch.eye(2))
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0, 1, 1, 1])
    assert sw.Model(net, metrics={"accuracy"}).eval([(x, y)]) == {"accuracy": 0.75}
    # (labels of shape (N, 1), one-hot rows: 2.0 and 1.0 before, broadcast against the logits)
    assert sw.Model(net, metrics={"accuracy"}).eval([(x, y[:, None])]) == {"accuracy": 0.75}
    one_hot = nn.functional.one_hot(y, 2).float()
    assert sw.Model(net, metrics={"accuracy"}).eval([(x, one_hot)]) == {"accuracy": 0.75}
    with pytest.raises(ValueError, match=r"labels of shape \[4, 3\] for logits of shape"):
        sw.Model(net, metrics={"accuracy"}).eval([(x, torch.zeros(4, 3))])
    # (MNIST's labels are uint32, as MindSpore's: torch compares none with int64 predictions)
    assert sw.Model(net, metrics={"accuracy"}).eval([(x, y.to(torch.uint32))]) == {"accuracy": 0.75}


def test_eval_loss_is_the_mean_over_the_batches() -> None:
    """MindSpore's "loss" metric: the mean of `loss_fn`'s value over the batches (each counted
    once, whatever its rows), beside accuracy; without a loss_fn, a ValueError naming it."""
    torch.manual_seed(0)
    net = nn.Linear(3, 4)
    x, y = torch.randn(7, 3), torch.tensor([0, 1, 2, 3, 0, 1, 2])
    loss_fn = nn.CrossEntropyLoss()
    model = sw.Model(net, loss_fn, metrics={"accuracy", "loss"})
    got = model.eval([(x[:4], y[:4]), (x[4:], y[4:])])  # (4 rows, then 3)
    with torch.no_grad():
        first, second = loss_fn(net(x[:4]), y[:4]), loss_fn(net(x[4:]), y[4:])
        want = ((first + second) / 2).item()
    assert got["loss"] == pytest.approx(want, rel=1e-6)
    assert set(got) == {"accuracy", "loss"}
    with pytest.raises(ValueError, match="the 'loss' metric needs loss_fn="):
        sw.Model(net, metrics={"loss"})


@pytest.mark.parametrize("metric", ["accuracy", "loss"])
def test_eval_of_no_rows_is_refused(metric: str) -> None:
    """A dataset whose every row ``drop_remainder`` dropped: a ValueError naming it (the
    accuracy and the loss were 0.0, silently, as if measured)."""
    from shardwise.dataset import GeneratorDataset

    rows = [(torch.randn(3), torch.tensor(0)) for _ in range(5)]
    empty = GeneratorDataset(rows, ["x", "y"], shuffle=False).batch(8, drop_remainder=True)
    model = sw.Model(nn.Linear(3, 2), nn.CrossEntropyLoss(), metrics={metric})
    with pytest.raises(ValueError, match=r"metric counted no rows: .*drop_remainder=True"):
        model.eval(empty)


def test_eval_of_a_shard_with_padding_and_an_auxiliary_output() -> None:
    """A network returning ``(logits, aux)`` (a 0-d auxiliary loss) to a loss that takes both,
    on shard 1 of 2 whose last batch is one real row and one wrap-around padding row: the
    padding row is left out of the logits, the 0-d output kept (slicing it raised IndexError);
    the metrics equal the real rows'. A sequence-first output cannot be cut: a ValueError."""
    from shardwise.dataset import GeneratorDataset

    class WithAux(nn.Module):
        def __init__(self, seq_first: bool = False) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin, self.seq_first = nn.Linear(3, 2), seq_first

        def forward(self, x: torch.Tensor) -> Any:
            logits = self.lin(x)
            aux = self.lin.weight.square().mean()  # (a weight penalty: no rows in it)
            return (logits.unsqueeze(0) if self.seq_first else logits), aux

    def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
        logits = out[0][0] if out[0].dim() == 3 else out[0]
        loss: torch.Tensor = nn.functional.cross_entropy(logits, y) + out[1]
        return loss

    g = torch.Generator().manual_seed(3)
    rows = [(torch.randn(3, generator=g), torch.tensor(i % 2)) for i in range(5)]
    shard = GeneratorDataset(rows, ["x", "y"], shuffle=False, num_shards=2, shard_id=0)
    shard = shard.batch(2)  # (rows 0, 1, then row 4 and a wrap-around padding row)
    assert shard.get_padding() == 1
    net = WithAux()
    got = sw.Model(net, loss_fn, metrics={"loss"}).eval(shard)
    x, y = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    with torch.no_grad():
        want = (loss_fn(net(x[:2]), y[:2]) + loss_fn(net(x[4:]), y[4:])).item() / 2
    assert got["loss"] == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError, match="no tensor of the network's output has a row per label"):
        sw.Model(WithAux(seq_first=True), loss_fn, metrics={"loss"}).eval(shard)


def test_steps_in_an_epoch_count_from_its_start() -> None:
    """Steps within an epoch were derived from the run's step count and the epoch length: a
    later train() of another length, one after an early stop, and a dataset without len()
    (every step of its first epoch was step 1: checkpoint files overwrote each other) were
    numbered wrong."""

    class StopAt(sw.train.Callback):
        def on_train_step_end(self, ctx: sw.train.RunContext) -> None:
            if ctx.cur_step_num == 2:
                ctx.request_stop()

    model, losses = _model(), Losses()
    model.train(1, _data(3), callbacks=[losses, StopAt()])  # (stops after step 2)
    model.train(1, _data(3), callbacks=[losses])
    model.train(1, _data(2), callbacks=[losses])

    class NoLen:
        def __iter__(self) -> Any:
            return iter(_data(3))

    model.train(2, NoLen(), callbacks=[losses])
    steps = [s for _, s, _ in losses.seen]
    assert steps == [1, 2, 1, 2, 3, 1, 2, 1, 2, 3, 1, 2, 3]


@pytest.mark.parametrize(
    ("call", "exc", "message"),
    [
        (lambda: sw.Model(nn.Linear(1, 1)).train(1, []), ValueError, "pass optimizer="),
        (lambda: _model().train(0, []), ValueError, "epoch=0 must be an int >= 1"),
        (lambda: _model().train(2, [], initial_epoch=2), ValueError, "initial_epoch=2"),
        (lambda: sw.Model(nn.Linear(1, 1)).eval([]), ValueError, "pass metrics="),
        (lambda: sw.Model("net"), TypeError, "network must be a torch.nn.Module"),  # type: ignore[arg-type]
        (lambda: sw.Model(nn.Linear(1, 1), metrics={"f1"}), ValueError, "unknown metrics"),
        # (found by a helper review: internal errors from deep in train() before)
        (
            lambda: _model().train(1, _data(1), callbacks=[sw.train.LossMonitor]),
            TypeError,
            r"holds the class LossMonitor; pass an instance, LossMonitor\(\)",
        ),
        (
            lambda: _model().train(1, _data(1), callbacks="LossMonitor"),
            TypeError,
            "must be a Callback or a list of them",
        ),
        (lambda: _model().train(1, _data(1), callbacks=[1]), TypeError, "holds 1, not a Callback"),
        (
            lambda: _model().train(1, [torch.randn(4, 3)]),
            TypeError,
            r"each batch must be a tuple \(\*inputs, label\) .* a tensor of shape \[4, 3\]",
        ),
        (lambda: _model().train(2, [], initial_epoch=True), ValueError, "initial_epoch=True"),
        (lambda: _model().eval(_rows()), ValueError, r"single rows .* dataset.batch\(32\)"),
        (lambda: _aux_model().eval(_data(1)), TypeError, "got a tuple of 2 outputs; .* eval mode"),
        (lambda: sw.train.TimeMonitor("x"), TypeError, "data_size='x' must be an int"),  # type: ignore[arg-type]
        (lambda: sw.train.ModelCheckpoint(prefix=3), TypeError, "prefix=3 must be a"),  # type: ignore[arg-type]
    ],
)
def test_model_errors(call, exc: type[Exception], message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(exc, match=message):
        call()
