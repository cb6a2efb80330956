"""Hugging Face models called with an attention mask, under SDPA attention.

transformers reads a padding mask's values to skip building the mask when nothing is padded,
except while tracing, which it recognizes by a fake tensor: the capture built the mask, a real
call read ``mask.all()`` instead, and the plan could not run ("the network called
torch.Tensor.sum where the plan has ... arange"): HF Llama with ``attention_mask=``, and BART,
whose decoder makes a mask of ones, failed. `shardwise._transformers.same_masks` makes both
build the mask (`tests` below: padded and unpadded masks, parity with one device's plain
transformers run, which takes the shortcut). A cache object passed back
(``past_key_values``: its tensors are no inputs the plan sees) fails with a note naming it.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

pytestmark = pytest.mark.usefixtures("one_thread")


def llama(attn: str = "sdpa", kv_heads: int = 2) -> nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32,
        attn_implementation=attn,
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


@pytest.mark.parametrize(
    ("attn", "kv_heads"),
    [("sdpa", 2), ("sdpa", 4), ("eager", 2)],
    ids=["sdpa-gqa", "sdpa", "eager"],
)
def test_megatron_llama_with_a_padded_mask_keeps_attention_heads_split(
    attn: str, kv_heads: int
) -> None:
    """HF Llama, Megatron-annotated on dp 2 x mp 2, with a padded attention mask: SDPA runs
    with q, k, v split by heads over mp and batch over dp, and the [B, 1, L, L] mask split by
    batch over dp (whole over mp: its head dim is 1). SDPA turns the boolean mask additive
    first (``where(mask, 0., -inf)``, an intermediate of the node); that value wanted split
    like q's batch used to make the node run replicated, so semi_auto's data-parallel strategy
    took it (batch over dp x mp): 4 AlltoAlls per layer forward and 4 backward, where eager
    attention had none. The exact collectives of a step (as eager's), and parity of the loss
    and every gradient (each rank's block) with one device."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (8, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[6, 4:] = 0
    ref = llama(attn, kv_heads)
    want = loss_of(ref, ids, mask)
    want.backward()
    net = llama(attn, kv_heads)
    with simulated_world(4) as world:
        world.replicate(net)
        for layer in net.model.layers:
            a, m = layer.self_attn, layer.mlp
            for column in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):
                sw.shard(column, in_strategy=((2, 1), (2, 1)))
            for row in (a.o_proj, m.down_proj):
                sw.shard(row, in_strategy=((2, 2), (1, 2)))
        grads: dict[str, torch.Tensor] = {}

        def step(x: torch.Tensor, msk: torch.Tensor) -> torch.Tensor:
            loss = loss_of(net, x, msk)
            loss.backward()
            grads.update(
                {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
            )
            return loss

        parallel = sw.AutoParallel(step)
        with CommRecorder() as rec:
            got = parallel(world.rows(ids), world.rows(mask))
        assert_matches_single_device(got, want.detach(), what="loss")
        plan = parallel.parallel_plan
        assert plan is not None
        for name, p in ref.named_parameters():
            assert p.grad is not None
            layout = plan.params[name].layout
            full = p.grad

            def block(r: int, full: torch.Tensor = full, layout: Any = layout) -> torch.Tensor:
                return full[layout.local_index(r, tuple(full.shape))]

            assert_matches_single_device(grads[name], block, what=f"{name}.grad")
        sdpa = [n for n in plan.nodes if "scaled_dot_product_attention" in n.name]
        assert len(sdpa) == (2 if attn == "sdpa" else 0)
        assert not [c for c in plan.collectives() if "AlltoAll" in str(c)], plan
    layers, mp, dp, world4 = 2, (0, 1), (0, 2), (0, 1, 2, 3)
    kinds = Counter(
        {
            # per layer: the rows gathered over mp for q/k/v and gate/up, and the mask's rows
            # gathered whole once (over dp x mp in one AllGather) for the causal-and-padding mask
            ("AllGather", "forward", mp): 2 * layers,
            ("AllGather", "forward", world4): 1,
            ("ReduceScatter", "forward", mp): 2 * layers,  # o_proj, down_proj: summed to rows
            ("AllReduce", "forward", world4): 1,  # the loss
            ("AllGather", "backward", mp): 2 * layers,
            ("ReduceScatter", "backward", mp): 2 * layers,
            ("AllReduce", "backward", dp): 1,  # the mp-split parameters' gradients
            ("AllReduce", "backward", world4): 1,  # the whole ones (norms, embedding, lm_head)
        }
    )
    assert rec.kinds() == kinds, rec.summary()


def test_a_cache_object_passed_back_names_the_argument() -> None:
    """A ``DynamicCache`` (``past_key_values``, ``use_cache=True``) is no tuple, list, dict or
    dataclass: the plan does not take its tensors as inputs, and under ``"full_batch"`` the
    one a call returned holds this rank's rows, so passing it back fails in the capture with
    torch's size error; a note names the argument, the cache's type and the ways out."""
    prompt = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(3))
    net = llama()
    net.eval()
    with simulated_world(2) as world:
        world.replicate(net)
        model = sw.AutoParallel(net).dataset_strategy("full_batch")
        with torch.no_grad():
            out = model(input_ids=world.same(prompt), use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            with pytest.raises(RuntimeError) as raised:
                model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "argument 'past_key_values' (a DynamicCache) holds tensors" in notes, notes
    assert "use_cache=False" in notes and "tuples of tensors" in notes, notes
