"""``AutoParallel(net, parallel_mode="data_parallel")`` under ``"full_batch"`` with tensors
inside tuple, list, dict and dataclass inputs (a ``past_key_values``-style cache).

The module form gathers every output tensor whole, also inside containers, but cut only the
top-level tensor inputs to this rank's rows: a cache returned whole and passed back in a tuple
or dict stayed whole while the new tokens were this rank's rows, and the network's ``torch.cat``
failed ("Expected size 4 but got size 2"). Now tensors inside tuples, lists, dicts and
dataclasses are cut with the same dim-0 rule as top-level ones (and checked alike: the same
batch on every rank, a dim 0 that divides by the ranks), positional or keyword, and generation
matches one device. Two simulated ranks against one device, float32 at 1e-5.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

g = torch.Generator().manual_seed(1)
TOKENS = [torch.randn(4, 6, generator=g) for _ in range(3)]  # (one new token per step)


@dataclasses.dataclass
class Cache:
    keys: torch.Tensor


def keys_of(cache: Any) -> torch.Tensor:
    if isinstance(cache, dict):
        return cache["keys"]
    return cache.keys if isinstance(cache, Cache) else cache[0]


class CachedNet(nn.Module):
    """Appends each call's keys to the cache it is given, held in a `container`."""

    def __init__(self, container: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.k = nn.Linear(6, 8)
        self.out = nn.Linear(8, 3)
        self.container = container

    def forward(self, x: torch.Tensor, past: Any = None) -> tuple[torch.Tensor, Any]:
        k = self.k(x).unsqueeze(1)  # [B, 1, 8]
        if past is not None:
            k = torch.cat([keys_of(past), k], 1)  # (the cache grows along dim 1)
        kinds = {"tuple": (k,), "list": [k], "dict": {"keys": k}, "dataclass": Cache(k)}
        return self.out(k.mean(1)), kinds[self.container]


def generate(call: Any, keyword: bool) -> list[tuple[torch.Tensor, Any]]:
    """Each step's output and cache, the cache passed back in the next call."""
    seen = []
    out, past = call(TOKENS[0])
    seen.append((out, past))
    for x in TOKENS[1:]:
        out, past = call(x, past=past) if keyword else call(x, past)
        seen.append((out, past))
    return seen


@pytest.mark.parametrize("keyword", [False, True], ids=["positional", "keyword"])
@pytest.mark.parametrize("container", ["tuple", "list", "dict", "dataclass"])
def test_a_cache_passed_back_in_a_container_is_cut_and_matches_one_device(
    container: str, keyword: bool
) -> None:
    ref = CachedNet(container).eval()
    with torch.no_grad():
        want = generate(ref, keyword)
    net = CachedNet(container).eval()
    with simulated_world(2) as world, torch.no_grad():
        world.replicate(net)
        parallel = sw.AutoParallel(net, parallel_mode="data_parallel")
        parallel.dataset_strategy("full_batch")
        got = generate(lambda x, *a, **kw: parallel(world.same(x), *a, **kw), keyword)
        for i, ((out, past), (one, one_past)) in enumerate(zip(got, want, strict=True)):
            assert_matches_single_device(out, one, what=f"output {i}")
            assert type(past) is type(one_past)
            assert_matches_single_device(keys_of(past), keys_of(one_past), what=f"cache {i}")


def test_a_rank_passing_its_own_rows_inside_a_tuple_is_refused() -> None:
    net = CachedNet("tuple").eval()
    x, past = TOKENS[0], torch.randn(8, 2, 8, generator=g)  # (4 rows of its own per rank)
    with simulated_world(2) as world, torch.no_grad():
        world.replicate(net)
        parallel = sw.AutoParallel(net, parallel_mode="data_parallel")
        parallel.dataset_strategy("full_batch")
        with pytest.raises(ValueError, match=r"'full_batch'.*differs on rank 1"):
            parallel(world.same(x), (world.rows(past),))


def test_a_cache_whose_rows_do_not_divide_by_the_ranks_is_refused() -> None:
    net = CachedNet("dict").eval()
    x, past = TOKENS[0], torch.randn(3, 2, 8, generator=g)
    with simulated_world(2) as world, torch.no_grad():
        world.replicate(net)
        parallel = sw.AutoParallel(net, parallel_mode="data_parallel")
        parallel.dataset_strategy("full_batch")
        with pytest.raises(ValueError, match=r"'full_batch'.*shape \[3, 2, 8\].*not divisible"):
            parallel(world.same(x), past={"keys": world.same(past)})
