"""A Hugging Face mixture-of-experts model (Mixtral: top-2 routing over 4 experts with the
router's auxiliary loss, grouped-query attention, a padded attention mask) under semi_auto with
no annotation on 2 simulated ranks: with ``experts_implementation="batched_mm"`` the loss and
every gradient equal one device's; with transformers' default experts (``F.grouped_mm``, whose
fake kernel refuses float32) the first call is a `CaptureError` naming the fix."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.planner import CaptureError
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from .test_hf_masks import loss_of

pytestmark = pytest.mark.usefixtures("one_thread")


def mixtral(experts: str | None) -> nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import MixtralConfig, MixtralForCausalLM

    extra = {} if experts is None else {"experts_implementation": experts}
    cfg = MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
        **extra,
    )
    torch.manual_seed(0)
    model: nn.Module = MixtralForCausalLM(cfg)
    return model


def step_of(net: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def step(a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        loss = loss_of(net, a, m)
        loss.backward()
        return loss

    return step


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    return ids, mask


def test_mixtral_with_batched_experts_matches_one_device() -> None:
    ids, mask = _data()
    ref = mixtral("batched_mm")
    want = loss_of(ref, ids, mask)
    want.backward()
    net = mixtral("batched_mm")
    with simulated_world(2) as world:
        world.replicate(net)

        with CommRecorder() as rec:
            got = sw.AutoParallel(step_of(net), parallel_mode="semi_auto")(
                world.rows(ids), world.rows(mask)
            )
        assert_matches_single_device(got, want.detach(), what="loss")
        grads = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
        want_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        assert grads.keys() == want_grads.keys()
        assert_matches_single_device(grads, want_grads, what="grads")
    pair = (0, 1)
    assert rec.kinds() == Counter(
        {
            # the padding mask (its causal mask is built whole), the router's expert choices
            # and weights (scatter_add: the load-balancing loss counts every token)
            ("AllGather", "forward", pair): 3,
            ("AllReduce", "forward", pair): 3,  # the loss (a weighted mean) and the aux loss's
            ("AllReduce", "backward", pair): 3,  # two adjoints, the one gradient bucket
        }
    ), rec.summary()


def test_mixtral_with_grouped_experts_names_the_fix() -> None:
    ids, mask = _data()
    net = mixtral(None)
    with simulated_world(2) as world:
        world.replicate(net)

        with pytest.raises(CaptureError, match="experts_implementation='batched_mm'"):
            sw.AutoParallel(step_of(net), parallel_mode="semi_auto")(
                world.rows(ids), world.rows(mask)
            )
