"""torch's own transformer layers (``nn.TransformerEncoder``) under semi_auto, as torch's
tutorials write them: a causal mask passed with ``is_causal=True``, batch-first layers.

With Megatron annotations on each layer's feed-forward (``linear1`` column-, ``linear2``
row-parallel at dp 2 x mp 2), the next layer's ``F.multi_head_attention_forward`` received the
batch split over (dp, mp) (the row-parallel output's partial sums reduced onto rows), which no
rule runs its head-merging view on: planning failed with a ``PlanError`` (a ``_StridedShard``
that cannot unflatten) whose fix asked for divisible dims. An unannotated op no rule runs as its
inputs are placed now falls back to each dim's outer axis (the batch over dp: one AllGather over
mp), then to data parallel (`planner/_follow._Follow._cheaper`).

``nn.Transformer`` under sharding propagation: a plan holding the embedding's output split on
its features fails torch's Python check of ``src.size(-1)``; the error names those blocks.
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


class Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D)
        self.tr = nn.Transformer(D, 2, 1, 1, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(D, V)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        o = self.tr(self.emb(x), self.emb(t))
        return F.cross_entropy(self.head(o).reshape(-1, V), t.reshape(-1))


def _propagated(x: torch.Tensor, t: torch.Tensor, annotate_embedding: bool) -> torch.Tensor:
    """The loss of `Seq2Seq`'s first step under sharding propagation on 4 ranks (dp 2 x mp 2),
    each layer's feed-forward Megatron-annotated (and the embedding kept whole on features)."""
    net = Seq2Seq()
    with simulated_world(4) as world:
        world.replicate(net)
        for layer in [*net.tr.encoder.layers, *net.tr.decoder.layers]:
            sw.shard(layer.linear1, in_strategy=((2, 1), (2, 1)))
            sw.shard(layer.linear2, in_strategy=((2, 2), (1, 2)))
        if annotate_embedding:
            sw.shard(net.emb, in_strategy=((2, 1), (1, 1)))

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = net(a, b)
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="sharding_propagation")
        loss: torch.Tensor = parallel(world.rows(x), world.rows(t))
        return loss


def test_transformer_feature_split_by_propagation_is_named() -> None:
    """Sharding propagation splits the embedding's output over mp on its features (the
    cheapest plan of the captured ops), but nn.Transformer.forward compares src.size(-1) with
    d_model in Python: torch's error was raised bare. Its note now names the values held as
    blocks and the fix, and the fix it gives (the embedding annotated) trains as one device."""
    g = torch.Generator().manual_seed(1)
    x, t = torch.randint(0, V, (8, 6), generator=g), torch.randint(0, V, (8, 5), generator=g)
    want = Seq2Seq()(x, t).detach()
    with pytest.raises(RuntimeError, match="d_model") as raised:
        _propagated(x, t, annotate_embedding=False)
    note = "\n".join(getattr(raised.value, "__notes__", []))
    assert "emb/embedding's output (%0): block [4, 6, 8] of the global [8, 6, 16]" in note
    assert "emb/embedding_1's output (%1): block [4, 5, 8] of the global [8, 5, 16]" in note
    assert "dim 2 over g1" in note and "dim 0" not in note  # (the batch rows: not named)
    assert "sw.shard(net.emb" in note and "parallel_mode='semi_auto'" in note
    assert_matches_single_device(_propagated(x, t, annotate_embedding=True), want, what="loss")


class CheckedMlp(nn.Module):
    """Megatron fc1 (column) / fc2 (row) whose forward checks fc1's output width in Python:
    on a rank it sees the block's."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 4)
        sw.shard(self.a, in_strategy=((2, 1), (2, 1)))
        sw.shard(self.b, in_strategy=((2, 2), (1, 2)))

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.size(-1) != 8:
            raise ValueError(f"features {h.size(-1)}")
        return (self.b(h) * w).sum()


@pytest.mark.parametrize("rows", [8, 16])
def test_the_note_keeps_the_error_with_a_0d_input_and_a_width_equal_to_the_batch(
    rows: int,
) -> None:
    """The user's error leaves with the note also when the step takes a 0-d tensor (the note
    read every input's dim 0) and when the split width equals the batch (it was taken for the
    batch rows); the executor is off the mode stack afterwards."""
    net, x = CheckedMlp(), torch.randn(rows, 4)
    with simulated_world(4) as world:
        world.replicate(net)

        def step(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(a, w)
            loss.backward()
            return loss

        with pytest.raises(ValueError, match="features 4") as raised:
            sw.AutoParallel(step, parallel_mode="semi_auto")(world.rows(x), torch.tensor(0.5))
    note = "\n".join(getattr(raised.value, "__notes__", []))
    assert f"a/linear's output (%0): block [{rows // 2}, 4] of the global [{rows}, 8]" in note
    assert "dim 1 over" in note
    assert torch.equal(torch.ones(2) * 2, torch.full((2,), 2.0))  # (no executor left running)
