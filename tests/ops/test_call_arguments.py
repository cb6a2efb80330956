"""A primitive's call arguments are checked where it runs, on one device as under a plan, with
errors naming the op (an out-of-range ReduceSum axis reduced another dim, silently); negative
Transpose entries count from the end as MindSpore's do; an op after a view whose rule splits a
dim into parts its size does not divide runs another way (a helper review found these)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

X = torch.arange(6.0).reshape(2, 3)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: sw.ops.ReduceSum()(X, 2), r"ReduceSum: axis=2 is not an int in \[-2, 2\)"),
        (lambda: sw.ops.ReduceMax()(X, -3), r"ReduceMax: axis=-3 is not an int"),
        (lambda: sw.ops.ReduceMean()(X, 1.0), r"ReduceMean: axis=1.0 is not an int"),
        (lambda: sw.ops.ReduceSum()(X, (0, -2)), r"ReduceSum: axis=\(0, -2\) repeats a dim"),
        (lambda: sw.ops.Softmax(axis=(1, -1))(X), r"Softmax: axis=\(1, -1\) repeats a dim"),
        (lambda: sw.ops.Transpose()(X, (0, 0)), r"Transpose: perm \(0, 0\) is not a permutation"),
        (
            lambda: sw.ops.LayerNorm(begin_norm_axis=2)(X, torch.ones(3), torch.zeros(3)),
            r"LayerNorm: begin_norm_axis=2 is not an int in \[-2, 2\)",
        ),
    ],
)
def test_bad_call_arguments_name_the_op(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_valid_axes_reduce_as_torch() -> None:
    assert torch.equal(sw.ops.ReduceSum()(X, -1), X.sum(-1))
    assert torch.equal(sw.ops.ReduceMax()(X, [0]), X.amax(0))
    assert torch.equal(sw.ops.ReduceSum()(X, ()), X.sum())
    assert torch.equal(sw.ops.Transpose()(X, (-1, -2)), X.T)
    # a 0-dim tensor takes -1 and 0 as torch does; numpy ints and a range as perm
    scalar = torch.tensor(3.0)
    assert torch.equal(sw.ops.ReduceSum()(scalar, -1), scalar)
    assert torch.equal(sw.ops.Softmax(axis=0)(scalar), torch.tensor(1.0))
    assert torch.equal(sw.ops.ReduceSum()(X, np.int64(1)), X.sum(1))
    assert torch.equal(sw.ops.Transpose()(X, range(1, -1, -1)), X.T)


class _Net(nn.Module):
    """A primitive after ``x.reshape(4, 4, 32)`` of a batch of 16 rows."""

    def __init__(self, op: nn.Module, call: Callable[[nn.Module, torch.Tensor], torch.Tensor]):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, 1))
        self.op, self.call = op, call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(self.op, x.reshape(4, 4, 32) * self.w)


@pytest.mark.parametrize(
    ("op", "call"),
    [
        # a negative perm under a plan (refused as "not a permutation" before)
        (sw.ops.Transpose().shard(((1, 4, 1),)), lambda op, h: op(h, (0, -1, -2))),
        # a strategy on 2 x 4 devices: the reshape's rule split 4 rows over all 8 (each mesh
        # dim alone divides 4), and the planner failed with a raw layout error naming no op
        (sw.ops.Softmax().shard(((1, 4, 1),)), lambda op, h: op(h)),
    ],
)
def test_a_primitive_after_a_view_matches_one_device(
    op: nn.Module, call: Callable[[nn.Module, torch.Tensor], torch.Tensor]
) -> None:
    _matches_one_device(op, call)


def test_numpy_integers_in_a_strategy_match_one_device() -> None:
    """NumPy integers in a strategy, as call arguments take them (refused: "expected a tuple
    of ints or a Layout call")."""
    op = sw.ops.Softmax().shard(((np.int64(1), np.int32(4), 1),))
    assert op.in_strategy == ((1, 4, 1),)
    _matches_one_device(op, lambda op, h: op(h))


def _matches_one_device(
    op: nn.Module, call: Callable[[nn.Module, torch.Tensor], torch.Tensor]
) -> None:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    net = _Net(op, call)
    want = net(x).square().mean()
    want.backward()
    assert net.w.grad is not None
    grad = net.w.grad.clone()
    net.w.grad = None
    with simulated_world(8) as world:
        world.replicate(net)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = net(x).square().mean()
            loss.backward()
            return loss

        loss = sw.AutoParallel(step, parallel_mode="semi_auto")(world.rows(x))
        assert_matches_single_device(loss, want.detach())
        assert_matches_single_device(net.w.grad, grad, what="w.grad")


class _Keywords(nn.Module):
    """Primitives called with keyword arguments, tensors included."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(32, 16))
        self.mm = sw.ops.MatMul().shard(((8, 1), (1, 1)))
        self.sum = sw.ops.ReduceSum(keep_dims=True).shard(((8, 1),))
        self.tr = sw.ops.Transpose()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.tr(self.sum(self.mm(x=x, w=self.w), axis=1), perm=(1, 0))
        return out


def test_keyword_arguments_are_planned_as_given() -> None:
    """A plan took ``axis=1`` given by name for its default (every dim), and ``perm`` and
    tensors given by name for missing."""
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    net = _Keywords()
    want = net(x)
    assert want.shape == (1, 16)
    with simulated_world(8) as world:
        world.replicate(net)
        got = sw.AutoParallel(net).dataset_strategy("full_batch")(world.same(x))
        assert_matches_single_device(got, want)
    with pytest.raises(TypeError, match=r"ReduceSum: unknown argument 'axes'; it takes"):
        sw.ops.ReduceSum()(x, axes=1)
    with pytest.raises(TypeError, match="'axis' given by position and by name"):
        sw.ops.ReduceSum()(x, 1, axis=1)


def test_sw_shard_on_a_primitive_is_its_shard() -> None:
    """``sw.shard(primitive, in_strategy)`` failed at plan time ("the network called
    shardwise.reshard where the plan has mm/MatMul")."""
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(4))
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(32, 16))
    mm = sw.ops.MatMul()
    assert sw.shard(mm, in_strategy=((2, 4), (4, 1))) is mm
    assert mm.in_strategy == sw.ops.MatMul().shard(((2, 4), (4, 1))).in_strategy
    net = nn.Module()
    net.w, net.mm = w, mm
    net.forward = lambda x: net.mm(x, net.w)  # type: ignore[method-assign]
    want = x @ w
    with simulated_world(8) as world:
        world.replicate(net)
        got = sw.AutoParallel(net).dataset_strategy("full_batch")(world.same(x))
        assert_matches_single_device(got, want.detach())
    with pytest.raises(ValueError, match="holds no parameters"):
        sw.shard(sw.ops.ReLU(), in_strategy=((8, 1),), parameter_plan={"w": (8, 1)})
