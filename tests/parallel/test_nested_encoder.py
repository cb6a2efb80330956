"""torch's ``nn.TransformerEncoder`` on its nested-tensor path, under semi_auto.

On one device an encoder with ``enable_nested_tensor=True`` (torch's default), in eval mode,
given a ``src_key_padding_mask`` without autograd to record (``torch.no_grad()``, or frozen
weights) packs the unpadded tokens into a nested tensor: its output at padded positions is 0.
The capture and the run call torch under a torch-function mode, which turns torch away from
that path, so they kept the ordinary path's values there and a loss pooling over every position
differed from one device's (0.99999 instead of 0.91666 in the probe). Now such a call zeroes the
padded positions with ops the plan carries out (`parallel/_nested_encoders`), as torch does:
only when every row of the whole batch has its kept tokens first (else torch takes the ordinary
path), or each row's first kept-count tokens with ``mask_check=False``. A lone
``nn.TransformerEncoderLayer`` takes its own fast path on one device, whose values are the
ordinary path's: it matched already and is checked here too.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

pytestmark = pytest.mark.usefixtures("one_thread")

B, T, D = 4, 6, 8
g = torch.Generator().manual_seed(1)
X = torch.randn(B, T, D, generator=g)
LEFT = torch.zeros(B, T, dtype=torch.bool)  # (rank 0: rows 0-1, rank 1: rows 2-3)
LEFT[1, -2:] = True
LEFT[3, -1:] = True
UNALIGNED = LEFT.clone()
UNALIGNED[2, 1] = True  # (rank 1's row 2 padded in the middle: no row is packed)
PADDINGS = {"left aligned": LEFT, "not left aligned": UNALIGNED}


def build(mask_check: bool = True, norm: bool = False) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
    final = nn.LayerNorm(D) if norm else None
    return nn.TransformerEncoder(layer, 2, norm=final, mask_check=mask_check)


def evaluate(net: nn.Module, x: torch.Tensor, pad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    net.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's nested tensors are a prototype)
        out = net(x, src_key_padding_mask=pad)
    return out.pow(2).mean(), out


def on_ranks(net: nn.Module, mode: str, pad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The loss and output of `evaluate` wrapped in `mode` on 2 simulated ranks; and one
    device's."""
    want = evaluate(net, X, pad)
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(lambda x, p: evaluate(net, x, p), parallel_mode=mode)
        loss, out = parallel(world.rows(X), world.rows(pad))
        assert_matches_single_device(loss, want[0], what="loss")
        assert_matches_single_device(out, world.rows(want[1]), what="output")
    return want


@pytest.mark.parametrize("mode", ["semi_auto", "sharding_propagation"])
@pytest.mark.parametrize("padding", sorted(PADDINGS))
def test_nested_encoder_evaluates_as_one_device(mode: str, padding: str) -> None:
    pad = PADDINGS[padding]
    _, out = on_ranks(build(norm=mode == "sharding_propagation"), mode, pad)
    if mode == "semi_auto":  # (no norm: one device's zeros, where torch packed)
        assert bool((out[pad] == 0).all()) is (padding == "left aligned")


def test_unchecked_padding_is_packed_as_torch_packs_it() -> None:
    _, out = on_ranks(build(mask_check=False), "semi_auto", UNALIGNED)
    assert bool((out[2, 5] == 0).all())  # (row 2 keeps its first 5 tokens: the 6th is zero)


def test_frozen_encoder_in_a_train_step_matches_one_device() -> None:
    """Frozen weights: no autograd to record even with gradients on, so torch packs."""

    def model() -> nn.Sequential:
        net = nn.Sequential()
        net.enc = build()
        net.enc.requires_grad_(False).eval()
        torch.manual_seed(1)
        net.head = nn.Linear(D, 3)
        return net

    def loss_of(net: nn.Sequential, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            h = net.enc(x, src_key_padding_mask=pad)
        return net.head(h).pow(2).mean()

    single = model()
    want = loss_of(single, X, LEFT)
    want.backward()
    net = model()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
            loss = loss_of(net, x, pad)
            loss.backward()
            return loss

        loss = sw.AutoParallel(step, parallel_mode="semi_auto")(world.rows(X), world.rows(LEFT))
        assert_matches_single_device(loss, want.detach(), what="loss")
        grads = {n: p.grad for n, p in net.head.named_parameters()}
        wants = {n: p.grad for n, p in single.head.named_parameters()}
        assert_matches_single_device(grads, wants, what="head grads")


def test_encoder_layer_fast_path_matches_one_device() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
    on_ranks(layer, "semi_auto", LEFT)
