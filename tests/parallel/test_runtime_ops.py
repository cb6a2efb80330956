"""`AutoParallel` on small networks that exercise each runtime path, on 8 simulated ranks.

Each network's output (every rank's rows, data parallel) and every parameter block's gradient
are compared with the single-device run. The loss is ``sum(out * W)`` over the global output for
a fixed random W: each rank sums its rows, then an AllReduce makes it one replicated value.

Paths: a MatMul whose `out_strategy` asks for a ReduceScatter (also over Layout axes given
inner first, a group not in rank order); Reshape (the local target shape);
a broadcast bias parameter replicated over some axes (gradient AllReduce over them); ReduceMean
over a split dim (AllReduce(mean)) and a 1-D output. Plus the runtime's errors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.parallel import AutoParallel
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

WORLD = 8


def _param(*shape: int, seed: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)))


class ReduceScatterNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = _param(32, 16, seed=1)
        self.mm = sw.ops.MatMul().shard(((2, 4), (4, 1)), out_strategy=((8, 1),))
        self.relu = sw.ops.ReLU().shard(((8, 1),))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.relu(self.mm(x, self.w))
        return out


class ReshapeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = _param(6, 4, seed=2)
        self.reshape = sw.ops.Reshape()
        self.mm = sw.ops.MatMul().shard(((4, 1), (1, 2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mm(self.reshape(x, (64, 6)), self.w)
        return out


class BiasNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = _param(32, 16, seed=3)
        self.b = _param(16, seed=4)
        self.mm = sw.ops.MatMul().shard(((2, 1), (1, 4)))
        self.add = sw.ops.Add().shard(((2, 4), (4,)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.add(self.mm(x, self.w), self.b)
        return out


class MeanNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = _param(32, 16, seed=5)
        self.mm = sw.ops.MatMul().shard(((2, 1), (1, 4)))
        self.mean = sw.ops.ReduceMean().shard(((2, 4),))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mean(self.mm(x, self.w), 1)
        return out


CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], dict[str, int]]] = {
    # name: (network, global input shape, forward collectives by kind)
    "reduce_scatter": (ReduceScatterNet, (16, 32), {"AlltoAll": 1, "ReduceScatter": 1}),
    "reshape": (ReshapeNet, (16, 4, 6), {"AllGather": 1, "AlltoAll": 1}),
    "bias": (BiasNet, (16, 32), {"AllGather": 1, "AlltoAll": 1}),
    "mean": (MeanNet, (16, 32), {"AllGather": 1, "AllReduce": 1}),
}


def _single(net: nn.Module, x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    out = net(x)
    (out * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    return {"out": out.detach(), **grads}


@pytest.mark.parametrize("case", list(CASES))
def test_output_and_gradient_blocks(case: str) -> None:
    make, shape, forward = CASES[case]
    net = make()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    upstream = torch.randn(make()(x).shape, generator=g)
    want = _single(make(), x, upstream)
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = AutoParallel(net)
        x_local = world.rows(x)
        out_rows = want["out"].shape[0] // WORLD
        w_local = world.rank_map(lambda r: upstream[r * out_rows : (r + 1) * out_rows].clone())
        with CommRecorder() as rec:
            out = parallel(x_local)
            sw.ops.AllReduce()((out * w_local).sum()).backward()
        kinds = Counter(r.kind for r in rec.select(phase="forward"))
        kinds -= Counter({"AllReduce": 1})  # the loss
        full = want["out"]
        assert_matches_single_device(
            out, lambda r: full[r * out_rows : (r + 1) * out_rows], what="output"
        )
        assert parallel.parallel_plan is not None
        for name, p in net.named_parameters():
            layout, pshape = parallel.parallel_plan.param_layouts()[name]
            grad = want[name]
            assert p.grad is not None
            assert_matches_single_device(
                p.grad, lambda r, g=grad, lay=layout, s=pshape: g[lay.local_slice(r, s)], what=name
            )
        assert kinds == Counter(forward), rec.summary()


class TorchOpNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = _param(32, 16, seed=6)
        self.mm = sw.ops.MatMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mm(torch.cumsum(x, 1), self.w)  # not in OP_KINDS
        return out


def test_unannotated_torch_op_before_a_primitive_is_planned() -> None:
    """``torch.cumsum`` (outside the primitive runtime's allow-list, which refused it) runs as
    the plan says, on each rank's rows: the output equals one device's."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, 32, generator=g)
    ref = TorchOpNet()
    want = ref(x).detach()
    net = TorchOpNet()
    rows = 16 // WORLD
    with simulated_world(WORLD) as world:
        got = AutoParallel(world.replicate(net))(world.rows(x))
        assert_matches_single_device(got, lambda r: want[r * rows : (r + 1) * rows])


def test_only_semi_auto() -> None:
    with pytest.raises(ValueError, match="valid: 'semi_auto'"):
        AutoParallel(ReduceScatterNet(), parallel_mode="auto")


LAYOUT = sw.Layout((2, 2, 2), ("dp", "sp", "mp"))


class InnerFirstNet(nn.Module):
    """A MatMul whose summed dim is split over ``("mp", "dp")`` (inner axis first) and whose
    out_strategy scatters the sum onto output dim 0 over ``("sp", "mp", "dp")``: the
    ReduceScatter's group, ordered by those coordinates, is not in rank order."""

    def __init__(self) -> None:
        super().__init__()
        self.w = _param(16, 12, seed=8)
        self.mm = sw.ops.MatMul().shard(
            (LAYOUT("sp", ("mp", "dp")), LAYOUT(("mp", "dp"), "None")),
            out_strategy=(LAYOUT(("sp", "mp", "dp"), "None"),),
        )
        self.relu = sw.ops.ReLU().shard((LAYOUT(("sp", "mp", "dp"), "None"),))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.relu(self.mm(x, self.w))
        return out


def test_reduce_scatter_over_axes_inner_first() -> None:
    """Each rank gets its own block of the scattered sum (the chunk its coordinates along the
    axes name, not its place in rank order): the output and the weight's gradient equal one
    device's, with the one ReduceScatter forward (it raised "group order differs from rank
    order" before)."""
    g = torch.Generator().manual_seed(9)
    x, up = torch.randn(16, 16, generator=g), torch.randn(16, 12, generator=g)
    one = InnerFirstNet()
    want = one(x)
    (want * up).sum().backward()
    net = InnerFirstNet()
    with simulated_world(WORLD) as world:
        world.replicate(net)

        def step(x: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            out = net(x)
            (out * up).sum().backward()
            return out

        parallel = AutoParallel(step).dataset_strategy("full_batch")
        with CommRecorder() as rec:
            out = parallel(world.same(x), world.same(up))
        assert_matches_single_device(out, want.detach(), what="output")
        assert parallel.parallel_plan is not None
        layout, shape = parallel.parallel_plan.param_layouts()["w"]
        grad = one.w.grad
        assert grad is not None and net.w.grad is not None
        assert_matches_single_device(
            net.w.grad, lambda r: grad[layout.local_slice(r, shape)], what="w"
        )
        scatters = [r for r in rec.select(phase="forward") if r.kind == "ReduceScatter"]
        assert [r.group for r in scatters] == [(0, 1, 4, 5)], rec.summary()  # (over mp, dp)
