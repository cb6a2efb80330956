"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) under semi_auto's data parallel.

Their CPU aten program folds time and batch into one dim, so followed op by op they could only
run whole; worse, the initial state ``torch.zeros(layers, x.size(0), hidden)`` was made whole
(the global batch) and the module's own check against this rank's batch failed ("Expected
hidden size (1, 4, 5), got [1, 8, 5]"). Now a rule for the whole op (`ops.torch_rules`) splits
the batch, and a zeros every consumer reads split is made as this rank's block
(`planner._local_factories.split_fills`): each rank runs its own rows, with exactly the data
parallel collectives (the loss's AllReduce, one gradient bucket), and the losses, gradients and
updated parameters equal one device's.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

VOCAB, EMBED, HIDDEN, BATCH, SEQ = 32, 8, 12, 8, 6


class LanguageModel(nn.Module):
    """Embedding -> recurrent layer (`kind`) -> Linear over the vocabulary."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, EMBED)
        if kind == "lstm":
            self.rnn: nn.RNNBase = nn.LSTM(EMBED, HIDDEN, batch_first=True, bidirectional=True)
        elif kind == "gru":
            self.rnn = nn.GRU(EMBED, HIDDEN, batch_first=True)
        else:
            self.rnn = nn.RNN(EMBED, HIDDEN, num_layers=2, batch_first=True, nonlinearity="relu")
        width = HIDDEN * (2 if kind == "lstm" else 1)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(ids))
        return F.cross_entropy(self.head(out).flatten(0, 1), targets.flatten())


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        )
        for _ in range(steps)
    ]


@pytest.mark.parametrize(
    ("kind", "world_size"), [("lstm", 2), ("gru", 2), ("gru", 4), ("rnn", 2), ("rnn", 4)]
)
def test_recurrent_language_model_matches_one_device(kind: str, world_size: int) -> None:
    data = batches(2)
    ref = LanguageModel(kind)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = []
    for ids, targets in data:
        loss = ref(ids, targets)
        loss.backward()
        want.append((loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters()}))
        ref_opt.step()
        ref_opt.zero_grad()
    net = LanguageModel(kind)
    with simulated_world(world_size) as world:
        world.replicate(net)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        seen: list[dict[str, torch.Tensor]] = []

        def step(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = net(ids, targets)
            loss.backward()
            seen.append({n: p.grad.detach().clone() for n, p in net.named_parameters()})
            opt.step()
            opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step)
        with CommRecorder() as rec:
            for s, (ids, targets) in enumerate(data):
                loss = parallel(world.rows(ids), world.rows(targets))
                assert_matches_single_device(loss, want[s][0], what=f"loss {s}")
                assert_matches_single_device(seen[s], want[s][1], what=f"grads {s}")
        ranks = tuple(range(world_size))
        assert rec.kinds() == Counter(
            {("AllReduce", "forward", ranks): 2, ("AllReduce", "backward", ranks): 2}
        ), rec.summary()
        plan = parallel.parallel_plan
        assert plan is not None
        ops = ("torch.lstm", "torch.gru", "torch.rnn")
        rnn = next(n for n in plan.nodes if n.op.startswith(ops))
        assert rnn.rule == "shardwise" and str(rnn.inputs[0]) == "(g0, None, None)"
        zeros = [n for n in plan.nodes if n.op == "torch.zeros"]
        assert zeros and all(str(n.outputs[0]) == "(None, g0, None)" for n in zeros), plan


def test_a_zeros_read_whole_somewhere_stays_whole() -> None:
    """A fill read split by one op and whole by another is made whole (its block cut for the
    first); one read split everywhere is made as this rank's block, no edge."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            split = torch.zeros(x.size(0), 4)  # (read split only)
            mixed = torch.ones(x.size(0), 4)
            both = self.fc(x + split + 1.0) * mixed
            return both.sum() + mixed.sum()  # (mixed.sum(): its whole sum)

    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 4, generator=g)
    ref = Net()
    want = ref(x)
    want.backward()
    net = Net()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(a: torch.Tensor) -> torch.Tensor:
            loss = net(a)
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step)
        assert_matches_single_device(parallel(world.rows(x)), want.detach(), what="loss")
        assert_matches_single_device(
            {n: p.grad for n, p in net.named_parameters()},
            {n: p.grad for n, p in ref.named_parameters()},
        )
        plan = parallel.parallel_plan
        assert plan is not None
        zeros = plan.node("zeros")
        ones = plan.node("ones")
        assert str(zeros.outputs[0]) == "(g0, None)" and str(ones.outputs[0]) == "(None, None)"
        assert not [e for e in plan.edges if e.value == f"%{zeros.index}"]


def test_dropout_between_layers_while_training_is_refused() -> None:
    """``nn.GRU(num_layers=2, dropout=0.5)`` in training draws its masks inside the op: on a
    split batch a `PlanError` names the op and the fix (it failed with DTensor's "Attempted to
    unbind along the sharded dimension 0"); in ``eval()`` it runs split."""
    from shardwise.planner import PlanError

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.rnn = nn.GRU(4, 6, num_layers=2, dropout=0.5, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.rnn(x)[0].pow(2).mean()

    x = torch.randn(8, 5, 4, generator=torch.Generator().manual_seed(3))
    net = Net()
    want = Net().eval()(x)
    with simulated_world(2) as world:
        world.replicate(net)
        with pytest.raises(PlanError, match=r"torch.gru at .*dropout=0.5 .*nn.Dropout"):
            sw.AutoParallel(net)(world.rows(x))
        net.eval()
        assert_matches_single_device(sw.AutoParallel(net)(world.rows(x)), want.detach())


class AfterColumnParallel(nn.Module):
    """A column-parallel Linear (dp 2 x mp 2) feeding a recurrent layer (`kind`); `reshard`:
    the features made whole before it, as the error's fix says."""

    def __init__(self, kind: str, reshard: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.reshard = nn.Linear(5, 8), reshard
        self.rnn, self.head = getattr(nn, kind)(8, 6, batch_first=True), nn.Linear(6, 3)
        sw.shard(self.inp, in_strategy=((2, 1), (2, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.reshard:
            h = sw.reshard(h, (2, 1, 1))
        out: torch.Tensor = self.head(self.rnn(h)[0][:, -1])
        return out


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
def test_input_split_on_features_names_the_fix(kind: str) -> None:
    """After a column-parallel layer the recurrent module checked its input's feature size on
    this rank's block and failed with torch's own "input.size(-1) must be equal to
    input_size. Expected 8, got 4"; now a `PlanError` names the fix, and with the features
    made whole (``sw.reshard``) the loss equals one device's."""
    from shardwise.planner import PlanError

    x = torch.randn(8, 5, 5, generator=torch.Generator().manual_seed(3))
    want = AfterColumnParallel(kind, False)(x).detach()
    for reshard in (False, True):
        net = AfterColumnParallel(kind, reshard)
        with simulated_world(4) as world:
            world.replicate(net)
            parallel = sw.AutoParallel(net)
            if not reshard:
                with pytest.raises(PlanError, match=r"split on its features.*sw.reshard"):
                    parallel(world.rows(x))
                continue
            assert_matches_single_device(parallel(world.rows(x)).detach(), world.rows(want))


class ComputedState(nn.Module):
    """A recurrent layer whose initial state the step computes: a shifted zeros (GRU) or a
    learnable state expanded to the batch (LSTM)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        if kind == "gru":
            self.rnn: nn.RNNBase = nn.GRU(4, 6, batch_first=True)
        else:
            self.rnn = nn.LSTM(4, 6, batch_first=True)
        self.h0 = nn.Parameter(torch.randn(1, 1, 6))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.kind == "gru":
            state: object = torch.zeros(1, x.shape[0], 6) + 0.5
        else:
            h0 = self.h0.expand(-1, x.shape[0], -1)
            state = (h0, torch.tanh(h0))
        out, _ = self.rnn(x, state)
        return F.cross_entropy(self.head(out[:, -1]), y) + 0.0 * self.h0.sum()


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_a_computed_initial_state_matches_one_device(kind: str) -> None:
    """An initial state computed in the step is whole while the module runs on this rank's
    rows: nn.GRU's own check refused it with torch's "Expected hidden size (1, 4, 6), got
    [1, 8, 6]". The op's node cuts its block; the loss and every gradient (the learnable
    state's included) equal one device's."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 5, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    ref = ComputedState(kind)
    want = ref(x, y)
    want.backward()
    net = ComputedState(kind)
    with simulated_world(2) as world:
        world.replicate(net)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = net(a, b)
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step)
        assert_matches_single_device(parallel(world.rows(x), world.rows(y)), want.detach())
        assert_matches_single_device(
            {n: p.grad for n, p in net.named_parameters()},
            {n: p.grad for n, p in ref.named_parameters()},
            what="grads",
        )
