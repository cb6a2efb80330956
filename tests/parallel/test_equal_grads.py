"""Equal gradients (Megatron's ``f``) under `AutoParallel`, 2 and 4 simulated ranks.

A Megatron MLP block: a row-parallel matmul (AllReduce over mp) makes ``x``, LayerNorm,
column-parallel fc1, GeLU, row-parallel fc2 (AllReduce over mp), the residual ``x + y``, a
column-parallel head, the mean. The plan averages the gradients of the LayerNorm's and the
residual's outputs over mp where the column-parallel matmuls read them, so the adjoints of the
two forward AllReduces are local and the LayerNorm's gradients need no AllReduce over mp (the
same collectives in backward, minus the LayerNorm's bucket). When the block's input comes
gathered instead (no AllReduce to save), the plan keeps the plain adjoints. Losses and every
gradient block equal the single-device run; the collectives are asserted exactly. With
optimizer parallel (hsdp) the engine sums the equal shares over every replica: the updated
parameters equal one device's.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise import ops
from shardwise.parallel import AutoParallel
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..optim.test_hsdp import shard_of
from ..zoo import assert_grad_blocks_match

B, K, H, F, V = 8, 16, 16, 32, 8


class MLPBlock(nn.Module):
    """x0 [B, K] -> (row-parallel w0, or taken whole when `gathered`) x -> LayerNorm -> fc1
    (column) -> GeLU -> fc2 (row) -> x + y -> head (column) -> mean over classes, then rows."""

    def __init__(self, dp: int, mp: int, gathered: bool, parallel: bool = True) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=g) * 0.3)

        self.gathered = gathered
        self.w0, self.w1, self.w2, self.w3 = param(K, H), param(H, F), param(F, H), param(H, V)
        self.gamma, self.beta = nn.Parameter(torch.ones(H)), nn.Parameter(torch.zeros(H))
        s = {
            "row0": ((dp, mp), (mp, 1)),
            "ln": ((dp, 1), (1,), (1,)),
            "fc1": ((dp, 1), (1, mp)),
            "gelu": ((dp, mp),),
            "fc2": ((dp, mp), (mp, 1)),
            "res": ((dp, 1), (dp, 1)),
            "head": ((dp, 1), (1, mp)),
            "mean_v": ((dp, mp),),
            "mean_b": ((dp,),),
        }
        prims: dict[str, ops.Primitive] = {
            "row0": ops.MatMul(),
            "ln": ops.LayerNorm(1, 1, 1e-5),
            "fc1": ops.MatMul(),
            "gelu": ops.GeLU(),
            "fc2": ops.MatMul(),
            "res": ops.Add(),
            "head": ops.MatMul(),
            "mean_v": ops.ReduceMean(),
            "mean_b": ops.ReduceMean(),
        }
        if gathered:  # x = x0 whole on mp: the LayerNorm reads the (gathered) input itself
            s["ln"], s["res"] = ((dp, 1), (1,), (1,)), ((dp, 1), (dp, 1))
        for name, prim in prims.items():
            self.add_module(name, prim.shard(s[name]) if parallel else prim)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0 if self.gathered else self.row0(x0, self.w0)
        h, _, _ = self.ln(x, self.gamma, self.beta)
        y = self.fc2(self.gelu(self.fc1(h, self.w1)), self.w2)
        out = self.head(self.res(x, y), self.w3)
        loss: torch.Tensor = self.mean_b(self.mean_v(out, 1), 0)
        return loss


def _check(dp: int, mp: int, gathered: bool) -> Counter[tuple[str, str, tuple[int, ...]]]:
    """Loss and every gradient block against one device, the parameters with equal gradients
    (the LayerNorm's, over mp, unless `gathered`); returns the step's collectives."""
    width = K if not gathered else H
    x0 = torch.randn(B, width, generator=torch.Generator().manual_seed(4))
    single = MLPBlock(dp, mp, gathered, parallel=False)
    want = single(x0)
    want.backward()
    net = MLPBlock(dp, mp, gathered)
    with simulated_world(dp * mp) as world:
        world.replicate(net)
        parallel = AutoParallel(net)
        with CommRecorder() as rec:
            loss = parallel(world.rows(x0))
            loss.backward()
        assert_matches_single_device(loss, want.detach(), what="loss")
        graph_plan = parallel.parallel_plan
        assert graph_plan is not None
        stored = graph_plan.param_layouts()
        mp_axis = (graph_plan.matrix.names.index("g1" if dp > 1 else "g0"),)
        equal = {} if gathered else {"gamma": mp_axis, "beta": mp_axis}
        assert dict(graph_plan.equal_grads) == equal, graph_plan
        for (name, p), ref in zip(net.named_parameters(), single.parameters(), strict=True):
            if ref.grad is None:  # (w0 when the input comes gathered)
                assert p.grad is None, name
                continue
            layout, shape = stored[name]
            assert p.grad is not None, name
            full = ref.grad
            assert_matches_single_device(
                p.grad, lambda r, f=full, a=layout, s=shape: f[a.local_slice(r, s)], what=name
            )
    return rec.kinds()


def test_row_parallel_input_gets_equal_gradients() -> None:
    got = _check(1, 2, gathered=False)
    w = (0, 1)
    want = Counter(
        {
            ("AlltoAll", "forward", w): 1,  # x0's rows -> its K columns for row0
            ("AllReduce", "forward", w): 3,  # row0, fc2, the mean over classes
            # the class mean's adjoint (the loss's region keeps it), f at ln's and res's
            # outputs (before: row0's and fc2's adjoints and the LayerNorm's gradients: 4)
            ("AllReduce", "backward", w): 3,
        }
    )
    assert got == want, got


def test_equal_gradients_at_2x2() -> None:
    got = _check(2, 2, gathered=False)
    mp, dp = (0, 1), (0, 2)
    want = Counter(
        {
            ("AlltoAll", "forward", mp): 1,
            ("AllReduce", "forward", mp): 3,  # row0, fc2, the mean over classes
            ("AllReduce", "forward", dp): 1,  # the mean over rows
            ("AllReduce", "backward", dp): 2,  # the rows mean's adjoint; one gradient bucket
            # f at ln's and res's outputs, the class mean's adjoint (the loss's region: plain)
            ("AllReduce", "backward", mp): 3,
        }
    )
    assert got == want, got


@pytest.mark.parametrize(("dp", "mp"), [(1, 2), (2, 2)])
def test_gathered_input_keeps_the_plain_adjoints(dp: int, mp: int) -> None:
    """Two ``f``s would replace one adjoint (fc2's): more bytes, so the plan keeps the shares
    unequal and all-reduces the LayerNorm's gradients."""
    got = _check(dp, mp, gathered=True)
    assert got[("AllReduce", "backward", tuple(range(mp)))] == (3 if dp == 1 else 2), got


@pytest.mark.parametrize("level", ["level1", "level2"])
def test_equal_gradients_with_optimizer_parallel(level: str) -> None:
    """hsdp at 2 x 2: the engine reduces each gradient over all its replicas (equal shares
    summed give the same total), so the updated parameters equal one device's."""
    x0 = torch.randn(B, K, generator=torch.Generator().manual_seed(4))
    single = MLPBlock(2, 2, gathered=False, parallel=False)
    ref_opt = torch.optim.SGD(single.parameters(), lr=0.5)
    want = []
    for _ in range(2):
        loss = single(x0)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append((loss.detach(), {n: p.detach().clone() for n, p in single.named_parameters()}))
    net = MLPBlock(2, 2, gathered=False)
    with simulated_world(4) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.5)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        parallel = AutoParallel(step).hsdp(threshold=0, optimizer_level=level)
        for s, (loss_want, params) in enumerate(want):
            loss = parallel(world.rows(x0))
            assert_matches_single_device(loss, loss_want, what=f"loss {s}")
            plan = parallel.parallel_plan
            assert plan is not None and dict(plan.equal_grads) == {"gamma": (1,), "beta": (1,)}
            for name, p in net.named_parameters():
                assert_matches_single_device(
                    p.detach(), shard_of(parallel, name, params[name]), what=f"{s} {name}"
                )


class WrittenClone(nn.Module):
    """A row-parallel linear's sum, cloned and written into (``z[:, 1:3] = h[:, :2] * 2``),
    then read by a layer that splits its rows over the same axis."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = sw.shard(nn.Linear(8, 8), in_strategy=((1, 4), (1, 4)))  # (row parallel)
        self.cl = sw.shard(nn.Linear(8, 8), in_strategy=((4, 1), (1, 1)))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        z = h.clone()
        z[:, 1:3] = h[:, :2] * 2
        return nn.functional.cross_entropy(self.head(self.cl(z)), y)


def test_a_value_written_into_later_gets_no_equal_gradient() -> None:
    """The clone's gradient was averaged where the rows are cut, and the adjoint of the
    AllReduce that made the written value whole was local; the written slice's gradient goes
    to that value through the write, not through the average: the linear's gradients were
    wrong (the loss right), silently (found by a fuzzer)."""
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(2))
    ref = WrittenClone()
    ref(x, y).backward()
    net = WrittenClone()
    with simulated_world(8) as world:
        world.replicate(net)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(a, b)
            loss.backward()
            return loss

        parallel = AutoParallel(step)
        parallel(world.rows(x), world.rows(y))
        assert_grad_blocks_match(parallel, net, ref)
