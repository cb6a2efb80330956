"""Hugging Face models called with an attention mask, under SDPA attention.

transformers reads a padding mask's values to skip building the mask when nothing is padded,
except while tracing, which it recognizes by a fake tensor: the capture built the mask, a real
call read ``mask.all()`` instead, and the plan could not run ("the network called
torch.Tensor.sum where the plan has ... arange"): HF Llama with ``attention_mask=``, and BART,
whose decoder makes a mask of ones, failed. `shardwise._transformers.same_masks` makes both
build the mask (`tests` below: padded and unpadded masks, parity with one device's plain
transformers run, which takes the shortcut).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

pytestmark = pytest.mark.usefixtures("one_thread")


def llama() -> nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model: nn.Module = LlamaForCausalLM(cfg)
    return model


def loss_of(net: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    labels = ids.masked_fill(mask == 0, -100)
    out: torch.Tensor = net(input_ids=ids, attention_mask=mask, labels=labels).loss
    return out


@pytest.mark.parametrize("padded", [False, True], ids=["no padding", "right padding"])
def test_llama_with_an_attention_mask_matches_one_device(padded: bool) -> None:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, 7:] = 0  # (rank 0 of 2 holds the padded row)
    ref = llama()
    want = loss_of(ref, ids, mask)
    want.backward()
    net = llama()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            loss = loss_of(net, a, m)
            loss.backward()
            return loss

        got = sw.AutoParallel(step)(world.rows(ids), world.rows(mask))
        assert_matches_single_device(got, want.detach(), what="loss")
        grads = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
        want_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        assert_matches_single_device(grads, want_grads, what="grads")


def test_the_traced_path_is_taken_and_put_back() -> None:
    """`same_masks` replaces ``transformers.masking_utils.is_tracing`` (fails loudly when
    transformers renames it or stops reading it there); outside the block it is transformers'
    own again."""
    import transformers.masking_utils as mu

    from shardwise._transformers import same_masks

    own = mu.is_tracing
    ones = torch.ones(2, 4, dtype=torch.bool)
    positions = torch.arange(4).expand(2, 4)
    assert own(ones) is False and mu._ignore_causal_mask_sdpa(ones, 4, 4, 0, 0) is True
    assert mu.find_packed_sequence_indices(positions) is None  # (values read: one sequence)
    with same_masks():
        assert mu._ignore_causal_mask_sdpa(ones, 4, 4, 0, 0) is False
        assert mu._ignore_bidirectional_mask_sdpa(ones, 4) is False
        assert mu._ignore_causal_mask_sdpa(None, 4, 4, 0, 0) is True  # (no mask: as before)
        packed = mu.find_packed_sequence_indices(positions)
        assert packed is not None and not packed.any()  # (the traced path: all in sequence 0)
    assert mu.is_tracing is own


def test_megatron_llama_with_a_padded_mask_and_gradient_checkpointing() -> None:
    """HF Llama, q/k/v and gate/up column-parallel, o/down row-parallel on dp 2 x mp 2, a
    padded attention mask and non-reentrant gradient checkpointing: two steps' losses (the
    second after an AdamW step on the first's gradients) equal one device's."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (4, 12), generator=g)
    ids[0, 8:] = 0  # (padding, token 0)

    def step_of(net: nn.Module) -> Any:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

        def step(a: torch.Tensor) -> torch.Tensor:
            loss = loss_of(net, a, (a != 0).long())
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    one = step_of(llama())
    want = [one(ids).detach() for _ in range(2)]
    net = llama()
    with simulated_world(4) as world:
        world.replicate(net)
        for layer in net.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for column in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                sw.shard(column, in_strategy=((2, 1), (2, 1)))
            for row in (attn.o_proj, mlp.down_proj):
                sw.shard(row, in_strategy=((2, 2), (1, 2)))
        parallel = sw.AutoParallel(step_of(net))
        for s in range(2):
            assert_matches_single_device(parallel(world.rows(ids)), want[s], what=f"loss {s}")
