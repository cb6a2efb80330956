"""Reference networks written with shardwise primitives, for parity tests and benchmarks.

- `GPTBlock`: a one-block GPT language model (vocab-parallel embedding, causal multi-head
  attention with BatchMatMul / Softmax / Dropout, a GeLU MLP, two LayerNorms, a head and the
  loss), every primitive sharded Megatron-style over a ``dp x mp`` device grid
  (`megatron_strategies`). Called with token ids ``[B, S]`` and one-hot targets
  ``[B * S, V]``; returns the mean cross entropy.
- `gpt_batches`: deterministic token batches for it.

Single-device semantics do not depend on the strategies: the same seed gives the same network
with any ``dp`` / ``mp``, so one single-device run is the reference for every strategy set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from shardwise import ops


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of `GPTBlock` (vocab, sequence, hidden, heads, MLP width) and dropout keep prob."""

    vocab: int = 64
    seq: int = 8
    hidden: int = 32
    heads: int = 4
    ffn: int = 64
    keep_prob: float = 0.9


def megatron_strategies(dp: int, mp: int) -> dict[str, tuple[tuple[int, ...], ...]]:
    """The Megatron-style strategy of every primitive of `GPTBlock` on a ``dp x mp`` grid.

    Embedding rows split over mp and the ids' batch over dp (MindSpore's split-batch Gather
    ``((mp, 1), (dp, 1))``: a masked lookup of this dp group's ids + AllReduce over mp); Q/K/V
    and the MLP's first matmul column-parallel (heads / ffn columns over mp); the attention
    output and the MLP's second matmul row-parallel (AllReduce over mp); attention per (batch
    over dp, heads over mp); the rest data parallel over dp (and over dp * mp for the loss
    rows).
    """
    n = dp * mp
    return {
        "embed": ((mp, 1), (dp, 1)),
        "add_pos": ((dp, 1, 1), (1, 1)),
        "flatten_tokens": ((dp, 1, 1),),
        "ln1": ((dp, 1), (1,), (1,)),
        "q": ((dp, 1), (1, mp)),
        "k": ((dp, 1), (1, mp)),
        "v": ((dp, 1), (1, mp)),
        "split_heads": ((dp, mp),),
        "to_heads": ((dp, 1, mp, 1),),
        "scores": ((dp, mp, 1, 1), (dp, mp, 1, 1)),
        "scale": ((dp, mp, 1, 1), (1,)),
        "causal": ((dp, mp, 1, 1), (1, 1)),
        "softmax": ((dp, mp, 1, 1),),
        "attn_drop": ((dp, mp, 1, 1),),
        "context": ((dp, mp, 1, 1), (dp, mp, 1, 1)),
        "from_heads": ((dp, mp, 1, 1),),
        "merge_heads": ((dp, 1, mp, 1),),
        "proj": ((dp, mp), (mp, 1)),
        "res1": ((dp, 1), (dp, 1)),
        "ln2": ((dp, 1), (1,), (1,)),
        "fc1": ((dp, 1), (1, mp)),
        "bias1": ((dp, mp), (mp,)),
        "gelu": ((dp, mp),),
        "fc2": ((dp, mp), (mp, 1)),
        "mlp_drop": ((dp, 1),),
        "res2": ((dp, 1), (dp, 1)),
        "head": ((dp, 1), (1, mp)),
        "xent": ((n, 1), (n, 1)),
        "mean": ((n,),),
    }


class GPTBlock(nn.Module):
    """One pre-LayerNorm transformer block with embedding, head and loss (see module docstring).

    Args:
        cfg: the sizes.
        strategies: primitive name -> in_strategy (`megatron_strategies`); None: unannotated.
        seed: parameter initialization seed (independent of the strategies).

    Example:
        >>> net = GPTBlock(GPTConfig(), megatron_strategies(2, 4))
        >>> loss = net(ids, onehot)         # ids [B, S] int64, onehot [B * S, V] float
    """

    def __init__(
        self,
        cfg: GPTConfig = GPTConfig(),
        strategies: dict[str, tuple[tuple[int, ...], ...]] | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        g = torch.Generator().manual_seed(seed)
        h, f, v, s = cfg.hidden, cfg.ffn, cfg.vocab, cfg.seq

        def param(*shape: int, scale: float = 0.1) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=g) * scale)

        self.embedding = param(v, h)
        self.position = param(s, h)
        self.ln1_gamma, self.ln1_beta = nn.Parameter(torch.ones(h)), nn.Parameter(torch.zeros(h))
        self.wq, self.wk, self.wv, self.wo = param(h, h), param(h, h), param(h, h), param(h, h)
        self.ln2_gamma, self.ln2_beta = nn.Parameter(torch.ones(h)), nn.Parameter(torch.zeros(h))
        self.w1, self.b1, self.w2 = param(h, f), param(f), param(f, h)
        self.w_head = param(h, v)
        self.register_buffer("scale_value", torch.tensor([1.0 / math.sqrt(h // cfg.heads)]))
        causal = torch.full((s, s), -1e9).triu(1)  # 0 on and below the diagonal
        self.register_buffer("causal_bias", causal)
        keep = cfg.keep_prob
        prims: dict[str, ops.Primitive] = {
            "embed": ops.Gather(),
            "add_pos": ops.Add(),
            "flatten_tokens": ops.Reshape(),
            "ln1": ops.LayerNorm(1, 1, 1e-5),
            "q": ops.MatMul(),
            "k": ops.MatMul(),
            "v": ops.MatMul(),
            "split_heads": ops.Reshape(),
            "to_heads": ops.Transpose(),
            "scores": ops.BatchMatMul(transpose_b=True),
            "scale": ops.Mul(),
            "causal": ops.Add(),
            "softmax": ops.Softmax(-1),
            "attn_drop": ops.Dropout(keep),
            "context": ops.BatchMatMul(),
            "from_heads": ops.Transpose(),
            "merge_heads": ops.Reshape(),
            "proj": ops.MatMul(),
            "res1": ops.Add(),
            "ln2": ops.LayerNorm(1, 1, 1e-5),
            "fc1": ops.MatMul(),
            "bias1": ops.BiasAdd(),
            "gelu": ops.GeLU(),
            "fc2": ops.MatMul(),
            "mlp_drop": ops.Dropout(keep),
            "res2": ops.Add(),
            "head": ops.MatMul(),
            "xent": ops.SoftmaxCrossEntropyWithLogits(),
            "mean": ops.ReduceMean(),
        }
        for name, prim in prims.items():
            if strategies is not None and name in strategies:
                prim.shard(strategies[name])
            self.add_module(name, prim)

    def op(self, name: str) -> ops.Primitive:
        """The primitive called `name` (see `megatron_strategies` for the names)."""
        found = self.get_submodule(name)
        assert isinstance(found, ops.Primitive)
        return found

    def _attention(self, x: torch.Tensor, batch: int) -> torch.Tensor:
        """x [B * S, H] -> attention output before the projection, [B * S, H]."""
        cfg = self.cfg
        heads, dh, s = cfg.heads, cfg.hidden // cfg.heads, cfg.seq

        def split(t: torch.Tensor) -> torch.Tensor:  # [B*S, H] -> [B, heads, S, dh]
            heads_first: torch.Tensor = self.op("to_heads")(
                self.op("split_heads")(t, (batch, s, heads, dh)), (0, 2, 1, 3)
            )
            return heads_first

        q, k, v = (
            split(self.op("q")(x, self.wq)),
            split(self.op("k")(x, self.wk)),
            split(self.op("v")(x, self.wv)),
        )
        scores = self.op("causal")(
            self.op("scale")(self.op("scores")(q, k), self.scale_value), self.causal_bias
        )
        probs, _ = self.op("attn_drop")(self.op("softmax")(scores))
        ctx = self.op("from_heads")(self.op("context")(probs, v), (0, 2, 1, 3))
        out: torch.Tensor = self.op("merge_heads")(ctx, (batch * s, cfg.hidden))
        return out

    def forward(self, ids: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
        batch = int(ids.shape[0])
        x = self.op("add_pos")(self.op("embed")(self.embedding, ids, 0), self.position)
        x = self.op("flatten_tokens")(x, (batch * self.cfg.seq, self.cfg.hidden))
        h, _, _ = self.op("ln1")(x, self.ln1_gamma, self.ln1_beta)
        x = self.op("res1")(x, self.op("proj")(self._attention(h, batch), self.wo))
        h, _, _ = self.op("ln2")(x, self.ln2_gamma, self.ln2_beta)
        h = self.op("fc2")(
            self.op("gelu")(self.op("bias1")(self.op("fc1")(h, self.w1), self.b1)), self.w2
        )
        h, _ = self.op("mlp_drop")(h)
        x = self.op("res2")(x, h)
        loss, _ = self.op("xent")(self.op("head")(x, self.w_head), onehot)
        out: torch.Tensor = self.op("mean")(loss, 0)
        return out


def gpt_batches(
    cfg: GPTConfig, batch: int, steps: int, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` batches of (ids [batch, seq] int64, one-hot next tokens [batch * seq, vocab])."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g)
        target = tokens[:, 1:].reshape(-1)
        onehot = torch.nn.functional.one_hot(target, cfg.vocab).to(torch.float32)
        out.append((tokens[:, :-1].contiguous(), onehot))
    return out
