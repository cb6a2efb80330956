"""A mean loss whose ranks count different targets equals the single-device mean.

``F.cross_entropy`` / ``F.nll_loss`` with ``reduction="mean"`` divide by the targets they count
(not ``ignore_index``; each weighted by its class's ``weight``). With the rows split over ranks
and padding in some rows only, the ranks count differently, and the mean of their means is not
the single-device loss. In semi_auto the plan marks such a loss (``NodePlan.local ==
"weighted_mean"``), each rank runs it as a sum, and its one AllReduce carries the pair (sum,
counted): the loss and every gradient equal one device's, with the same collectives as before
(the loss's AllReduce two elements instead of one); a rank that counted nothing (its targets
ignored, or of classes of weight 0) adds 0 and gets zero gradients, not NaN.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..cached import outside_worlds
from ..zoo import (
    GPT2,
    assert_grad_blocks_match,
    gpt2_hf,
    recording_step,
    semi_auto_matches,
    token_batches,
)

STEPS, BATCH = 2, 8
pytestmark = pytest.mark.usefixtures("one_thread")


@outside_worlds
def padded(ignore: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token batches whose first half of rows is padded (`ignore` targets): the first quarter
    wholly, the second partly; so 2 or 4 ranks count different targets (the first of 4: none)."""
    out = []
    for x, y in token_batches(STEPS, BATCH):
        y = y.clone()
        y[: BATCH // 4] = ignore
        y[BATCH // 4 : BATCH // 2, 5:] = ignore
        out.append((x, y))
    return out


def gpt2_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return net(x, y)[1]  # type: ignore[no-any-return]


def hf_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = net(input_ids=x, labels=y).loss  # (HF shifts the labels itself)
    return out


MODELS = {"gpt2": (GPT2, gpt2_loss, -1), "gpt2_hf": (gpt2_hf, hf_loss, -100)}  # (nanoGPT: -1)


@outside_worlds
def single_device(name: str) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    make, loss_of, ignore = MODELS[name]
    net = make()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, eps=1e-6)
    losses, grads = [], []
    step = recording_step(net, opt, loss_of, grads)
    for x, y in padded(ignore):
        losses.append(step(x, y).detach())
    return losses, grads


@pytest.mark.parametrize(("name", "world_size"), [("gpt2", 2), ("gpt2", 4), ("gpt2_hf", 4)])
def test_padded_targets_match_one_device(name: str, world_size: int) -> None:
    make, loss_of, ignore = MODELS[name]
    want_losses, want_grads = single_device(name)
    net, steps = make(), padded(ignore)
    with simulated_world(world_size) as world:
        world.replicate(net)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, eps=1e-6)
        _, rec = semi_auto_matches(world, net, opt, loss_of, steps, want_losses, want_grads)
    ranks = tuple(range(world_size))
    want = {("AllReduce", "forward", ranks): STEPS, ("AllReduce", "backward", ranks): STEPS}
    assert rec.kinds() == Counter(want), rec.summary()
    forward = [r.numel for r in rec.records if r.phase == "forward"]
    assert forward == [2] * STEPS, forward  # (the pair: the loss summed, counted)


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


WEIGHT = torch.tensor([1.0, 2.0, 0.5, 3.0, 1.5])


def weighted_ce(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(net(x), y, weight=WEIGHT, ignore_index=4)


def smoothed_ce(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # (label smoothing: DTensor's rules gather the logits, the loss runs whole on every rank)
    return F.cross_entropy(net(x), y, weight=WEIGHT, ignore_index=4, label_smoothing=0.1)


def nll(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.nll_loss(F.log_softmax(net(x), -1), y, weight=WEIGHT)


@pytest.mark.parametrize(
    "loss_of", [weighted_ce, smoothed_ce, nll], ids=["cross_entropy", "smoothed", "nll_loss"]
)
def test_class_weights_match_one_device(loss_of: object) -> None:
    """Class weights: each rank's targets weigh differently, even with nothing ignored."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 6, generator=g), torch.tensor([0, 3, 3, 1, 2, 4, 0, 3])
    ref = Classifier()
    want = loss_of(ref, x, y)  # type: ignore[operator]
    want.backward()
    net = Classifier()
    with simulated_world(4) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        grads = {n: p.grad for n, p in ref.named_parameters()}
        semi_auto_matches(world, net, opt, loss_of, [(x, y)], [want.detach()], [grads])


def resnet_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return net(x, y)[1]  # type: ignore[no-any-return]


def test_padded_targets_with_split_batch_norm_match_one_device() -> None:
    """A split batch norm gathers its statistics (a collective in backward too): the loss's
    backward waits for the summed count instead of dividing by this rank's estimate."""
    from ..zoo import ResNet, image_batches

    ((x, y),) = image_batches(1, 8, size=8)
    y = y.clone()
    y[:3] = -100  # (rank 0 of 2 counts 1 target, rank 1 counts 4)
    ref = ResNet(widths=(4, 8))
    want = resnet_loss(ref, x, y)
    want.backward()
    net = ResNet(widths=(4, 8))
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        grads = {n: p.grad for n, p in ref.named_parameters()}
        parallel, _ = semi_auto_matches(
            world, net, opt, resnet_loss, [(x, y)], [want.detach()], [grads]
        )
    assert not any(e.deferred for e in parallel.parallel_plan.edges)


def loss_step(net: nn.Module) -> Any:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return gpt2_loss(net, x, y)

    return step


def test_backward_does_not_wait_for_the_count_when_the_loss_is_the_only_collective() -> None:
    """Data parallel GPT-2: the loss's AllReduce is the plan's only collective, so its seeded
    backward divides by this rank's estimate of the count (``EdgePlan.deferred``, kept in the
    plan's JSON); under Megatron's layout other collectives meet the gradients: it waits."""
    import shardwise as sw
    from shardwise.planner import ParallelPlan

    from ..zoo import GPT2

    ((x, y),) = padded(-1)[:1]
    deferred, shown = {}, {}
    for name, annotate in (("dp", False), ("megatron", True)):
        net = GPT2()
        if annotate:
            for block in net.transformer.h:
                sw.shard(block.attn.c_attn, in_strategy=((1, 1), (2, 1)))
                sw.shard(block.attn.c_proj, in_strategy=((1, 2), (1, 2)))
        with simulated_world(2) as world:
            world.replicate(net)
            plan = sw.AutoParallel(loss_step(net), parallel_mode="semi_auto").plan(
                world.rows(x), world.rows(y)
            )
        deferred[name], shown[name] = [e.value for e in plan.edges if e.deferred], str(plan)
        assert ParallelPlan.from_dict(plan.to_dict()) == plan
    assert len(deferred["dp"]) == 1 and "backward does not wait" in shown["dp"]
    assert deferred["megatron"] == [] and "backward does not wait" not in shown["megatron"]


def regularized(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    l2 = sum((p * p).sum() for p in net.parameters())
    return F.cross_entropy(net(x), y) + 0.01 * l2  # type: ignore[no-any-return]


@pytest.mark.parametrize("padded_rows", [3, 4], ids=["counts 1 and 4", "counts 0 and 4"])
def test_a_term_beside_the_loss_with_a_rank_counting_nothing(padded_rows: int) -> None:
    """The backward divides by this rank's estimate of the count and the buckets multiply each
    rank's share by count x ranks / sum: a share the same on every rank (the L2 term) sums as
    before only if a rank that counted nothing gets the factor 0."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 5, (8,), generator=g)
    y[:padded_rows] = -100
    ref = Classifier()
    want = regularized(ref, x, y)
    want.backward()
    net = Classifier()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        grads = {n: p.grad for n, p in ref.named_parameters()}
        parallel, _ = semi_auto_matches(
            world, net, opt, regularized, [(x, y)], [want.detach()], [grads]
        )
    assert [e.value for e in parallel.parallel_plan.edges if e.deferred]


def test_a_float64_loss_is_summed_in_float64() -> None:
    """The pair (mean x counted, counted) was all-reduced in float32: a float64 network's
    cross entropy came back rounded to float32 (1.2604386806 against 1.2604387232)."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 5, (8,))
    y[1] = 4  # (ignored)
    ref = Classifier().double()
    want = F.cross_entropy(ref(x), y, ignore_index=4)
    net = Classifier().double()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(net(a), b, ignore_index=4)
            loss.backward()
            return loss

        got = sw.AutoParallel(step)(world.rows(x), world.rows(y))
        assert got.dtype == torch.float64
        assert_matches_single_device(got, want.detach(), what="loss", rtol=1e-12, atol=1e-14)


class Mlp(nn.Module):
    """Two Linears; `megatron`: the first column parallel, the second row parallel (mp 2)."""

    def __init__(self, megatron: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 5)
        if megatron:
            sw.shard(self.fc1, in_strategy=((2, 1), (2, 1)))
            sw.shard(self.fc2, in_strategy=((2, 2), (1, 2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.relu(self.fc1(x)))
        return out


SOFT_LOSSES = {
    "soft_cross_entropy": lambda o, t: F.cross_entropy(o, t),
    "soft_smoothed_weighted": lambda o, t: F.cross_entropy(
        o, t, weight=WEIGHT, label_smoothing=0.1
    ),
    "kl_div_batchmean": lambda o, t: F.kl_div(F.log_softmax(o, -1), t, reduction="batchmean"),
    "kl_div_log_target": lambda o, t: F.kl_div(
        F.log_softmax(o, -1), t.log(), reduction="batchmean", log_target=True
    ),
}


@pytest.mark.parametrize(
    ("loss", "world_size", "megatron"),
    [(name, 2, False) for name in SOFT_LOSSES]
    + [("soft_cross_entropy", 4, False), ("kl_div_batchmean", 4, True)],
)
def test_losses_that_divide_by_their_own_rows(loss: str, world_size: int, megatron: bool) -> None:
    """A cross entropy of class probabilities (mixup, distillation) and ``kl_div``'s batchmean
    divide inside torch by the rows they get: each rank divided by its own rows while the plan
    summed the ranks' values as if by the global rows (N times the loss and the gradients,
    silently). They are averaged by their rows: loss and gradients equal one device's, with
    one forward AllReduce a step (the pair)."""
    g = torch.Generator().manual_seed(5)
    x, t = torch.randn(8, 6, generator=g), torch.softmax(torch.randn(8, 5, generator=g), -1)
    f = SOFT_LOSSES[loss]

    ref = Mlp()
    want = f(ref(x), t)
    want.backward()
    net = Mlp(megatron)
    with simulated_world(world_size) as world:
        world.replicate(net)

        def step(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = f(net(x), t)
            out.backward()
            return out

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        with CommRecorder() as rec:
            got = parallel(world.rows(x), world.rows(t))
        assert_matches_single_device(got, want.detach(), what="loss")
        assert_grad_blocks_match(parallel, net, ref)
    forward = [r.numel for r in rec.records if r.phase == "forward" and r.kind == "AllReduce"]
    assert forward[-1:] == [2], rec.summary()  # (the loss's: the pair)


PAD = torch.tensor([0.0, 1.0, 2.0])  # (class 0: a pad class, weight 0)


class Classifier3(nn.Module):
    """Three classes, through a hidden layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.tanh(self.fc1(x)))
        return out


class Tokens(nn.Module):
    """Per-position logits ``[N, C, T]`` (a K-dim cross entropy's input)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(6, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.conv(x)
        return out


ZERO_WEIGHT_LOSSES = {
    "cross_entropy": lambda o, t: F.cross_entropy(o, t, weight=PAD),
    "smoothed": lambda o, t: F.cross_entropy(  # (DTensor's rules: it runs whole, `smoothed_ce`)
        o, t, weight=PAD, label_smoothing=0.2
    ),
    "nll_loss": lambda o, t: F.nll_loss(F.log_softmax(o, 1), t, PAD, None, -100, None, "mean"),
    "k_dim": lambda o, t: F.cross_entropy(o, t, weight=PAD),
}


@pytest.mark.parametrize("mode", ["semi_auto", "sharding_propagation"])
@pytest.mark.parametrize("loss", list(ZERO_WEIGHT_LOSSES))
def test_a_rank_whose_targets_all_weigh_zero(loss: str, mode: str) -> None:
    """Rank 0 of 2 holds only targets of the weight-0 class: its mean is 0 / 0. The plan added
    0 for it in forward (the loss was right) but its backward divided by its weight sum of 0:
    every gradient NaN on every rank, the next step's loss NaN. Each rank now runs the loss as
    a sum, the AllReduce divides by the summed weight: loss and gradients are one device's."""
    g = torch.Generator().manual_seed(7)
    f = ZERO_WEIGHT_LOSSES[loss]
    if loss == "k_dim":
        make: Any = Tokens
        x, y = torch.randn(8, 6, 5, generator=g), torch.randint(1, 3, (8, 5), generator=g)
        y[:4] = 0
    else:
        make = Classifier3
        x, y = torch.randn(8, 6, generator=g), torch.tensor([0, 0, 0, 0, 1, 2, 1, 2])
    ref = make()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    want_grads: list[dict[str, torch.Tensor]] = []
    one = recording_step(ref, ref_opt, lambda n, a, b: f(n(a), b), want_grads)
    want = [one(x, y).detach() for _ in range(STEPS)]
    net = make()
    seen: list[dict[str, torch.Tensor]] = []
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
        step = recording_step(net, opt, lambda n, a, b: f(n(a), b), seen)
        parallel = sw.AutoParallel(step, parallel_mode=mode)
        for s in range(STEPS):
            got = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(got, want[s], what=f"loss {s}")
            assert_matches_single_device(seen[s], want_grads[s], what=f"grads {s}")


@pytest.mark.parametrize("loss", ["cross_entropy", "kl_div_batchmean"])
def test_a_float16_loss_whose_sum_passes_float16s_range(loss: str) -> None:
    """A float16 network's mean loss over 8,192 rows of loss about 24: each rank's sum (about
    100,000 at 2 ranks) is past float16's largest value (65,504), where the mean is not. Each
    rank's elements are summed in float32 (the sum was float16: inf on a rank), the loss cast
    back to float16 once divided: the mean computed in float32 (what CUDA's float16 kernel gives
    one device; the CPU's float16 mean is inf too), the gradients one device's of that float32
    mean, and the same collectives as a float32 loss (the loss's AllReduce forward only: its
    seeded backward sends nothing)."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(8192, 6, generator=g) * 40).half()
    if loss == "cross_entropy":
        y = torch.randint(0, 5, (8192,), generator=g)
    else:  # (class probabilities)
        y = torch.softmax(torch.randn(8192, 5, generator=g), -1).half()

    def loss_of(net: nn.Module, a: torch.Tensor, b: torch.Tensor, wide: bool = False) -> Any:
        out = net(a).float() if wide else net(a)
        if loss == "cross_entropy":
            return F.cross_entropy(out, b)
        b = b.float() if wide else b
        return F.kl_div(F.log_softmax(out, -1), b, reduction="batchmean")

    ref = Classifier().half()
    want = loss_of(ref, x, y, wide=True)
    assert float(want) > 65504 / 4096  # (each rank's sum past float16's range)
    want.backward()
    net = Classifier().half()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = loss_of(net, a, b)
            out.backward()
            return out

        with CommRecorder() as rec:
            got = sw.AutoParallel(step)(world.rows(x), world.rows(y))
        assert got.dtype == torch.float16
        assert_matches_single_device(got, want.detach().half(), what="loss", rtol=1e-3)
        for name, p in net.named_parameters():
            want_grad = dict(ref.named_parameters())[name].grad
            assert_matches_single_device(p.grad, want_grad, what=name, rtol=2e-2, atol=1e-3)
    assert rec.kinds() == Counter(
        {("AllReduce", "forward", (0, 1)): 1, ("AllReduce", "backward", (0, 1)): 1}
    ), rec.summary()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_a_float16_input_under_autocast_keeps_its_float32_loss(smoothing: float) -> None:
    """Under ``torch.autocast(dtype=float16)`` a cross entropy takes float16 logits and computes
    in float32: the loss stays float32 and equals one device's (a first version of the float16
    sum above cast it to float16, 2.2734375 against 2.2726417)."""
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(64, 6, generator=g) * 3, torch.randint(0, 5, (64,), generator=g)

    def run(net: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(net(a), b, label_smoothing=smoothing)
        loss.backward()
        return loss

    want = run(Classifier(), x, y)
    net = Classifier()
    with simulated_world(2) as world:
        world.replicate(net)
        got = sw.AutoParallel(lambda a, b: run(net, a, b))(world.rows(x), world.rows(y))
        assert got.dtype == torch.float32
        assert_matches_single_device(got, want.detach(), what="loss")
