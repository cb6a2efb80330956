"""`sw.shard`, `sw.reshard` and parameter plans under `AutoParallel`, 8 simulated ranks.

Each network's output (every rank's rows), every parameter block and every gradient block
equal the single-device run; the collectives the user-set layouts add are asserted exactly.
Without `AutoParallel` the same networks compute the single-device result (`shard` / `reshard`
change nothing). Also: a parameter used by two primitives with different layouts, a failed plan
giving the network back, and the errors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.parallel import AutoParallel
from shardwise.parallel._runtime import replicated_layout
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

WORLD = 8
LAYOUT = sw.Layout((2, 4), ("dp", "mp"))


def _param(*shape: int, seed: int) -> nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(*shape, generator=g) * 0.2)  # activations of order 1


class ReshardNet(nn.Module):
    """MatMul (rows over 8) -> reshard to (dp, mp) -> ReLU ((2, 4)) -> MatMul."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = _param(32, 16, seed=1), _param(16, 8, seed=2)
        self.mm1 = sw.ops.MatMul().shard(((8, 1), (1, 1)))
        self.relu = sw.ops.ReLU().shard(((2, 4),))
        self.mm2 = sw.ops.MatMul().shard(((8, 1), (1, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = sw.reshard(self.mm1(x, self.w1), LAYOUT("dp", "mp"))
        out: torch.Tensor = self.mm2(self.relu(h), self.w2)
        return out


class Block(nn.Module):
    """A column-parallel then row-parallel MLP; its weights stored as the parameter plan says."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = _param(32, 16, seed=3), _param(16, 32, seed=4)
        self.mm1 = sw.ops.MatMul().shard(((2, 1), (1, 4)))
        self.relu = sw.ops.ReLU().shard(((2, 4),))
        self.mm2 = sw.ops.MatMul().shard(((2, 4), (4, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mm2(self.relu(self.mm1(x, self.w1)), self.w2)
        return out


class ShardedModuleNet(nn.Module):
    """`sw.shard` on a submodule: input (2, 1), output (8, 1), w1 stored split 8 ways by rows."""

    def __init__(self) -> None:
        super().__init__()
        self.block = sw.shard(
            Block(),
            in_strategy=((2, 1),),
            out_strategy=((8, 1),),
            parameter_plan={"w1": (8, 1)},
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.block(x)
        return out


class ShardedFunctionNet(nn.Module):
    """`sw.shard` on a function of two tensors, with a network-level parameter plan."""

    def __init__(self) -> None:
        super().__init__()
        self.w = _param(32, 16, seed=5)
        self.add = sw.ops.Add().shard(((2, 4), (2, 4)))
        self.mm = sw.ops.MatMul().shard(((2, 4), (4, 1)))
        self.fn = sw.shard(
            self._body,
            in_strategy=(LAYOUT("dp", "mp"), LAYOUT("dp", "mp")),
            out_strategy=(LAYOUT("dp", "None"),),
            parameter_plan={"w": LAYOUT("mp", "None")},
        )

    def _body(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mm(self.add(a, b), self.w)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fn(x, x * 2.0)
        return out


class TiedNet(nn.Module):
    """One weight used by two MatMuls with different layouts (stored as the first wants)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = _param(32, 32, seed=6)
        self.mm1 = sw.ops.MatMul().shard(((2, 4), (4, 1)))
        self.mm2 = sw.ops.MatMul().shard(((2, 1), (1, 4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mm2(self.mm1(x, self.w), self.w)
        return out


def run(
    make: Callable[[], nn.Module], shape: tuple[int, ...]
) -> tuple[CommRecorder, AutoParallel, nn.Module]:
    """Single-device vs 8 simulated ranks (loss = sum(out * U)); returns the recorder."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    single = make()
    out = single(x)
    upstream = torch.randn(out.shape, generator=g)
    (out * upstream).sum().backward()
    want = {n: (p.detach().clone(), p.grad.clone()) for n, p in single.named_parameters()}
    net, out_rows = make(), out.shape[0] // WORLD
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = AutoParallel(net)
        x_local = world.rows(x)
        u_local = world.rank_map(lambda r: upstream[r * out_rows : (r + 1) * out_rows].clone())
        with CommRecorder() as rec:
            got = parallel(x_local)
            sw.ops.AllReduce()((got * u_local).sum()).backward()
        full = out.detach()
        assert_matches_single_device(got, lambda r: full[r * out_rows : (r + 1) * out_rows])
        plan = parallel.parallel_plan
        assert plan is not None
        for name, p in net.named_parameters():
            value, grad = want[name]
            whole = replicated_layout(plan.matrix, value.dim()), tuple(value.shape)
            layout, pshape = plan.param_layouts().get(name, whole)  # unplanned: whole on every rank
            assert p.grad is not None
            for what, t, f in ((name, p.detach(), value), (f"{name}.grad", p.grad, grad)):
                assert_matches_single_device(
                    t,
                    lambda r, f=f, a=layout, s=pshape: f[a.local_slice(r, s)],
                    what=what,
                    atol=1e-6 * max(1.0, float(f.abs().max())),  # relative to the tensor's scale
                )
    return rec, parallel, net


W, MP, DP = (0, 1, 2, 3, 4, 5, 6, 7), (0, 1, 2, 3), (0, 4)  # groups holding rank 0
LOSS = Counter({("AllReduce", "forward", W): 1, ("AllReduce", "backward", W): 1})


def test_reshard_moves_activation() -> None:
    rec, _, _ = run(ReshardNet, (16, 32))
    assert rec.kinds() == LOSS + Counter(
        {
            # mm1 out: rows over all 8 -> (dp, mp) and back for mm2: one AlltoAll over mp each
            ("AlltoAll", "forward", MP): 2,
            ("AlltoAll", "backward", MP): 2,
            ("AllReduce", "backward", W): 1,  # w1, w2: replicated (2 AllReduces: 1 bucket now)
        }
    ), rec.summary()


def test_shard_module_with_parameter_plan() -> None:
    """w1 stored split 8 ways (ZeRO-3 style): gathered at use, its gradient reduce-scattered."""
    rec, parallel, _ = run(ShardedModuleNet, (16, 32))
    plan = parallel.parallel_plan
    assert plan is not None
    layout, shape = plan.param_layouts()["block.w1"]
    assert layout.local_shape(shape) == (4, 16)
    assert rec.kinds() == LOSS + Counter(
        {
            ("AllGather", "forward", MP): 1,  # x: rows over 8 -> in_strategy (2, 1)
            ("AllGather", "forward", DP): 1,  # w1: rows over 8 -> columns over mp (mm1)
            ("AlltoAll", "forward", MP): 1,
            ("AllReduce", "forward", MP): 1,  # mm2: row parallel
            ("AllReduce", "backward", MP): 1,
            ("AlltoAll", "backward", MP): 1,  # adjoints of w1's redistribution
            ("ReduceScatter", "backward", DP): 1,
            ("AllReduce", "backward", DP): 1,  # w2's gradient: replicated over dp
        }
    ), rec.summary()


def test_shard_function_with_layouts() -> None:
    rec, parallel, _ = run(ShardedFunctionNet, (16, 32))
    plan = parallel.parallel_plan
    assert plan is not None
    layout, shape = plan.param_layouts()["w"]
    assert layout.local_shape(shape) == (8, 16)  # stored as the plan says (= mm's wish)
    assert rec.kinds() == LOSS + Counter(
        {
            ("AlltoAll", "forward", MP): 2,  # both inputs to in_strategy (dp, mp)
            ("AllReduce", "forward", MP): 1,  # mm
            ("AllReduce", "backward", MP): 1,
            ("AllReduce", "backward", DP): 1,  # w's gradient
        }
    ), rec.summary()


def test_tied_parameter_two_layouts() -> None:
    rec, _, _ = run(TiedNet, (16, 32))
    assert rec.kinds() == LOSS + Counter(
        {
            ("AlltoAll", "forward", MP): 3,  # x to mm1; w rows -> columns for mm2; the output
            ("AllReduce", "forward", MP): 1,  # mm1
            ("AlltoAll", "backward", MP): 2,
            ("AllReduce", "backward", MP): 1,
            ("AllReduce", "backward", DP): 1,  # w's gradient (both uses summed)
        }
    ), rec.summary()


class FullyShardedMLP(nn.Module):
    """Plain torch layers whose weights a parameter plan stores split 8 ways (ZeRO-3 style)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.mlp = sw.shard(
            nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)),
            in_strategy=None,
            parameter_plan={"0.weight": (8, 1), "2.weight": (8, 1)},
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(x)
        return out


def test_parameter_plan_for_torch_layers() -> None:
    rec, _, net = run(FullyShardedMLP, (16, 32))
    assert tuple(net.mlp[0].weight.shape) == (8, 32)  # a block of 1/8 of the rows at rest
    # The plan (DTensor's rules for F.linear, from the weights' stored rows) runs both layers
    # column parallel on the stored blocks and moves the small activations instead of the
    # weights: 5,376 bytes a rank gathered forward where gathering both weights took 14,336.
    assert rec.kinds() == LOSS + Counter(
        {
            ("AllGather", "forward", W): 2,  # x whole for layer 0; its output for layer 2
            ("AlltoAll", "forward", W): 1,  # the output's columns -> this rank's rows
            ("AlltoAll", "backward", W): 1,  # (their adjoints)
            ("ReduceScatter", "backward", W): 1,
            # the biases: stored whole, sliced at use; their gradients in one bucket
            ("AllReduce", "backward", W): 1,
        }
    ), rec.summary()


class SharedNet(nn.Module):
    """A weight given to a primitive (as a block) and to a torch op."""

    def __init__(self) -> None:
        super().__init__()
        self.w = _param(32, 16, seed=8)
        self.mm = sw.ops.MatMul().shard(((2, 4), (4, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mm(x, self.w) * self.w.sum()
        return out


def test_parameter_used_by_primitive_and_torch_op() -> None:
    """``w.sum()`` runs on the block the MatMul stores (rows over mp): a partial sum, one
    scalar all-reduced over mp, instead of gathering w's rows."""
    rec, _, _ = run(SharedNet, (16, 32))
    forward = rec.select(phase="forward")
    assert not [r for r in forward if r.kind == "AllGather"], rec.summary()
    reduced = [(r.numel, r.group) for r in forward if r.kind == "AllReduce"]
    assert (1, MP) in reduced, rec.summary()


def test_identity_without_autoparallel() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 32)
    net = ShardedFunctionNet()
    torch.testing.assert_close(net(x), net.mm(net.add(x, x * 2.0), net.w))
    assert sw.reshard(x, (2, 1)) is x


def test_failed_plan_gives_network_back() -> None:
    net, x_plain = Block(), torch.randn(2, 32)
    net.mm1.shard(((3, 1), (1, 1)))
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = AutoParallel(net)
        x = world.same(x_plain)
        with pytest.raises(ValueError, match="does not divide the device count 8"):
            parallel(x)
        net.mm1.shard(((2, 1), (1, 4)))
        assert net(x).shape == (2, 32)  # runs on its own, no wrapper hooks left


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"in_strategy": (2, 1)}, TypeError, r"one tuple per input"),
        ({"in_strategy": ((2, 1), LAYOUT("dp", "mp"))}, ValueError, r"mixes int tuples"),
        ({"in_strategy": None, "parameter_plan": [("w1", (2, 1))]}, TypeError, r"dict name"),
        (  # (across the arguments: accepted, where a primitive's shard() refuses it)
            {"in_strategy": ((2, 1),), "out_strategy": (LAYOUT("dp", "mp"),)},
            ValueError,
            r"in_strategy, out_strategy and parameter_plan mix int tuples and Layouts",
        ),
        (
            {"in_strategy": (LAYOUT("dp", "None"),), "parameter_plan": {"w1": (4, 1)}},
            ValueError,
            r"mix int tuples and Layouts; use one kind for all",
        ),
        (  # (was "parameter_plan['w1'] entry 0 is 'mp'", an entry of what?)
            {"in_strategy": None, "parameter_plan": {"w1": "mp"}},
            TypeError,
            r"^sw.shard: parameter_plan\['w1'\] is 'mp'; expected a tuple of ints or a Layout "
            r"call \(an alias alone is not a layout: name one per dim, e.g. layout\('mp', "
            r"'None'\)\)$",
        ),
    ],
)
def test_eager_errors(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        sw.shard(Block(), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (  # (the module named; a weight's entry is the op form, of nn.Linear / nn.Embedding)
            {"in_strategy": ((2, 1), (2, 1))},
            r"sw.shard\(Block\): in_strategy has 2 entries but the call has 1 tensor inputs \(x\); "
            r"give one per tensor of its forward \(an entry for its weight too is the op form",
        ),
        ({"in_strategy": ((3, 1),)}, r"does not divide the device count 8"),
        ({"in_strategy": ((2, 1, 1),)}, r"has 3 dims but the tensor has shape \[16, 32\]"),
        ({"in_strategy": None, "parameter_plan": {"w3": (2, 1)}}, r"'w3'.*valid names: \['w1'"),
        ({"in_strategy": None, "parameter_plan": {"w1": (1, 64)}}, r"uses 64 devices"),
    ],
)
def test_plan_time_errors(kwargs: dict[str, object], match: str) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = sw.shard(Block(), **kwargs)  # type: ignore[arg-type]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.block(x)
            return out

    net, x = Net(), torch.randn(2, 32)
    with simulated_world(WORLD) as world:
        world.replicate(net)
        with pytest.raises(ValueError, match=match):
            AutoParallel(net)(world.same(x))


REVERSED = sw.Layout((2, 4), ("dp", "mp"), rank_list=[7, 6, 5, 4, 3, 2, 1, 0])


class RankListMatMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = _param(16, 8, seed=1)
        self.mm = sw.ops.MatMul().shard((REVERSED("dp", "mp"), REVERSED("mp", "None")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mm(x, self.w)
        return out


class RankListReshard(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = _param(16, 8, seed=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sw.reshard(x, REVERSED("dp", "mp")) @ self.w


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (RankListMatMul, r"mm/MatMul \(shardwise.ops.MatMul\): input 0's Layout orders"),
        (RankListReshard, r"reshard \(shardwise.reshard\): the sw.reshard Layout orders"),
    ],
)
def test_a_layout_with_a_rank_list_is_named_with_the_fix(
    make: Callable[[], nn.Module], match: str
) -> None:
    """The plan places devices in rank order; a strategy's rank_list was refused by an error
    naming two device matrices only."""
    net, x = make(), torch.randn(8, 16)
    with simulated_world(WORLD) as world:
        world.replicate(net)
        with pytest.raises(ValueError, match=match + r".*rank_list=\[7, 6, 5, 4, 3, 2, 1, 0\]"):
            AutoParallel(net)(world.rows(x))
