"""Ops that return their input object unchanged (``h.to(torch.float32)`` on a float32 ``h``,
``h.float()``, ``h.type_as(h)``, ``torch.atleast_2d``, dropout in eval) under `AutoParallel`.

The capture took the op's output for the input's own value from then on, so a later read of
the input object (a T5-style RMSNorm: ``h * torch.rsqrt(h.to(torch.float32).pow(2).mean(...))``)
read the op's output, which the plan may hold apart from the input (moved for the op): under
sharding_propagation the whole ``h`` was multiplied by this rank's rows of the variance
(``RuntimeError: The size of tensor a (4) must match the size of tensor b (2)``). Now such an
op's output is a value of its own and the input object keeps its value: every variant trains
as one device under sharding_propagation and semi_auto, on 2 simulated ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

STEPS, LR = 3, 0.1
IDENTITY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "to_float32": lambda h: h.to(torch.float32),
    "to_dtype_keyword": lambda h: h.to(dtype=h.dtype),
    "float": lambda h: h.float(),
    "type_as": lambda h: h.type_as(h),
    "atleast_2d": torch.atleast_2d,
    "dropout_in_eval": lambda h: F.dropout(h, 0.5, training=False),
}
MODES = ["sharding_propagation", "semi_auto"]

g = torch.Generator().manual_seed(1)
DATA = [torch.randn(4, 8, generator=g) for _ in range(STEPS)]  # (made outside the world)


class RMSNorm(nn.Module):
    """T5's layer norm: the variance of `identity(h)`, then `h` itself scaled by it."""

    def __init__(self, identity: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8) + 0.1 * torch.arange(8.0))
        self.identity = identity

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        var = self.identity(h).pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(var + 1e-6))


class Net(nn.Module):
    """A Linear annotated whole, the norm, a Linear annotated with its rows split."""

    def __init__(self, identity: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 8, bias=False)
        self.norm = RMSNorm(identity)
        self.fc2 = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(self.fc1(x))).square().mean()


def _single(identity: Callable[[torch.Tensor], torch.Tensor]) -> tuple[list[torch.Tensor], Net]:
    net = Net(identity)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses = []
    for x in DATA:
        loss = net(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, net


def _trained(world: Any, net: nn.Module, mode: str, want: list[torch.Tensor]) -> Any:
    """`net` trained in `mode` on `DATA` (each rank its rows) with SGD, each loss equal to
    one device's (`want`); returns the wrapper."""
    opt = torch.optim.SGD(net.parameters(), lr=LR)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = net(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    parallel = sw.AutoParallel(step, parallel_mode=mode)
    for i, x in enumerate(DATA):
        assert_matches_single_device(parallel(world.rows(x)), want[i], what=f"loss {i}")
    return parallel


def _check(identity: Callable[[torch.Tensor], torch.Tensor], mode: str) -> None:
    """`STEPS` SGD steps on 2 ranks equal one device: each loss, each parameter after."""
    want, ref = _single(identity)
    net = Net(identity)
    with simulated_world(2) as world:
        world.replicate(net)
        sw.shard(net.fc1, in_strategy=((1, 1), (1, 1)))  # whole
        sw.shard(net.fc2, in_strategy=((2, 1), (1, 1)))  # rows split
        parallel = _trained(world, net, mode, want)
        plan = parallel.parallel_plan
        assert plan is not None
        for name, p in ref.named_parameters():
            layout, full = plan.params[name].layout, p.detach()
            block = lambda r, f=full, lay=layout: f[lay.local_index(r, tuple(f.shape))]  # noqa: E731
            assert_matches_single_device(net.get_parameter(name).detach(), block, what=name)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", sorted(IDENTITY))
def test_an_op_returning_its_input_trains_as_one_device(op: str, mode: str) -> None:
    _check(IDENTITY[op], mode)


class T5LayerNorm(nn.Module):
    """Hugging Face's T5LayerNorm, its forward as written there."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8) + 0.1 * torch.arange(8.0))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class T5Block(nn.Module):
    """An embedding Linear, T5's pre-norm MLP (wi, ReLU, wo; no residual: the final norm
    reads wo's partial sums), the final norm and a head with its input rows split (the final
    norm's cast is planned on rows)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 8, bias=False)
        self.norm, self.final_norm = T5LayerNorm(), T5LayerNorm()
        self.wi, self.wo = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)
        self.head = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = self.wo(F.relu(self.wi(self.norm(h))))
        return self.head(self.final_norm(h)).square().mean()


@pytest.mark.parametrize("mode", MODES)
def test_a_t5_style_block_with_megatron_annotations_trains_as_one_device(mode: str) -> None:
    """T5LayerNorm's own code, without Hugging Face (``h.to(torch.float32)`` returns ``h``
    on a float32 network), around a Megatron MLP (wi columns, wo rows split), before a head
    whose input rows are split."""
    ref = T5Block()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    want = []
    for x in DATA:
        loss = ref(x)
        loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        want.append(loss.detach())
    net = T5Block()
    with simulated_world(2) as world:
        world.replicate(net)
        sw.shard(net.embed, in_strategy=((1, 1), (1, 1)))
        sw.shard(net.wi, in_strategy=((1, 1), (2, 1)))
        sw.shard(net.wo, in_strategy=((1, 2), (1, 2)))
        sw.shard(net.head, in_strategy=((2, 1), (1, 1)))  # rows split
        _trained(world, net, mode, want)


# A parameter passed through such an op, then read by another op: the op hands the parameter
# object itself to the next call, which the plan has reading the op's result (no parameter).

LOSS_DATA = [
    (torch.randn(8, 8, generator=g), torch.randint(0, 2, (8, 1), generator=g).float())
    for _ in range(STEPS)
]  # (made outside the world)


def discriminator() -> nn.Sequential:
    """A GAN discriminator: spectral-normed Linears (power iteration on
    ``weight.flatten(1)``: torch's ``_reshape_weight_to_matrix``)."""
    torch.manual_seed(0)
    sn = nn.utils.parametrizations.spectral_norm
    return nn.Sequential(sn(nn.Linear(8, 16)), nn.LeakyReLU(0.2), sn(nn.Linear(16, 1)))


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight read as ``1.0 + self.weight.float()``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.arange(16.0))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h * (1.0 + self.weight.float())


class PowerNormed(nn.Module):
    """A Linear divided by ``|W v|`` (``torch.mv(W.flatten(1), v)``), an RMSNorm of Gemma's,
    a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 16), GemmaRMSNorm(), nn.Linear(16, 1)
        self.register_buffer("v", torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.mv(self.fc1.weight.flatten(1), self.v).norm()
        h = torch.tanh(F.linear(x, self.fc1.weight / scale, self.fc1.bias))
        out: torch.Tensor = self.fc2(self.norm(h))
        return out


def _gan_step(net: nn.Module, opt: torch.optim.Optimizer) -> Callable[..., torch.Tensor]:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.binary_cross_entropy_with_logits(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def _matches_one_device(
    make: Callable[[], nn.Module], world_size: int, mode: str, shard: Callable[..., None]
) -> None:
    """`STEPS` SGD steps of `make()`'s network on `world_size` ranks in `mode` (`shard`
    annotates it) equal one device: each loss, each parameter after (its block)."""
    ref = make()
    one = _gan_step(ref, torch.optim.SGD(ref.parameters(), lr=LR))
    want = [one(x, y).detach() for x, y in LOSS_DATA]
    net = make()
    with simulated_world(world_size) as world:
        world.replicate(net)
        shard(net, world_size)
        step = _gan_step(net, torch.optim.SGD(net.parameters(), lr=LR))
        parallel = sw.AutoParallel(step, parallel_mode=mode)
        for i, (x, y) in enumerate(LOSS_DATA):
            got = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(got, want[i], what=f"loss {i}")
        plan = parallel.parallel_plan
        for name, p in ref.named_parameters():
            full = p.detach()
            if plan is not None:
                layout = plan.params[name].layout
                full = lambda r, f=full, lay=layout: f[lay.local_index(r, tuple(f.shape))]  # noqa: E731
            assert_matches_single_device(net.get_parameter(name).detach(), full, what=name)


def no_annotation(net: nn.Module, n: int) -> None:
    pass


def megatron(net: nn.Module, n: int) -> None:
    """The first Linear's output features split, the second's input features."""
    first, second = (m for m in net.modules() if isinstance(m, nn.Linear))
    sw.shard(first, in_strategy=((1, 1), (n, 1)))
    sw.shard(second, in_strategy=((1, n), (1, n)))


SPECTRAL = {
    "semi_auto": (2, "semi_auto", no_annotation),
    "megatron_4_ranks": (4, "semi_auto", megatron),
    "data_parallel": (2, "data_parallel", no_annotation),
}


@pytest.mark.parametrize("case", sorted(SPECTRAL))
def test_a_spectral_normed_discriminator_trains_as_one_device(case: str) -> None:
    """torch's spectral_norm reads ``weight.flatten(1)`` (the parameter itself on a Linear),
    then ``torch.mv`` on it: the first call raised UnsupportedParallelError ("torch.mv on
    0.parametrizations.weight.original where the plan has ... on no parameter")."""
    world_size, mode, shard = SPECTRAL[case]
    _matches_one_device(discriminator, world_size, mode, shard)


def head_rows(net: nn.Module, n: int) -> None:
    """The head's input features split (the norm before it planned on split features)."""
    assert isinstance(net, PowerNormed)
    sw.shard(net.fc2, in_strategy=((1, n), (1, n)))


@pytest.mark.parametrize("shard", [no_annotation, head_rows], ids=["semi_auto", "head_rows"])
def test_float_and_flatten_of_a_parameter_then_another_op_train_as_one_device(
    shard: Callable[..., None],
) -> None:
    """``self.weight.float()`` (float32) and ``weight.flatten(1)`` (2-D) return the parameter
    itself; the ops reading their results ran as calls on the parameter, which the plan did
    not have (UnsupportedParallelError at the first call)."""
    _matches_one_device(PowerNormed, 2, "semi_auto", shard)


class FloatHeads(nn.Module):
    """A trunk, then the head the call names: Gemma's RMSNorm (its weight read through
    ``.float()``) and a Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.heads = nn.ModuleDict(
            {h: nn.Sequential(GemmaRMSNorm(), nn.Linear(16, 1)) for h in "ab"}
        )

    def forward(self, x: torch.Tensor, head: str) -> torch.Tensor:
        out: torch.Tensor = self.heads[head](torch.tanh(self.fc1(x)))
        return out


def test_heads_read_through_float_keep_their_own_plans() -> None:
    """Heads of an ``nn.ModuleDict`` picked by an argument, each weight read through
    ``.float()``, head a's Linear with its input features split: each call trains the head
    it names as one device does (a call on head b, whole, is not run as head a's node)."""
    heads = [("a", 0), ("b", 1), ("a", 2)]
    ref = FloatHeads()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    want = []
    for head, i in heads:
        x, y = LOSS_DATA[i]
        loss = F.binary_cross_entropy_with_logits(ref(x, head), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.detach())
    net = FloatHeads()
    with simulated_world(2) as world:
        world.replicate(net)
        sw.shard(net.get_submodule("heads.a.1"), in_strategy=((1, 2), (1, 2)))
        opt = torch.optim.SGD(net.parameters(), lr=LR)

        def step(x: torch.Tensor, y: torch.Tensor, head: str) -> torch.Tensor:
            loss = F.binary_cross_entropy_with_logits(net(x, head), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        for (head, i), expected in zip(heads, want, strict=True):
            x, y = LOSS_DATA[i]
            got = parallel(world.rows(x), world.rows(y), head)
            assert_matches_single_device(got, expected, what=f"loss {i} (head {head})")
