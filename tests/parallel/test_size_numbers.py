"""Numbers computed from a local size and given to an op: the global one, as on one device.

On a rank, ``x.size(0)`` is this rank's rows. A loss normalised by it inside an op
(``((out - y) ** 2 / x.size(0)).sum()``, ``torch.tensor(float(n))``, a covariance over
``z.shape[0] - 1``) was this rank's share of one device's loss times N (2x on 2 ranks,
silently: the parallel loss and gradients were twice the single-device ones). Each such
number is now the captured one (`parallel/_sizes.py`), while numbers that change from call to
call (a loss weight) stay each call's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.parallel import UnsupportedParallelError
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..zoo import assert_grad_blocks_match, one_step_matches

pytestmark = pytest.mark.usefixtures("one_thread")

Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

LOSSES: dict[str, Loss] = {
    "rows / int": lambda o, y, x: ((o - y) ** 2 / x.size(0)).sum(),
    "rows * float": lambda o, y, x: ((o - y) ** 2 * (1.0 / x.size(0))).sum(),
    "rows / tensor(int)": lambda o, y, x: ((o - y) ** 2 / torch.tensor(x.size(0))).sum(),
    "sum / tensor(float)": lambda o, y, x: ((o - y) ** 2).sum() / torch.tensor(float(len(x))),
    "sum / full": lambda o, y, x: ((o - y) ** 2).sum() / torch.full((), float(x.shape[0])),
    "sum / sqrt": lambda o, y, x: ((o - y) ** 2).sum() / math.sqrt(x.shape[0]),
    "rows / (n - 1)": lambda o, y, x: ((o - o.mean(0)) ** 2 / (o.shape[0] - 1)).sum(),
    "rows * new_full": lambda o, y, x: ((o - y) ** 2 * o.new_full(o.shape, 1.0 / len(o))).sum(),
}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("form", list(LOSSES))
def test_a_size_derived_number_is_the_global_one(form: str, ranks: int) -> None:
    loss_of = LOSSES[form]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    single = _net()
    want = loss_of(single(x), y, x)
    want.backward()
    net = _net()
    with simulated_world(ranks) as world:
        world.replicate(net)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = loss_of(net(a), b, a)
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        for call in range(2):  # (the second call: the noted numbers, short paths elsewhere)
            for p in net.parameters():
                p.grad = None
            with CommRecorder() as rec:
                loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want.detach(), what=f"{form} loss, call {call}")
            for (name, p), q in zip(net.named_parameters(), single.parameters(), strict=True):
                assert_matches_single_device(p.grad, q.grad, what=f"{form} {name}.grad")
            everyone = tuple(range(ranks))  # (the loss forward, one gradient bucket; the mean)
            n = 2 if "n - 1" in form else 1
            assert rec.kinds() == Counter(
                {("AllReduce", "forward", everyone): n, ("AllReduce", "backward", everyone): n}
            ), rec.summary()


def test_a_per_call_loss_weight_stays_each_calls() -> None:
    """A float given with the split rows that changes from call to call is data: each call's
    (the first call's equals the captured one)."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    single, net = _net(), _net()

    def step_of(model: nn.Module) -> Any:
        def step(a: torch.Tensor, b: torch.Tensor, w: float) -> torch.Tensor:
            loss = ((model(a) - b) ** 2 * w).mean()
            loss.backward()
            return loss

        return step

    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(step_of(net), parallel_mode="semi_auto")
        for w in (1.0, 2.0, 0.5, 2.0):
            want = step_of(single)(x, y, w)
            got = parallel(world.rows(x), world.rows(y), w)
            assert_matches_single_device(got, want.detach(), what=f"loss with weight {w}")


class Projector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(12, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.b(torch.relu(self.a(x))), dim=-1)


def _covariance_loss(z: torch.Tensor) -> torch.Tensor:
    """VICReg's covariance term: over ``z.shape[0] - 1`` (7 on one device, 3 on a rank)."""
    zc = z - z.mean(0)
    return (zc.T @ zc / (z.shape[0] - 1)).pow(2).sum()


def test_covariance_over_rows_minus_one_with_megatron_layers() -> None:
    """A column- then row-parallel projector at dp 2 x mp 2: the division by ``n - 1`` takes
    the row-parallel output's partial sums (it was (7 / 3) ** 2 times one device's loss)."""
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(1))
    single = Projector()
    want = _covariance_loss(single(x))
    want.backward()
    net = Projector()
    sw.shard(net.a, in_strategy=((2, 1), (2, 1)))
    sw.shard(net.b, in_strategy=((2, 2), (1, 2)))
    with simulated_world(4) as world:
        world.replicate(net)

        def step(a: torch.Tensor) -> torch.Tensor:
            loss = _covariance_loss(net(a))
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        loss = parallel(world.rows(x))
        assert_matches_single_device(loss, want.detach(), what="covariance loss")
        assert_grad_blocks_match(parallel, net, single)


class HalfFeatures(nn.Module):
    """A slice whose bound is computed from a split dim's local size: ``h[:, : n // 2]`` with
    ``n = h.shape[-1]`` (this rank's features under a column-parallel layer)."""

    def __init__(self, scatter: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scatter = scatter
        self.lin = sw.shard(nn.Linear(16, 16), in_strategy=((1, 1), (2, 1)))
        g = torch.Generator().manual_seed(2)
        self.register_buffer("idx", torch.argsort(torch.rand(16, 16, generator=g), 1)[:, :8])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        n = h.shape[-1]
        if self.scatter:
            return (h.scatter(1, self.idx, h[:, : n // 2] * 3) ** 2).mean()
        return (h[:, : n // 2] ** 2).mean()


@pytest.mark.parametrize("scatter", [False, True], ids=["slice", "scatter"])
def test_a_slice_bound_from_a_local_size_is_the_global_one(scatter: bool) -> None:
    """The slice kept this rank's bound (4 of 8 local features, where one device takes 8 of
    16): a wrong loss, silently (with a scatter: a shape error from inside torch)."""
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
    want = HalfFeatures(scatter)(x)
    net = HalfFeatures(scatter)
    with simulated_world(2) as world:
        world.replicate(net)
        got = sw.AutoParallel(net)(world.rows(x))
        assert_matches_single_device(got, want.detach(), what="loss")


class _SplitFeatures(nn.Module):
    """Column-parallel features cut in parts whose sizes come from the local width: ``[3,
    n - 3]`` and ``n // 4`` (3 and 1, or 4 parts of 1, on each of 4 ranks; 13 and 4 on one
    device), the parts joined back in another order."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        torch.manual_seed(0)
        self.l1, self.head = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        n = h.shape[-1]
        if self.form == "sizes":
            a, b = h.split([3, n - 3], dim=-1)
            z = torch.cat([b, a], -1)
        else:
            z = torch.cat(h.split(n // 4, -1)[::-1], -1)
        return F.cross_entropy(self.head(z), y)


@pytest.mark.parametrize("form", ["sizes", "size"])
def test_split_sizes_from_a_local_size_are_the_global_ones(form: str) -> None:
    """The split took this rank's sizes ([3, 1] of a whole 16-wide row once the rows were
    split for it): a shape error from inside torch ([3, n - 3]), or the wrong parts."""
    single, net = _SplitFeatures(form), _SplitFeatures(form)
    sw.shard(net.l1, in_strategy=((1, 1), (4, 1)))  # (column parallel over 4)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(2))
    one_step_matches(4, net, single, x, y)


def test_a_python_loop_over_a_local_shape_names_the_cause_and_the_fix() -> None:
    """A loop over the rows (``range(o.shape[0])``) runs 4 times on a rank (its rows) where the
    plan, captured on the global 8, has 8: the call was refused with "its ops depend on
    something capture does not see". The error now names the value read as a block, its global
    and local shapes, the likely cause and the fixes (``sw.reshard`` to whole, tensor ops);
    with the reshard the loop trains as on one device."""

    def loss_of(o: torch.Tensor, whole: bool) -> torch.Tensor:
        o = sw.reshard(o, (1, 1)) if whole else o
        return sum((o[i].pow(2).sum() * (i + 1) for i in range(o.shape[0])), torch.zeros(()))

    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=g)
    want = loss_of(_net()(x), False)
    for whole in (False, True):
        net = _net()
        with simulated_world(2) as world:
            world.replicate(net)

            def step(a: torch.Tensor) -> torch.Tensor:
                loss = loss_of(net(a), whole)  # noqa: B023
                loss.backward()
                return loss

            parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
            if whole:
                assert_matches_single_device(parallel(world.rows(x)), want.detach(), what="loss")
                continue
            with pytest.raises(UnsupportedParallelError) as caught:
                parallel(world.rows(x))
        said = str(caught.value)
        assert "reads %2 (2/linear, global shape [8, 2]), which the plan holds as this " in said
        assert "rank's block [4, 2]" in said, said
        assert "a Python loop or branch on it (for i in range(t.shape[0])" in said, said
        assert "t = sw.reshard(t, (1, 1))" in said and "tensor ops" in said, said


class _Positions(nn.Module):
    """Adds a position embedding, expanded to the batch only when the batch is not one row
    (the branch of Hugging Face's ``masking_utils`` on ``position_ids.shape[0]``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pe, self.lin = nn.Embedding(8, 6), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        if x.shape[0] != pos.shape[0]:
            pos = pos.expand(x.shape[0], -1)
        return self.lin(x + self.pe(pos))


@pytest.mark.parametrize("rows", [2, 4])
def test_a_branch_on_the_batch_size_read_earlier_names_the_size_and_the_fixes(rows: int) -> None:
    """With one row per rank the branch compares 1 with 1 on each rank, where the capture
    compared the global 2 with 1: the call ran other ops than planned and was refused with
    "its ops depend on something capture does not see", the next op reading a whole tensor.
    The error now names the input whose shape the code read, the line, the global and local
    sizes of the split dim and the fixes; with 2 rows per rank it runs as one device."""
    x = torch.randn(rows, 3, 6, generator=torch.Generator().manual_seed(1))
    want = _Positions()(x).detach()
    net = _Positions()
    with torch.no_grad(), simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net)
        if rows == 4:
            assert_matches_single_device(parallel(world.rows(x)), world.rows(want), what="out")
            return
        with pytest.raises(UnsupportedParallelError) as caught:
            parallel(world.rows(x))
    said = str(caught.value)
    line = _Positions.forward.__code__.co_firstlineno + 2  # (the ``if``)
    assert "before %2 expand the network's Python code read the shape of input args[0] " in said
    assert f"at test_size_numbers.py:{line} " in said, said
    assert "(global shape [2, 3, 6], this rank's block [1, 3, 6]: dim 0: 2 in the capture, " in said
    assert "1 here)" in said and "a Python branch on such a size" in said, said
    assert "at least 2 rows" in said and "pass position_ids with the batch's rows" in said, said


@pytest.mark.parametrize("form", ["local slices", "chunk", "split"])
def test_micro_batches_sliced_by_a_local_size_name_chunk_and_split(form: str) -> None:
    """Gradient accumulation by slicing with a local size (``h = a.shape[0] // 2``; ``a[:h]``,
    then ``a[h:]``) was refused saying "compute them from global sizes", which, followed
    literally (``a[:8]``), takes the first ranks' rows rather than a part of each rank's. The
    error now says to split the whole batch with ``x.chunk(k)`` or ``x.split(n)`` and cites the
    docs; both forms train as one device."""

    def part(a: torch.Tensor, i: int) -> torch.Tensor:
        if form == "local slices":  # (sliced in the loop: the second pass's bounds differ)
            h = a.shape[0] // 2
            return a[i * h : (i + 1) * h]
        return a.chunk(2)[i] if form == "chunk" else a.split(8)[i]

    def body(net: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(())
        for i in range(2):
            loss = F.cross_entropy(net(part(a, i)), part(b, i)) / 2
            loss.backward()
            total = total + loss.detach()
        return total

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)
    ref = _net()
    want = body(ref, x, y) if form != "local slices" else None
    net = _net()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return body(net, a, b)

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        if want is not None:
            assert_matches_single_device(parallel(world.rows(x), world.rows(y)), want)
            for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
                assert_matches_single_device(p.grad, q.grad, what=f"{name}.grad")
            return
        with pytest.raises(UnsupportedParallelError) as caught:
            parallel(world.rows(x), world.rows(y))
    said = str(caught.value)
    assert "got [slice(4, 8, None)] in this pass and [slice(0, 4, None)]" in said, said
    assert "split the whole batch with x.chunk(k) or x.split(n)" in said, said
    assert "docs/parallel.md, 'Gradient accumulation inside a step'" in said, said
