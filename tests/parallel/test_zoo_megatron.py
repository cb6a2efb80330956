"""Megatron-style tensor parallel on plain-torch GPT-2 and Llama, annotated the MindSpore way.

``sw.shard(block.attn.c_attn, in_strategy=((dp, 1), (mp, 1)))`` (the op form: one entry per
tensor of ``F.linear``, read as ``MatMul(transpose_b=True)``) makes each block's ``c_attn`` and
``mlp.c_fc`` column parallel and ``((dp, mp), (1, mp))`` its two ``c_proj`` row parallel,
without touching the model's code (`tests/zoo.py`'s nanoGPT, AdamW with decay / no-decay
groups). Every other op runs data parallel, as semi_auto says.

Two training steps equal one device on the global batch: the loss and every gradient (each
rank's block of it), 1e-5 relative, on 2 (1 x 2), 4 (2 x 2) and 8 (2 x 4) simulated ranks, and
with optimizer parallel (hsdp levels 1-3) on 4. The collectives are asserted exactly (with
hsdp: `hsdp_kinds`), per layer (over the mp axis):

- forward: 2 AllGathers (the residual stream's rows gathered for ``c_attn`` and for ``c_fc``,
  which take the rows over dp only), 2 AlltoAlls (``split(n_embd, dim=2)`` cannot keep
  ``c_attn``'s columns split, as q, k and v each span every mp rank's columns, so attention
  takes semi_auto's data-parallel strategy: columns -> rows over dp x mp, and back to columns
  for ``c_proj``; this moves fewer bytes than gathering the columns) and 2 ReduceScatters (the
  partial outputs of the row-parallel ``c_proj``, summed where the residual add consumes
  them with its rows cut over dp x mp: each rank receives the sum of its rows only, half an
  AllReduce's bytes: `planner/_scatter.py`); the biases of ``c_proj`` are added on the first
  mp rank only, no collective;
- backward: their adjoints (2 ReduceScatters, 2 AlltoAlls, 2 AllGathers);
- per step: the loss's AllReduce over all ranks, and one gradient bucket per group of
  replicas (the whole parameters over all ranks, the mp-split ones over dp).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..cached import outside_worlds
from ..optim.test_hsdp import shard_of
from ..zoo import GPT2, CausalSelfAttention, GPT2Config, Llama, recording_step, token_batches

STEPS, BATCH = 2, 8
ADAM = {"lr": 1e-4, "eps": 1e-6}
LAYERS = GPT2Config().n_layer


pytestmark = pytest.mark.usefixtures("one_thread")


def megatron(net: GPT2, dp: int, mp: int) -> GPT2:
    """Column-parallel c_attn / c_fc, row-parallel c_proj, in every block."""
    for block in net.transformer.h:
        sw.shard(block.attn.c_attn, in_strategy=((dp, 1), (mp, 1)))
        sw.shard(block.attn.c_proj, in_strategy=((dp, mp), (1, mp)))
        sw.shard(block.mlp.c_fc, in_strategy=((dp, 1), (mp, 1)))
        sw.shard(block.mlp.c_proj, in_strategy=((dp, mp), (1, mp)))
    return net


def megatron_llama(net: Llama, dp: int, mp: int) -> Llama:
    """Column-parallel wq / wk / wv / w1 / w3, row-parallel wo / w2, in every block."""
    for block in net.layers:
        for m in (block.wq, block.wk, block.wv, block.w1, block.w3):
            sw.shard(m, in_strategy=((dp, 1), (mp, 1)))
        for m in (block.wo, block.w2):
            sw.shard(m, in_strategy=((dp, mp), (1, mp)))
    return net


def test_megatron_llama_matches_one_device() -> None:
    """The Llama (RMSNorm, rotary, grouped-query attention, SwiGLU) at 2 x 2: q, k and v stay
    split by heads from their projections through rotary, ``repeat_interleave`` and attention
    to ``wo`` (no collective inside attention). Per layer over mp: 2 AllGathers forward (the
    rows gathered once for wq / wk / wv, once for w1 / w3: the later consumers reuse the moved
    value) and 2 ReduceScatters (wo, w2: summed to rows), and their adjoints backward."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (BATCH, 16), generator=g)
    y = torch.randint(0, 64, (BATCH, 16), generator=g)
    ref = Llama()
    want = ref(x, y)[1]
    assert want is not None
    want.backward()
    net = megatron_llama(Llama(), 2, 2)
    with simulated_world(4) as world:
        world.replicate(net)
        grads: dict[str, torch.Tensor] = {}

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = net(a, b)[1]
            assert loss is not None
            loss.backward()
            grads.update({n: p.grad.detach().clone() for n, p in net.named_parameters()})
            return loss

        parallel = sw.AutoParallel(step)
        with CommRecorder() as rec:
            loss = parallel(world.rows(x), world.rows(y))
        assert_matches_single_device(loss, want.detach(), what="loss")
        for name, p in ref.named_parameters():
            assert p.grad is not None
            assert_matches_single_device(
                grads[name], block_of(parallel, name, p.grad), what=f"{name}.grad"
            )
        layers = len(net.layers)
        want_kinds = per_layer(2, 2)
        assert layers == LAYERS
        del want_kinds[("AlltoAll", "forward", (0, 1))]  # (heads stay split: no AlltoAll)
        del want_kinds[("AlltoAll", "backward", (0, 1))]
        assert rec.kinds() == want_kinds, rec.summary()


@outside_worlds
def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return token_batches(STEPS, BATCH)


@outside_worlds
def reference() -> list[tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """Per step on one device: the loss, every gradient, every parameter after the step."""
    net = GPT2()
    opt = net.configure_optimizers(weight_decay=0.1, **ADAM)
    out = []
    for x, y in batches():
        loss = net(x, y)[1]
        assert loss is not None
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in net.named_parameters()}
        opt.step()
        opt.zero_grad()
        params = {n: p.detach().clone() for n, p in net.named_parameters()}
        out.append((loss.detach(), grads, params))
    return out


def block_of(
    parallel: sw.AutoParallel, name: str, full: torch.Tensor
) -> Callable[[int], torch.Tensor]:
    """rank -> its block of the single-device `full` (the stored layout of parameter `name`)."""
    plan = parallel.parallel_plan
    assert plan is not None
    layout = plan.params[name].layout
    return lambda r: full[layout.local_index(r, tuple(full.shape))]  # (strided: an index list)


def per_layer(dp: int, mp: int) -> Counter[tuple[str, str, tuple[int, ...]]]:
    """The exact collectives of one step (see the module docstring); groups hold rank 0."""
    world = tuple(range(dp * mp))
    mp_group, dp_group = tuple(range(mp)), tuple(range(0, dp * mp, mp))
    want: Counter[tuple[str, str, tuple[int, ...]]] = Counter(
        {
            ("AllGather", "forward", mp_group): 2 * LAYERS,
            ("AlltoAll", "forward", mp_group): 2 * LAYERS,
            ("ReduceScatter", "forward", mp_group): 2 * LAYERS,
            ("ReduceScatter", "backward", mp_group): 2 * LAYERS,
            ("AlltoAll", "backward", mp_group): 2 * LAYERS,
            ("AllGather", "backward", mp_group): 2 * LAYERS,
        }
    )
    want[("AllReduce", "forward", world)] += 1  # the loss
    want[("AllReduce", "backward", world)] += 1  # the whole parameters' gradient bucket
    if dp > 1:
        want[("AllReduce", "backward", dp_group)] += 1  # the mp-split ones, over dp
    return want


def train_and_check(world: Any, net: nn.Module, want: Any, kinds: Counter[Any]) -> Any:
    """Train `net` in semi_auto for the reference's steps: each step's loss and every gradient
    (this rank's block) equal one device's, and its collectives are exactly `kinds`."""
    world.replicate(net)
    opt = net.configure_optimizers(weight_decay=0.1, **ADAM)
    seen: list[dict[str, torch.Tensor]] = []
    step = recording_step(net, opt, lambda m, x, y: m(x, y)[1], seen)
    parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
    for s, (x, y) in enumerate(batches()):
        with CommRecorder() as rec:
            loss = parallel(world.rows(x), world.rows(y))
        assert_matches_single_device(loss, want[s][0], what=f"loss {s}")
        assert set(seen[s]) == set(want[s][1])
        for name, grad in seen[s].items():
            full = want[s][1][name]
            assert_matches_single_device(
                grad, block_of(parallel, name, full), what=f"step {s} {name}.grad"
            )
        assert rec.kinds() == kinds, rec.summary()
    return parallel


@pytest.mark.parametrize(("dp", "mp"), [(1, 2), (2, 2), (2, 4)])
def test_megatron_gpt2_matches_one_device(dp: int, mp: int) -> None:
    want = reference()
    net = megatron(GPT2(), dp, mp)
    with simulated_world(dp * mp) as world:
        parallel = train_and_check(world, net, want, per_layer(dp, mp))
        plan = parallel.parallel_plan
        assert plan is not None
        # the annotated weights are stored as their strategies split them
        c_attn, c_proj = (f"transformer.h.0.attn.{m}.weight" for m in ("c_attn", "c_proj"))
        assert plan.params[c_attn].layout.local_shape((96, 32)) == (96 // mp, 32)
        assert plan.params[c_proj].layout.local_shape((32, 32)) == (32, 32 // mp)
        assert tuple(net.transformer.h[0].attn.c_attn.weight.shape) == (96 // mp, 32)
        node = next(n for n in plan.nodes if n.name == "transformer.h.0.attn.c_attn/linear")
        assert node.rule == "user"


def hsdp_kinds(level: str) -> Counter[tuple[str, str, tuple[int, ...]]]:
    """The exact collectives of one hsdp step at 2 x 2: the tensor-parallel ones of the plain
    run, and instead of its two gradient AllReduces, per bucket (the whole parameters over all
    4 ranks, the mp-split ones over dp) one AllGather forward and one ReduceScatter (at the
    optimizer's step for level 1, in backward for levels 2-3), level 3 gathering again in
    backward."""
    want = per_layer(2, 2)
    world, dp_group = (0, 1, 2, 3), (0, 2)
    reduce_phase = "step" if level == "level1" else "backward"
    for group in (world, dp_group):
        del want[("AllReduce", "backward", group)]
        want[("AllGather", "forward", group)] += 1
        want[("ReduceScatter", reduce_phase, group)] += 1
        if level == "level3":
            want[("AllGather", "backward", group)] += 1
    return want


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_megatron_gpt2_with_optimizer_parallel(level: str) -> None:
    """hsdp on top of 2 x 2 tensor parallel: each parameter block sharded over its dp
    replicas (threshold 0); the loss, every gradient (the shard each rank updates, read after
    ``opt.step()``: level 1 reduces at the step) and every updated parameter equal one
    device's, and the collectives are exactly `hsdp_kinds`."""
    want, steps = reference(), batches()
    net = megatron(GPT2(), 2, 2)
    with simulated_world(4) as world:
        world.replicate(net)
        opt = net.configure_optimizers(weight_decay=0.1, **ADAM)
        grads: list[dict[str, torch.Tensor]] = []

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = net(x, y)[1]
            assert loss is not None
            loss.backward()
            opt.step()
            grads.append({n: p.grad.detach().clone() for n, p in net.named_parameters()})
            opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step).hsdp(threshold=0, optimizer_level=level)
        for s, (x, y) in enumerate(steps):
            with CommRecorder() as rec:
                loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want[s][0], what=f"loss {s}")
            plan = parallel.optimizer_plan
            assert plan is not None and len(plan.buckets) == 2
            for name, p in net.named_parameters():
                assert_matches_single_device(
                    grads[s][name], shard_of(parallel, name, want[s][1][name]), what=f"{name}.grad"
                )
                full = want[s][2][name]
                assert_matches_single_device(
                    p.detach(), shard_of(parallel, name, full), what=f"step {s} {name}"
                )
            assert rec.kinds() == hsdp_kinds(level), rec.summary()


# docs/ops.md: attention annotated by wrapping the function (batch over dp, heads over mp)
SDPA_2X2 = sw.shard(F.scaled_dot_product_attention, in_strategy=((2, 2, 1, 1),) * 3)


class HeadsSplitAttention(CausalSelfAttention):
    """nanoGPT's attention with one line changed: `SDPA_2X2` called in place of
    ``F.scaled_dot_product_attention``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        y = SDPA_2X2(q, k, v, is_causal=True, dropout_p=0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        out: torch.Tensor = self.resid_dropout(self.c_proj(y))
        return out


@pytest.mark.parametrize("qkv", ["plain", "strided"])
def test_megatron_gpt2_with_sdpa_function_form(qkv: str) -> None:
    """``sw.shard(F.scaled_dot_product_attention, in_strategy=((dp, mp, 1, 1),) * 3)`` in every
    block at 2 x 2, on the Megatron annotation: loss and every gradient equal one device's.
    With the plain column-parallel ``c_attn`` the heads are not split where attention starts:
    per layer, q, k and v each move rows -> heads (3 AlltoAlls after the split's
    columns -> rows, 4 in all), and ``c_proj`` then reads the heads as its columns (none
    there): 4 AlltoAlls a layer instead of 2, each way. With ``c_attn`` strided (the fused
    projection's heads split, tests/parallel/test_fused_qkv.py) they already are: no AlltoAll."""
    want = reference()
    net = megatron(GPT2(), 2, 2)
    layout = sw.Layout((2, 2), ("dp", "mp"))
    for block in net.transformer.h:
        if qkv == "strided":  # q, k and v each split by heads over mp
            strided = (layout("dp", "None"), layout(sw.strided("mp", 3), "None"))
            sw.shard(block.attn.c_attn, in_strategy=strided)
        block.attn.__class__ = HeadsSplitAttention  # (the one-line change, on the same weights)
    kinds = per_layer(2, 2)
    for phase in ("forward", "backward"):
        kinds[("AlltoAll", phase, (0, 1))] = 4 * LAYERS if qkv == "plain" else 0
    with simulated_world(4) as world:
        train_and_check(world, net, want, +kinds)


@pytest.mark.parametrize(("mp", "summed"), [(2, "AllReduce"), (4, "ReduceScatter")])
def test_megatron_gpt2_full_batch_of_rows_dp_alone_divides(mp: int, summed: str) -> None:
    """Under ``"full_batch"`` at 2 x mp, a global batch of 6 rows divides by dp but not by the
    devices: the inputs are kept whole (a warning) and c_attn / c_fc still take their 3 rows
    over dp. At mp = 2 each row-parallel c_proj's partial output, which the next layer norm
    would have cut to 3 rows over 2 mp ranks (a ReduceScatter onto uneven rows: a PlanError),
    is summed whole over mp instead (an AllReduce); at mp = 4 it is cut on the sequence (a
    ReduceScatter), and the head's view merging rows and sequence, split on different axes,
    takes the sequence whole first (a PlanError before). The loss and every gradient equal
    one device's."""
    x, y = token_batches(1, 6)[0]
    ref = GPT2()
    want = ref(x, y)[1]
    assert want is not None
    want.backward()
    net = megatron(GPT2(), 2, mp)
    with simulated_world(2 * mp) as world:
        world.replicate(net)
        seen: list[dict[str, torch.Tensor]] = []
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        step = recording_step(net, opt, lambda m, a, b: m(a, b)[1], seen)
        parallel = sw.AutoParallel(step).dataset_strategy("full_batch")
        warned = rf"6 rows\) cannot be split over {2 * mp} devices"
        with CommRecorder() as rec, pytest.warns(UserWarning, match=warned):
            loss = parallel(world.same(x), world.same(y))
        assert_matches_single_device(loss, want.detach(), what="loss")
        for name, p in ref.named_parameters():
            assert p.grad is not None
            assert_matches_single_device(
                seen[0][name], block_of(parallel, name, p.grad), what=f"{name}.grad"
            )
        mp_group = tuple(range(mp))
        other = "ReduceScatter" if summed == "AllReduce" else "AllReduce"
        assert rec.kinds()[(summed, "forward", mp_group)] == 2 * LAYERS, rec.summary()
        assert rec.kinds()[(other, "forward", mp_group)] == 0, rec.summary()
