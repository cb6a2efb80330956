"""`sw.shard(module_or_fn, in_strategy=...)` with tensors passed by keyword, 8 simulated ranks.

`in_strategy` counted the positional tensors only: ``block(x, mask=m)`` with an entry for the
mask was refused ("the call has 1 tensor inputs (x)"), although ``block(x, m)`` was accepted.
Now the entries follow the positional tensors, then those passed by keyword in the order the
signature lists them (those a ``**kwargs`` takes: in the order passed); one entry per
positional tensor only still leaves the keyword tensors as they come.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

WORLD = 8
g = torch.Generator().manual_seed(1)
X, MASK, BIAS = torch.randn(16, 32, generator=g), torch.rand(16, 16, generator=g), torch.randn(16)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 16, generator=torch.Generator().manual_seed(0)))

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, *, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = x @ self.w
        h = h * mask if mask is not None else h
        return h + bias if bias is not None else h


class ExtraBlock(Block):
    """Its keyword tensors taken by ``**extra``: in the order passed."""

    def forward(self, x: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x, extra["mask"], bias=extra["bias"])


Call = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def run(make: Callable[[], Block], call: Call, strategy: Any) -> tuple[Any, Any]:
    """(loss, w's gradient) of the sharded block under AutoParallel, and one device's."""
    ref = make()
    want = call(ref, X, MASK, BIAS).square().mean()
    want.backward()
    block = make()
    sw.shard(block, in_strategy=strategy)
    with simulated_world(WORLD) as world:
        world.replicate(block)

        def step(x: torch.Tensor, m: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = call(block, x, m, b).square().mean()
            loss.backward()
            return loss

        wrapped = sw.AutoParallel(step, parallel_mode="semi_auto").dataset_strategy("full_batch")
        loss = wrapped(world.same(X), world.same(MASK), world.same(BIAS))
        assert_matches_single_device(loss, want.detach(), what="loss")
        assert_matches_single_device(block.w.grad, ref.w.grad, what="w.grad")
    return loss, block.w.grad


ROWS = (8, 1)


@pytest.mark.parametrize(
    ("make", "call", "strategy"),
    [
        (Block, lambda b, x, m, c: b(x, mask=m, bias=c), (ROWS, ROWS, (2,))),
        # (passed in the other order: the entries still follow the signature, mask first)
        (Block, lambda b, x, m, c: b(x, bias=c, mask=m), (ROWS, ROWS, (2,))),
        (Block, lambda b, x, m, c: b(mask=m, x=x, bias=c), (ROWS, ROWS, (2,))),
        # (**extra: in the order passed)
        (ExtraBlock, lambda b, x, m, c: b(x, bias=c, mask=m), (ROWS, (2,), ROWS)),
        # (one entry per positional tensor: the keyword ones come as they are)
        (Block, lambda b, x, m, c: b(x, mask=m, bias=c), (ROWS,)),
    ],
)
def test_keyword_tensors_get_entries_and_match_one_device(
    make: Callable[[], Block], call: Call, strategy: Any
) -> None:
    run(make, call, strategy)


def test_a_keyword_tensor_entry_is_applied_to_it() -> None:
    """An entry that does not fit the job fails at plan time naming the mask: it was applied."""
    match = r"in_strategy entry 1 \(mask\): .*does not divide the device count 8"
    with pytest.raises(ValueError, match=match):
        run(Block, lambda b, x, m, c: b(x, mask=m), (ROWS, (3, 1)))


def test_a_wrong_count_names_the_keyword_tensors_and_the_order() -> None:
    block = sw.shard(Block(), in_strategy=(ROWS, ROWS))
    with pytest.raises(
        ValueError,
        match=r"sw\.shard\(Block\): in_strategy has 2 entries but the call has 3 tensor inputs "
        r"\(x; by keyword: mask, bias\); give one per tensor: the positional ones, then those "
        r"passed by keyword in the order the signature lists them; or one per positional "
        r"tensor only \(1\)",
    ):
        block(X, bias=BIAS, mask=MASK)


def test_a_function_takes_entries_for_its_keyword_tensors() -> None:
    def body(x: torch.Tensor, w: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        return (x @ w) * mask

    fn = sw.shard(body, in_strategy=(ROWS, (1, 1), ROWS))
    block = Block()
    want = body(X, block.w.detach(), mask=MASK).square().mean()
    with simulated_world(WORLD) as world:
        world.replicate(block)

        def step(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            return fn(x, block.w, mask=m).square().mean()

        loss = sw.AutoParallel(step).dataset_strategy("full_batch")(world.same(X), world.same(MASK))
        assert_matches_single_device(loss, want, what="loss")
