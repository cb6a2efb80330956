"""Item assignment with a constant and fills, as encoder-decoder models write them.

Hugging Face's T5 / BART / Marian build their decoder inputs with ``_shift_right``:
``shifted = ids.new_zeros(ids.shape); shifted[..., 1:] = ids[..., :-1].clone();
shifted[..., 0] = start; shifted.masked_fill_(shifted == -100, pad)``. ``shifted[..., 0] = 0``
runs ``aten.lift_fresh`` (the constant made a tensor) and ``aten.fill_.Tensor`` on a view, for
which DTensor has no rule: the planner ran the op whole, had to gather the split ``shifted``
first and refused the in-place change (a PlanError), so T5 could not be planned.
``ops.aten_rules`` now has rules for them (and ``masked_fill`` with a 0-d tensor value); the
rows stay split. DTensor's rule for ``fill_.Scalar`` kept a partial sum partial, so every rank
wrote the value and the sum was N times it; a partial value is now made whole first.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..zoo import assert_grad_blocks_match


class ShiftRight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shifted = ids.new_zeros(ids.shape)
        shifted[..., 1:] = ids[..., :-1].clone()
        shifted[..., 0] = 5
        shifted.masked_fill_(shifted == -100, 0)
        h = self.emb(shifted)  # [B, S, 8]
        keep = torch.arange(ids.shape[1]) < ids.shape[1] - 1  # [S]: the last position off
        h = h.masked_fill(~keep[:, None], torch.tensor(0.5))
        return h.pow(2).mean()


def test_shift_right_keeps_the_rows_split_and_matches_one_device() -> None:
    ids = torch.randint(0, 64, (8, 6), generator=torch.Generator().manual_seed(1))
    ids[:, 3] = -100
    ref = ShiftRight()
    want = ref(ids)
    want.backward()
    net = ShiftRight()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = net(x)
            loss.backward()
            return loss

        with CommRecorder() as rec:
            loss = sw.AutoParallel(step)(world.rows(ids))
        assert_matches_single_device(loss, want.detach(), what="loss")
        assert_matches_single_device(net.emb.weight.grad, ref.emb.weight.grad, what="grad")
    # (the loss's AllReduce and the gradient bucket: nothing gathered)
    assert Counter(r.kind for r in rec.records) == Counter({"AllReduce": 2}), rec.summary()


class FillsAPartialSum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.relu(self.fc1(x)))  # row-parallel: a partial sum before its AllReduce
        scale = (h.detach() * 1.0).fill_(2.0)  # (2.0 everywhere, as on one device)
        return (h * scale).mean()


def test_fill_of_a_partial_sum_is_the_value_not_n_times_it() -> None:
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    ref = FillsAPartialSum()
    want = ref(x)
    net = FillsAPartialSum()
    with simulated_world(4) as world:
        world.replicate(net)
        sw.shard(net.fc1, in_strategy=((2, 1), (2, 1)))
        sw.shard(net.fc2, in_strategy=((2, 2), (1, 2)))
        got = sw.AutoParallel(net)(world.rows(x))
        assert_matches_single_device(got, want.detach(), what="loss")


class MaskedFills(nn.Module):
    """``masked_fill`` with a 0-d tensor value on a column-parallel activation: an input the
    mask broadcasts up to its shape (out of place), a mask of size 1 on the split dim, a mask
    broadcast over the rows."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))  # [B, 16]
        h = h * torch.masked_fill(h.sum(0), h > 0, torch.tensor(0.5))  # ([16] -> [B, 16])
        h = h.masked_fill(h[:, :1] > 0, torch.tensor(0.25))
        h = h.masked_fill(torch.arange(16) % 3 == 0, torch.tensor(-0.5))
        return self.fc2(h).pow(2).mean()


@pytest.mark.parametrize("megatron", [False, True], ids=["data parallel", "megatron"])
def test_masked_fill_with_a_tensor_value_matches_one_device(megatron: bool) -> None:
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    ref = MaskedFills()
    want = ref(x)
    net = MaskedFills()
    with simulated_world(4 if megatron else 2) as world:
        world.replicate(net)
        if megatron:
            sw.shard(net.fc1, in_strategy=((2, 1), (2, 1)))
            sw.shard(net.fc2, in_strategy=((2, 2), (1, 2)))
        got = sw.AutoParallel(net)(world.rows(x))
        assert_matches_single_device(got, want.detach(), what="loss")


class ConstantMask(nn.Module):
    """A mask made in the step (``torch.tensor``) that the plan cuts along a split dim."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x)).reshape(x.shape[0], 4, 4).clone()
        h.masked_fill_(torch.tensor([True, False, True, False])[:, None], 0.0)
        return self.fc2(h.reshape(x.shape[0], 16)).pow(2).mean()


def test_a_constant_cut_along_a_split_dim_in_a_simulated_world() -> None:
    """Cutting a plain tensor (a constant the step made) by a rank-dependent offset failed in
    a simulated world ('LocalIntNode' object has no attribute 'guard_int'); it is made a
    per-rank value first (`communication.every_rank`)."""
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    want = ConstantMask()(x)
    net = ConstantMask()
    with simulated_world(4) as world:
        world.replicate(net)
        sw.shard(net.fc1, in_strategy=((2, 1), (2, 1)))
        sw.shard(net.fc2, in_strategy=((2, 2), (1, 2)))
        got = sw.AutoParallel(net)(world.rows(x))
        assert_matches_single_device(got, want.detach(), what="loss")


class MaskAssign(nn.Module):
    """Item assignment through a boolean mask: ``h[h > 0.5] = 0.5`` (a mask over every dim),
    ``h[:, keep] = 0.0`` (a mask over the feature dim only), on a column-parallel activation and
    on a row-parallel partial sum."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x)).clone()
        h[h > 0.5] = 0.5
        h[:, torch.arange(16) % 4 == 1] = 0.0
        y = self.fc2(h).clone()  # (row-parallel: partial before its AllReduce)
        y[y < -0.2] = -0.2
        return y.pow(2).mean()


@pytest.mark.parametrize("megatron", [False, True], ids=["data parallel", "megatron"])
def test_item_assignment_through_a_boolean_mask_keeps_the_split(megatron: bool) -> None:
    """``x[mask] = value`` runs ``aten.index_put_`` with a boolean index, which DTensor cannot
    run on a split input in place: the planner refused it (PlanError). A boolean mask with a
    0-d value is elementwise (`aten_rules.mask_put_rule`): the rows and features stay split and
    only a partial sum is made whole first."""
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    ref = MaskAssign()
    want = ref(x)
    want.backward()
    net = MaskAssign()
    n = 4 if megatron else 2
    with simulated_world(n) as world:
        world.replicate(net)
        if megatron:
            sw.shard(net.fc1, in_strategy=((2, 1), (2, 1)))
            sw.shard(net.fc2, in_strategy=((2, 2), (1, 2)))

        def step(a: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(a)
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step)
        with CommRecorder() as rec:
            got = parallel(world.rows(x))
        assert_matches_single_device(got, want.detach(), what="loss")
        assert_grad_blocks_match(parallel, net, ref)
    every = tuple(range(n))
    if megatron:  # (groups holding rank 0: mp is (0, 1), dp is (0, 2))
        want_kinds = {
            ("AllGather", "forward", (0, 1)): 1,  # the input's rows for dp only
            ("ReduceScatter", "forward", (0, 1)): 1,  # fc2's partial sum, rows over every rank
            ("AllGather", "backward", (0, 1)): 1,  # (its adjoint)
            ("AllReduce", "forward", every): 1,  # the loss
            ("AllReduce", "backward", every): 1,  # fc2.bias's gradient
            ("AllReduce", "backward", (0, 2)): 1,  # the split parameters' gradients over dp
        }
    else:  # the loss and the gradient bucket: nothing gathered
        want_kinds = {("AllReduce", "forward", every): 1, ("AllReduce", "backward", every): 1}
    assert rec.kinds() == Counter(want_kinds), rec.summary()


def test_a_feature_mask_on_rows_split_over_the_later_axis_first() -> None:
    """Rows over ``("mp", "dp")`` are a strided split, which the boolean-mask rule left out:
    the plan moved the rows first and refused the in-place write."""
    layout = sw.Layout((2, 2), ("dp", "mp"))
    mask = torch.arange(16) % 3 == 0
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))

    def build() -> nn.Linear:
        torch.manual_seed(1)
        return nn.Linear(16, 16)

    def loss_of(lin: nn.Linear, a: torch.Tensor) -> torch.Tensor:
        y = sw.reshard(lin(a), layout(("mp", "dp"), "None")).clone()
        y[:, mask] = 0.0
        return y.pow(2).mean()

    ref = build()
    want = loss_of(ref, x)
    want.backward()
    lin = build()
    with simulated_world(4) as world:
        world.replicate(lin)

        def step(a: torch.Tensor) -> torch.Tensor:
            loss = loss_of(lin, a)
            loss.backward()
            return loss

        got = sw.AutoParallel(step)(world.rows(x))
        assert_matches_single_device(got, want.detach(), what="loss")
        assert_matches_single_device(lin.weight.grad, ref.weight.grad, what="weight.grad")
