"""Strided layouts outside nn.Linear's op form, on nanoGPT's attention (`tests/zoo.py`'s
`CausalSelfAttention`: fused ``c_attn``, ``split(C, dim=2)``, SDPA, ``c_proj``) at dp x mp =
2 x 2 under semi_auto: one step equals one device (loss, every gradient gathered to its full
shape), with the exact collectives.

- ``sw.reshard(qkv, layout("dp", "None", sw.strided("mp", 3)))``: the fused output moves from
  rows to each rank's heads of q, k and v (one AlltoAll into 3 groups), the split keeps them.
- ``parameter_plan`` storing ``c_attn``'s weight and bias strided: the unannotated (data
  parallel) linear gathers them inside each group (an AllGather of a strided layout).
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.planner import ParallelPlan
from shardwise.testing import CommRecorder, simulated_world
from shardwise.testing import assert_matches_single_device as same

from ..zoo import CausalSelfAttention, GPT2Config
from .test_fused_qkv import gathered

LAYOUT = sw.Layout((2, 2), ("dp", "mp"))
WORLD, MP, DP = (0, 1, 2, 3), (0, 1), (0, 2)


class Resharded(CausalSelfAttention):
    """The attention with its fused output resharded to a strided layout before the split."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        qkv = sw.reshard(self.c_attn(x), LAYOUT("dp", "None", sw.strided("mp", 3)))
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in qkv.split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return out


Kinds = Counter[tuple[str, str, tuple[int, ...]]]


def train(attn: CausalSelfAttention, eager: CausalSelfAttention) -> tuple[ParallelPlan, Kinds]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, GPT2Config().block_size, GPT2Config().n_embd, generator=g)
    want = eager(x).square().mean()
    want.backward()
    with simulated_world(4) as world:
        world.replicate(attn)
        seen: dict[str, torch.Tensor] = {}

        def step(a: torch.Tensor) -> torch.Tensor:
            loss = attn(a).square().mean()
            loss.backward()
            seen.update({n: p.grad.detach().clone() for n, p in attn.named_parameters()})
            return loss

        parallel = sw.AutoParallel(step)
        with CommRecorder() as rec:
            same(parallel(world.rows(x)), want.detach(), what="loss")
        plan = parallel.parallel_plan
        assert plan is not None
        for name, p in eager.named_parameters():
            assert p.grad is not None
            got = gathered(world, seen[name], plan.params[name].layout)
            same(got, p.grad, what=f"{name}.grad (gathered)")
    return plan, rec.kinds()


def test_reshard_to_a_strided_layout_keeps_the_heads_split() -> None:
    torch.manual_seed(5)
    eager = Resharded(GPT2Config())
    torch.manual_seed(5)
    plan, kinds = train(Resharded(GPT2Config()), eager)
    split = plan.node("split")
    assert str(split.inputs[0]) == "(g0, None, strided(g1, 3))" and split.rule == "shardwise"
    assert [str(o) for o in split.outputs] == ["(g0, None, g1)"] * 3
    # rows -> heads of q, k, v (one AlltoAll into 3 groups); attention's output -> rows for
    # the data-parallel c_proj; the loss; the whole parameters' gradient bucket
    assert kinds == Counter(
        {
            ("AlltoAll", "forward", MP): 2,
            ("AlltoAll", "backward", MP): 2,
            ("AllReduce", "forward", WORLD): 1,
            ("AllReduce", "backward", WORLD): 1,
        }
    )


def test_parameter_plan_stores_the_weight_strided() -> None:
    cfg = GPT2Config()
    torch.manual_seed(5)
    eager = CausalSelfAttention(cfg)
    torch.manual_seed(5)
    attn = CausalSelfAttention(cfg)
    plan_of = {
        "c_attn.weight": LAYOUT(sw.strided("mp", 3), "None"),
        "c_attn.bias": LAYOUT(sw.strided("mp", 3)),
    }
    sw.shard(attn, in_strategy=None, parameter_plan=plan_of)
    plan, kinds = train(attn, eager)
    assert str(plan.params["c_attn.weight"]) == "(strided(g1, 3), None) float32[96, 32]"
    assert tuple(attn.c_attn.weight.shape) == (48, 32)  # each rank's rows of q, k and v
    assert [str(c) for c in plan.collectives()][:2] == [
        "AllGather over g1 at c_attn/linear input 1",
        "AllGather over g1 at c_attn/linear input 2",
    ]
    # weight and bias gathered in their groups (ReduceScatter back), the loss, the buckets
    # of the whole parameters (over all ranks) and of the strided ones (over dp)
    assert kinds == Counter(
        {
            ("AllGather", "forward", MP): 2,
            ("ReduceScatter", "backward", MP): 2,
            ("AllReduce", "forward", WORLD): 1,
            ("AllReduce", "backward", WORLD): 1,
            ("AllReduce", "backward", DP): 1,
        }
    )
