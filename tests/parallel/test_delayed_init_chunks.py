"""Chunked delayed init: a rank's block, generated chunk by chunk, is bit-identical to eager's.

Each case builds something after ``torch.manual_seed`` eagerly and again inside
``sw.no_init_parameters()``, materializes the deferred one with a slicer (rows, columns or a 2-D
block of every tensor of two or more dims; a range of a 1-D one) and a small buffer (so fills
run over many chunks with ragged ends), and checks: every block equals the eager tensor's block
bit for bit (`torch.equal`), the generator afterwards is where eager construction left it, and
the tensor was generated block-wise (nothing logged as "generated whole"), or, for the ops that
cannot be chunked, generated whole with the reason logged and the same values.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
from collections.abc import Callable

import pytest
import torch
from tests.zoo import GPT2, Block, GPT2Config
from torch import nn

import shardwise as sw
from shardwise.parameter import materialized_values
from shardwise.parameter._blocks import plan_blocks
from shardwise.parameter._box import Box, box_of_view, place
from shardwise.parameter._chunked import proven
from shardwise.parameter._deferred import _group

SPLITS = ("rows", "columns", "2d")
CHUNK = 200  # bytes: 50 float32 per chunk, rounded down to 48 (a multiple of 16)


def slicer_for(split: str) -> Callable[[str, tuple[int, ...]], tuple[slice, ...]]:
    def slicer(name: str, shape: tuple[int, ...]) -> tuple[slice, ...]:
        if len(shape) == 1:
            return (slice(shape[0] // 4, shape[0] // 4 + (shape[0] + 1) // 2),)
        rows, cols = shape[0], shape[1]
        return {
            "rows": (slice(rows // 4, rows // 2 + 1),),
            "columns": (slice(None), slice(cols // 3, cols)),
            "2d": (slice(rows // 2, rows), slice(cols // 4, cols // 2 + 1)),
        }[split]

    return slicer


def check(build: Callable[[], nn.Module], split: str, caplog: pytest.LogCaptureFixture) -> None:
    """``build()``'s blocks equal eager's; returns nothing, raises on any difference."""
    torch.manual_seed(7)
    eager = build()
    after_eager = torch.get_rng_state()
    want = {**dict(eager.named_parameters()), **dict(eager.named_buffers())}
    torch.manual_seed(7)
    with sw.no_init_parameters():
        deferred = build()
    slicer = slicer_for(split)
    with caplog.at_level(logging.INFO, logger="shardwise.parameter"):
        got = materialized_values(deferred, slicer=slicer, chunk_bytes=CHUNK)
    assert torch.equal(torch.get_rng_state(), after_eager)
    assert set(got) == set(want)
    for name, value in got.items():
        expected = want[name].detach()
        block = expected[slicer(name, tuple(expected.shape))] if expected.dim() else expected
        assert value.dtype == block.dtype and torch.equal(value, block), name


def whole_reasons(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "generated whole" in r.getMessage()]


class Fills(nn.Module):
    """One [37, 29] parameter (odd sizes: ragged chunks, normal_'s tail of 16) per fill."""

    def __init__(self, fills: list[Callable[[torch.Tensor], object]], dtype: torch.dtype) -> None:
        super().__init__()
        self.weights = nn.ParameterList()
        for fill in fills:
            weight = torch.empty(37, 29, dtype=dtype)
            fill(weight)
            self.weights.append(nn.Parameter(weight))


INIT = nn.init
FILLS: dict[str, Callable[[torch.Tensor], object]] = {
    "uniform_": lambda t: t.uniform_(-0.3, 0.7),
    "normal_": lambda t: t.normal_(0.5, 2.0),
    "init.uniform_": lambda t: INIT.uniform_(t, -2, 1),
    "init.normal_": lambda t: INIT.normal_(t, std=0.02),
    "kaiming_uniform_": lambda t: INIT.kaiming_uniform_(t, a=math.sqrt(5)),
    "kaiming_normal_": lambda t: INIT.kaiming_normal_(t, mode="fan_out", nonlinearity="relu"),
    "xavier_uniform_": lambda t: INIT.xavier_uniform_(t, gain=2.0),
    "xavier_normal_": lambda t: INIT.xavier_normal_(t),
    "trunc_normal_": lambda t: INIT.trunc_normal_(t, std=1.0, a=-1.0, b=1.5),  # redraws
    "trunc_normal_ default": lambda t: INIT.trunc_normal_(t),  # looked up inside the block
    "constant_ zeros_ ones_": lambda t: (INIT.constant_(t, 0.25), INIT.zeros_(t), INIT.ones_(t)),
    "fill_ zero_ mul_ add_": lambda t: (t.zero_(), t.fill_(3.0), t.mul_(0.3), t.add_(1.25)),
    "normal_ then view fill_": lambda t: (t.normal_(), t[5].fill_(0), t[:, 20:].mul_(2)),
    "init twice": lambda t: (INIT.kaiming_uniform_(t), t.normal_(0, 0.02)),
    "own generator": lambda t: t.normal_(0, 1, generator=torch.Generator().manual_seed(5)),
}


@pytest.mark.parametrize("split", SPLITS)
def test_each_fill_float32(split: str, caplog: pytest.LogCaptureFixture) -> None:
    check(lambda: Fills(list(FILLS.values()), torch.float32), split, caplog)
    assert whole_reasons(caplog) == []


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_random_fills_other_dtypes(dtype: torch.dtype, caplog: pytest.LogCaptureFixture) -> None:
    names = ("uniform_", "normal_", "kaiming_uniform_", "trunc_normal_", "fill_ zero_ mul_ add_")
    check(lambda: Fills([FILLS[n] for n in names], dtype), "2d", caplog)
    assert whole_reasons(caplog) == []


class Initializers(nn.Module):
    """MindSpore's initializers (`sw.initializer`), one [37, 29] parameter each."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList(
            sw.Parameter(sw.initializer(name, [37, 29])) for name in sw.parameter.VALID_NAMES
        )


@pytest.mark.parametrize("split", SPLITS)
def test_mindspore_initializers(split: str, caplog: pytest.LogCaptureFixture) -> None:
    check(Initializers, split, caplog)
    assert whole_reasons(caplog) == []


class Factories(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(33, 21))
        self.b = nn.Parameter(torch.rand(33, 21, dtype=torch.float64))
        self.c = nn.Parameter(torch.zeros(33, 21))
        self.d = nn.Parameter(torch.ones(33, 21) * 0.5)
        self.e = nn.Parameter(torch.full((33, 21), 2.5))
        self.f = nn.Parameter(torch.randn(33, 21) * 0.02 + 1)  # computed from a draw
        self.g = nn.Parameter((1.5 - torch.empty(33, 21).uniform_()).double() / 3)
        self.register_buffer("h", torch.arange(33.0))  # not a box op: whole, then cut


@pytest.mark.parametrize("split", SPLITS)
def test_factories_and_tensors_computed_from_them(
    split: str, caplog: pytest.LogCaptureFixture
) -> None:
    check(Factories, split, caplog)
    assert [m.split(" ")[0] for m in whole_reasons(caplog)] == ["h"]


MODULES: dict[str, Callable[[], nn.Module]] = {
    "Linear": lambda: nn.Linear(40, 24),
    "Embedding": lambda: nn.Embedding(50, 20, padding_idx=13),  # normal_, then a row fill_
    "LayerNorm": lambda: nn.LayerNorm(36),
    "Conv2d": lambda: nn.Conv2d(6, 10, 3),
    "GPT-2 block": lambda: Block(GPT2Config(n_embd=48, n_head=4)),
    "GPT-2": lambda: GPT2(GPT2Config(n_embd=32, vocab_size=72)),  # re-inits, a tied weight
}


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("module", list(MODULES))
def test_real_modules(module: str, split: str, caplog: pytest.LogCaptureFixture) -> None:
    check(MODULES[module], split, caplog)
    assert whole_reasons(caplog) == []


class NotChunked(nn.Module):
    """Fills whose draws depend on the whole tensor: generated whole, then cut."""

    def __init__(self) -> None:
        super().__init__()
        self.ortho = nn.Parameter(INIT.orthogonal_(torch.empty(12, 20)))
        self.narrow = nn.Parameter(INIT.trunc_normal_(torch.empty(30, 20), a=2.0, b=3.0))
        self.view = nn.Parameter(torch.zeros(30, 20))
        self.view.data[3:9].normal_()  # a random fill of a view
        self.transposed = nn.Parameter(torch.empty(30, 20))
        self.transposed.data.t().uniform_()  # all of it, in another order
        self.small = nn.Parameter(torch.empty(30, 20).normal_())
        self.small.data.copy_(torch.ones(30, 20))  # a real tensor argument


def test_fills_that_cannot_be_chunked_fall_back_to_whole(
    caplog: pytest.LogCaptureFixture,
) -> None:
    check(NotChunked, "2d", caplog)
    reasons = dict(m.split(" ", 1) for m in whole_reasons(caplog))
    assert set(reasons) == {"ortho", "narrow", "view", "transposed", "small"}, reasons
    assert "30% of the mass" in reasons["narrow"]
    assert "random fill of a view" in reasons["view"] and "view" in reasons["transposed"]


def test_non_cpu_tensors_are_not_chunked() -> None:
    """CUDA's Philox generator draws differently: a tensor made elsewhere stays whole."""
    with sw.no_init_parameters():
        net = nn.Linear(16, 8)
    ((session, targets),) = _group(net).items()
    plan = plan_blocks(session, targets, slicer_for("rows"))
    assert len(plan.boxes) == 2 and not plan.whole
    session.root_device[targets[0].ref.key] = torch.device("cuda", 0)
    plan = plan_blocks(session, targets, slicer_for("rows"))
    assert len(plan.boxes) == 1 and "cuda:0" in plan.whole[targets[0].name]
    sw.parameter.materialize(net)


def test_chunking_is_proven_on_this_build() -> None:
    for kind in ("uniform", "normal", "trunc_normal"):
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            assert proven(kind, dtype), (kind, dtype)


def test_place_copies_exactly_the_box_of_each_flat_range() -> None:
    rng = random.Random(3)
    for _ in range(200):
        shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 4)))
        lo = tuple(rng.randrange(n) for n in shape)
        box = Box(shape, lo, tuple(rng.randint(a + 1, n) for a, n in zip(lo, shape, strict=True)))
        full = torch.arange(math.prod(shape)).view(shape)
        out = torch.full(box.local_shape, -1)
        bounds = sorted({0, full.numel(), *(rng.randrange(full.numel()) for _ in range(3))})
        for start, stop in itertools.pairwise(bounds):
            place(full.view(-1)[start:stop], start, box, out)
        assert torch.equal(
            out, full[tuple(slice(a, b) for a, b in zip(box.lo, box.hi, strict=True))]
        )


def test_box_of_view() -> None:
    full = torch.empty(6, 5, 4)
    for view, box in [
        (full[2], Box((6, 5, 4), (2, 0, 0), (3, 5, 4))),
        (full[:, 1:3], Box((6, 5, 4), (0, 1, 0), (6, 3, 4))),
        (full[1:4, :, 3].t(), Box((6, 5, 4), (1, 0, 3), (4, 5, 4))),
    ]:
        assert box_of_view(view.shape, view.stride(), view.storage_offset(), (6, 5, 4)) == box
    for view in (full[::2], full.unsqueeze(0).expand(3, 6, 5, 4), full.view(-1)[3:50]):
        assert box_of_view(view.shape, view.stride(), view.storage_offset(), (6, 5, 4)) is None
