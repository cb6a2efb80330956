"""torch's own transformer layers (``nn.TransformerEncoder``) under semi_auto, as torch's
tutorials write them: a causal mask passed with ``is_causal=True``, batch-first layers.

With Megatron annotations on each layer's feed-forward (``linear1`` column-, ``linear2``
row-parallel at dp 2 x mp 2), the next layer's ``F.multi_head_attention_forward`` received the
batch split over (dp, mp) (the row-parallel output's partial sums reduced onto rows), which no
rule runs its head-merging view on: planning failed with a ``PlanError`` (a ``_StridedShard``
that cannot unflatten) whose fix asked for divisible dims. An unannotated op no rule runs as its
inputs are placed now falls back to each dim's outer axis (the batch over dp: one AllGather over
mp), then to data parallel (`planner/_follow._Follow._cheaper`).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..zoo import assert_grad_blocks_match

pytestmark = pytest.mark.usefixtures("one_thread")

V, D = 20, 16


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        h = self.enc(self.emb(x), mask, is_causal=True)
        out: torch.Tensor = self.head(h.mean(1))
        return out


def _megatron(net: Encoder) -> None:
    for layer in net.enc.layers:
        sw.shard(layer.linear1, in_strategy=((2, 1), (2, 1)))
        sw.shard(layer.linear2, in_strategy=((2, 2), (1, 2)))


@pytest.mark.parametrize("megatron", [False, True])
def test_transformer_encoder_matches_one_device(megatron: bool) -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (8, 8), generator=g), torch.randint(0, 3, (8,), generator=g)
    single = Encoder()
    want = F.cross_entropy(single(x), y)
    want.backward()
    net = Encoder()
    ranks = 4 if megatron else 2
    if megatron:
        _megatron(net)
    with simulated_world(ranks) as world:
        world.replicate(net)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(net(a), b)
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        with CommRecorder() as rec:
            loss = parallel(world.rows(x), world.rows(y))
        assert_matches_single_device(loss, want.detach(), what="loss")
        assert_grad_blocks_match(parallel, net, single)
        plan = parallel.parallel_plan
        mha = [n for n in plan.nodes if n.op.endswith("multi_head_attention_forward")]
        assert len(mha) == 2 and all(n.rule != "replicate" for n in mha), plan
    everyone = tuple(range(ranks))
    if not megatron:  # (the loss, one gradient bucket)
        want_kinds = {("AllReduce", "forward", everyone): 1, ("AllReduce", "backward", everyone): 1}
    else:  # per layer, over mp: the attention's input to dp rows, linear1's input, linear2's
        # partial sums summed to rows (ReduceScatter); their backward twins; over dp: the
        # replicated parameters' bucket
        mp = (0, 1)
        want_kinds = {
            ("AllGather", "forward", mp): 4,
            ("ReduceScatter", "forward", mp): 2,
            ("ReduceScatter", "backward", mp): 4,
            ("AllGather", "backward", mp): 2,
            ("AllReduce", "backward", (0, 2)): 1,
            ("AllReduce", "forward", everyone): 1,
            ("AllReduce", "backward", everyone): 1,
        }
    assert rec.kinds() == Counter(want_kinds), rec.summary()
