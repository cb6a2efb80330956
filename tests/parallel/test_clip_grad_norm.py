"""Gradient clipping by the norm of the whole gradients inside and outside `AutoParallel`.

nanoGPT clips with ``torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)`` between
``loss.backward()`` and ``optimizer.step()``. Under `AutoParallel` each rank holds blocks, so
torch's function alone would clip each rank by the norm of its blocks. Inside a wrapped call
the same call takes the norm of the whole gradients (`shardwise.parallel._clip`): with the
Megatron annotation at 2 x 2 and 1 x 2 (norms 2, 1 and inf) and in plain data parallel, two
AdamW steps clipped hard (max_norm 0.05) equal one device's: the returned norm, the loss,
every clipped gradient (this rank's block), 1e-5 relative; the clipping adds one AllReduce
over mp per step (the split gradients' partial norms) and none under data parallel. With hsdp
(levels 1-3, shard groups smaller than the replicas, on Megatron too) every shard counts once
and the clipped shards equal one device's rows. Outside a call, ``AutoParallel.clip_grad_norm_``
does the same; in the data-parallel mode and before the first call it is a `ValueError` naming
why and the fix; outside any call torch's own function is in place.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_ as imported_clip  # (the from-import form)

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..optim.test_hsdp import shard_of
from ..zoo import GPT2
from .test_zoo_megatron import ADAM, batches, block_of, hsdp_kinds, megatron, per_layer

MAX_NORM = 0.05

pytestmark = pytest.mark.usefixtures("one_thread")


def clipped_step(net: nn.Module, opt: Any, norm_type: float, seen: list[Any]) -> Any:
    """nanoGPT's step: loss, backward, clip (torch's function, as one device calls it: by its
    attribute path, or imported by name for the 1-norm), a copy of the returned norm and
    every clipped gradient, AdamW's step."""
    clip = imported_clip if norm_type == 1.0 else torch.nn.utils.clip_grad_norm_

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = net(x, y)[1]
        loss.backward()
        norm = clip(net.parameters(), MAX_NORM, norm_type)
        seen.append((norm, {n: p.grad.detach().clone() for n, p in net.named_parameters()}))
        opt.step()
        opt.zero_grad()
        return loss

    return step


def one_device(norm_type: float) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]:
    net = GPT2()
    seen: list[Any] = []
    step = clipped_step(net, net.configure_optimizers(weight_decay=0.1, **ADAM), norm_type, seen)
    losses = [step(x, y).detach() for x, y in batches()]
    assert all(norm > 2 * MAX_NORM for norm, _ in seen)  # (it clips: a test that can fail)
    return [(loss, norm, grads) for loss, (norm, grads) in zip(losses, seen, strict=True)]


@pytest.mark.parametrize(
    ("dp", "mp", "norm_type"),
    [(2, 2, 2.0), (1, 2, 1.0), (1, 2, float("inf")), (4, 1, 2.0)],
)
def test_clip_inside_a_train_step_matches_one_device(dp: int, mp: int, norm_type: float) -> None:
    for kinds in train_clipped(dp, mp, norm_type, block_of):
        if mp > 1:  # one AllReduce over mp of the split gradients' partial norms
            kinds[("AllReduce", "forward", tuple(range(mp)))] -= 1
            assert +kinds == per_layer(dp, mp)
        else:  # data parallel: every gradient is whole after its bucket
            world_group = tuple(range(dp))
            want_kinds = Counter({("AllReduce", "forward", world_group): 1})
            want_kinds[("AllReduce", "backward", world_group)] = 1
            assert kinds == want_kinds


def test_clip_outside_the_call_with_the_wrapper() -> None:
    """Module form: ``loss.backward()`` and the clipping outside the wrapped call, through
    `AutoParallel.clip_grad_norm_`: the same norm and clipped gradients as one device."""
    x, y = batches()[0]
    ref = GPT2()
    ref(x, y)[1].backward()
    want = nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    net = megatron(GPT2(), 2, 2)
    with simulated_world(4) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(lambda a, b: net(a, b)[1], network=net)
        with pytest.raises(ValueError, match="call the wrapper first"):
            parallel.clip_grad_norm_(MAX_NORM)
        parallel(world.rows(x), world.rows(y)).backward()
        with pytest.raises(ValueError, match=r"norm_type 0 .* not supported"):
            parallel.clip_grad_norm_(MAX_NORM, 0)
        norm = parallel.clip_grad_norm_(MAX_NORM)
        assert_matches_single_device(norm, want, what="norm")
        for name, p in net.named_parameters():
            full = block_of(parallel, name, dict(ref.named_parameters())[name].grad)
            assert_matches_single_device(p.grad, full, what=f"{name}.grad")


HSDP_CASES = [("level1", -1, 4, 1, 2.0), ("level2", 2, 4, 1, 2.0), ("level3", -1, 4, 1, 1.0)]
HSDP_CASES += [("level1", -1, 2, 2, 2.0), ("level2", -1, 2, 2, float("inf"))]


@pytest.mark.parametrize(("level", "shard_size", "dp", "mp", "norm_type"), HSDP_CASES)
def test_clip_with_optimizer_parallel_matches_one_device(
    level: str, shard_size: int, dp: int, mp: int, norm_type: float
) -> None:
    """With hsdp each rank holds shards (levels 2-3: reduce-scattered in backward; level 1:
    full gradients until the step, reduced by the clipping instead, the step then reducing
    none): the norm counts each distinct shard once (shard groups of 2 among 4 replicas keep two
    copies of each), on top of the Megatron annotation too. The returned norm, the loss and
    every clipped shard equal one device's; the clipping adds one AllReduce over all ranks."""
    hsdp = {"shard_size": shard_size, "threshold": 0, "optimizer_level": level}
    for kinds in train_clipped(dp, mp, norm_type, shard_of, hsdp):
        assert kinds == hsdp_clip_kinds(level, shard_size, dp, mp)


def train_clipped(
    dp: int, mp: int, norm_type: float, piece: Any, hsdp: dict[str, Any] | None = None
) -> list[Counter[tuple[str, str, tuple[int, ...]]]]:
    """`clipped_step` trained two steps on GPT-2 (Megatron at mp > 1; `hsdp`'s settings when
    given) on dp x mp simulated ranks: the loss, the norm and every clipped gradient (this
    rank's `piece(parallel, name, full)` of one device's) equal one device's. Returns each
    step's collectives."""
    want = one_device(norm_type)
    net = megatron(GPT2(), dp, mp) if mp > 1 else GPT2()
    out, steps = [], batches()
    with simulated_world(dp * mp) as world:
        world.replicate(net)
        seen: list[Any] = []
        opt = net.configure_optimizers(weight_decay=0.1, **ADAM)
        parallel = sw.AutoParallel(clipped_step(net, opt, norm_type, seen), "semi_auto")
        if hsdp is not None:
            parallel.hsdp(**hsdp)
        for s, (x, y) in enumerate(steps):
            with CommRecorder() as rec:
                loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want[s][0], what=f"loss {s}")
            norm, grads = seen[s]
            assert_matches_single_device(norm, want[s][1], what=f"norm {s}")
            for name, grad in grads.items():
                full = piece(parallel, name, want[s][2][name])
                assert_matches_single_device(grad, full, what=f"step {s} {name}.grad")
            out.append(rec.kinds())
    assert_torch_clips_alone()
    return out


def hsdp_clip_kinds(
    level: str, shard_size: int, dp: int, mp: int
) -> Counter[tuple[str, str, tuple[int, ...]]]:
    """One clipped hsdp step's collectives (as the recorder lists them: by rank 0's groups):
    the step's own (`hsdp_kinds` at 2 x 2; under data parallel the loss, then one bucket:
    AllGather forward, ReduceScatter in backward (level 1: at the step), level 3 gathering
    again in backward, an AllReduce of the shards over the copy group when the shard groups
    are smaller) and the clipping's AllReduce over all ranks."""
    world = tuple(range(dp * mp))
    if mp > 1:
        want = hsdp_kinds(level)
    else:
        group = tuple(range(shard_size)) if shard_size > 0 else world  # (rank 0's groups)
        phase = "step" if level == "level1" else "backward"
        want = Counter({("AllReduce", "forward", world): 1})
        want[("AllGather", "forward", group)] += 1
        want[("ReduceScatter", phase, group)] += 1
        if level == "level3":
            want[("AllGather", "backward", group)] += 1
        if group != world:
            want[("AllReduce", phase, tuple(range(0, dp, shard_size)))] += 1
    want[("AllReduce", "forward", world)] += 1
    return want


@pytest.mark.parametrize("clip", ["wrapper", "torch"])
@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_clip_outside_the_call_with_optimizer_parallel(level: str, clip: str) -> None:
    """hsdp with the clipping after ``loss.backward()`` outside the wrapped call:
    `AutoParallel.clip_grad_norm_` or torch's ``clip_grad_norm_`` (level 1: they reduce the
    held gradients first) give one device's norm and clipped gradients, as shards; the
    optimizer's step then reduces nothing more. (torch's at levels 2-3 took each rank's own
    shards' norm.)"""
    x, y = batches()[0]
    ref = GPT2()
    ref(x, y)[1].backward()
    want = nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    net = GPT2()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(lambda a, b: net(a, b)[1], network=net)
        parallel.hsdp(threshold=0, optimizer_level=level)
        parallel(world.rows(x), world.rows(y)).backward()
        with CommRecorder() as rec:
            if clip == "wrapper":
                norm = parallel.clip_grad_norm_(MAX_NORM)
            else:
                norm = torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
            torch.optim.SGD(net.parameters(), lr=0.0).step()
        assert_matches_single_device(norm, want, what="norm")
        for name, p in net.named_parameters():
            full = dict(ref.named_parameters())[name].grad
            assert_matches_single_device(p.grad, shard_of(parallel, name, full), what=name)
        reduced = 1 if level == "level1" else 0
        assert rec.kinds() == Counter(
            {("AllReduce", "forward", (0, 1)): 1, ("ReduceScatter", "step", (0, 1)): reduced}
        ), rec.summary()


def two_step(net: nn.Module, opt: Any, seen: list[Any]) -> Any:
    """torchtitan's form of clipping: ``torch.nn.utils.get_total_norm`` of the gradients, then
    ``torch.nn.utils.clip_grads_with_norm_``, both by their attribute paths."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = net(x, y)[1]
        loss.backward()
        grads = [p.grad for p in net.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        torch.nn.utils.clip_grads_with_norm_(net.parameters(), MAX_NORM, norm)
        seen.append((norm, {n: p.grad.detach().clone() for n, p in net.named_parameters()}))
        opt.step()
        opt.zero_grad()
        return loss

    return step


@pytest.mark.parametrize("hsdp", [None, "level2", "level1"])
def test_the_two_step_form_matches_one_device(hsdp: str | None) -> None:
    """``get_total_norm`` then ``clip_grads_with_norm_`` inside a Megatron 2 x 2 step (with
    hsdp levels 1-2: shards): one device's norm and clipped gradients. (Level 1 holds the
    gradients unreduced: listing the parameters' ``.grad`` reduces them first; it was refused
    with a ValueError.)"""
    ref, want = GPT2(), []
    step = two_step(ref, ref.configure_optimizers(weight_decay=0.1, **ADAM), want)
    x, y = batches()[0]
    want_loss = step(x, y)
    net = megatron(GPT2(), 2, 2)
    with simulated_world(4) as world:
        world.replicate(net)
        seen: list[Any] = []
        opt = net.configure_optimizers(weight_decay=0.1, **ADAM)
        parallel = sw.AutoParallel(two_step(net, opt, seen))
        if hsdp is not None:
            parallel.hsdp(threshold=0, optimizer_level=hsdp)
        loss = parallel(world.rows(x), world.rows(y))
        assert_matches_single_device(loss, want_loss, what="loss")
        assert_matches_single_device(seen[0][0], want[0][0], what="norm")
        piece = block_of if hsdp is None else shard_of
        for name, grad in seen[0][1].items():
            full = piece(parallel, name, want[0][1][name])
            assert_matches_single_device(grad, full, what=f"{name}.grad")


def test_the_two_step_form_refuses_copies_of_the_gradients() -> None:
    """``get_total_norm`` of copies (``p.grad.detach()``): nothing tells which piece of which
    gradient each is, so a ValueError (it gave each rank another norm, silently)."""
    net, (x, y) = megatron(GPT2(), 1, 2), batches()[0]
    with simulated_world(2) as world:
        world.replicate(net)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(x, y)[1]
            loss.backward()
            torch.nn.utils.get_total_norm([p.grad.detach() for p in net.parameters()])
            return loss

        with pytest.raises(ValueError, match=r"get_total_norm .* no parameter's \.grad"):
            sw.AutoParallel(step)(x, y)


def test_clip_is_refused_in_the_data_parallel_mode() -> None:
    net, (x, y) = GPT2(), batches()[0]
    with simulated_world(2) as world:
        world.replicate(net)
        opt = net.configure_optimizers(weight_decay=0.1, **ADAM)
        step = clipped_step(net, opt, 2.0, [])
        parallel = sw.AutoParallel(step, "data_parallel", optimizer=opt)
        match = r"data_parallel.*reduces them.*use parallel_mode='semi_auto'"
        with pytest.raises(ValueError, match=match):
            parallel(world.rows(x), world.rows(y))
        with pytest.raises(ValueError, match=match):  # (and outside the call)
            parallel.clip_grad_norm_(MAX_NORM)
    assert_torch_clips_alone()


def assert_torch_clips_alone() -> None:
    """Outside any wrapped call torch's clipping is torch's: a plain tensor's norm (3-4-5)."""
    t = torch.zeros(2, requires_grad=True)
    t.grad = torch.tensor([3.0, 4.0])
    assert float(nn.utils.clip_grad_norm_([t], 1.0)) == 5.0
    assert float(imported_clip([t], 1.0)) == pytest.approx(1.0)  # (clipped to 1 just now)


@pytest.mark.parametrize("level", ["none", "level1", "level3"])
def test_accumulated_padded_clipped_step_matches_one_device(level: str) -> None:
    """nanoGPT's loop in one wrapped step: two micro-batches, each ``(loss / 2).backward()``
    with ``ignore_index=-1`` padding in some rows only (the mean weighed by each rank's counted
    targets), then the clipping and AdamW, plain or with hsdp: the loss, the norm and every
    clipped gradient equal one device's, and the only backward AllReduces are the gradient
    buckets (the halved loss's adjoint is local: `EdgePlan.seeded`)."""
    data = [(x.clone(), y.clone()) for x, y in batches() * 2]
    for i, (_, y) in enumerate(data):
        y[: 1 + i, -5:] = -1  # (padding in the first rows: the ranks count differently)

    def accumulating(net: nn.Module, opt: Any, seen: list[Any]) -> Any:
        def step(*xy: torch.Tensor) -> torch.Tensor:
            total = torch.zeros(())
            for x, y in (xy[:2], xy[2:]):
                loss = net(x, y)[1] / 2
                loss.backward()
                total = total + loss.detach()
            norm = torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
            seen.append((norm, {n: p.grad.detach().clone() for n, p in net.named_parameters()}))
            opt.step()
            opt.zero_grad()
            return total

        return step

    ref, want = GPT2(), []
    step = accumulating(ref, ref.configure_optimizers(weight_decay=0.1, **ADAM), want)
    steps = [(*data[0], *data[1]), (*data[2], *data[3])]
    losses = [step(*xy) for xy in steps]
    net = GPT2()
    with simulated_world(4) as world:
        world.replicate(net)
        seen: list[Any] = []
        opt = net.configure_optimizers(weight_decay=0.1, **ADAM)
        parallel = sw.AutoParallel(accumulating(net, opt, seen), "semi_auto")
        if level != "none":
            parallel.hsdp(threshold=0, optimizer_level=level)
        for s, xy in enumerate(steps):
            with CommRecorder() as rec:
                loss = parallel(*(world.rows(t) for t in xy))
            assert_matches_single_device(loss, losses[s], what=f"loss {s}")
            assert_matches_single_device(seen[s][0], want[s][0], what=f"norm {s}")
            for name, grad in seen[s][1].items():
                full = want[s][1][name]
                rows = full if level == "none" else shard_of(parallel, name, full)
                assert_matches_single_device(grad, rows, what=f"step {s} {name}.grad")
            buckets = 2 if level != "level1" else 0  # (one per backward; level 1: at the clip)
            assert rec.count(kind="AllReduce", phase="backward") == (
                buckets if level == "none" else 0
            )
            assert rec.count(phase="backward") == buckets * (2 if level == "level3" else 1)
