"""`sw.shard` on a function or a module names that call in its errors: the function (or
module class) as ``sw.shard(<name>)``, the module it runs in, the strategy entry and its
argument's name, where they said ``sw.reshard at file:line: input 0`` (a call the user never
made, and ``input 0`` for every entry)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import simulated_world


class Attention(nn.Module):
    """Scaled dot-product attention over given q, k, v; v's head dim (6) is not k's (4)."""

    def __init__(self, strategy: tuple[tuple[int, ...], ...]) -> None:
        super().__init__()
        self.attend = sw.shard(F.scaled_dot_product_attention, in_strategy=strategy)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.attend(q, k, v)
        return out


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(4, 2, 8, d, generator=g) for d in (4, 4, 6))  # type: ignore[return-value]


def test_a_function_entry_that_does_not_fit_names_the_function_entry_and_argument() -> None:
    net = Attention(((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 4)))
    q, k, v = _qkv()
    with simulated_world(4) as world, pytest.raises(ValueError) as caught:
        sw.AutoParallel(net)(world.rows(q), world.rows(k), world.rows(v))
    message = str(caught.value)
    assert "sw.reshard" not in message and "input 0" not in message, message
    assert (
        "sw.shard(scaled_dot_product_attention) at test_shard_messages.py:" in message
        and ": in_strategy entry 2 (value): dim 3 of size 6 cannot be split into 4 parts "
        "(axes d3); use a split that divides 6"
        in message
    ), message


def test_an_entry_count_that_does_not_match_names_the_function_and_its_tensors() -> None:
    attend = sw.shard(F.scaled_dot_product_attention, in_strategy=((1, 1, 1, 1),) * 2)
    with pytest.raises(
        ValueError,
        match=r"sw\.shard\(scaled_dot_product_attention\): in_strategy has 2 entries but the "
        r"call has 3 tensor inputs \(query, key, value\); give one per tensor",
    ):
        attend(*_qkv())


def test_a_module_entry_of_the_wrong_rank_names_the_module_and_its_path() -> None:
    net = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    sw.shard(net[2], in_strategy=((2, 1, 1),))
    x = torch.randn(8, 16)
    with simulated_world(4) as world, pytest.raises(ValueError) as caught:
        sw.AutoParallel(net)(world.rows(x))
    message = str(caught.value)
    assert "sw.reshard" not in message, message
    assert (
        "sw.shard(Linear) in 2 at " in message
        and ": in_strategy entry 0 (input): the layout (2, 1, 1) has 3 dims but the tensor has "
        "shape [8, 8]; give one entry per tensor dim"
        in message
    ), message
