"""nanoGPT's GPT-2 in plain torch: a real model shape users bring as their own `nn.Module`.

Nothing here uses shardwise: it is the network a user writes, built at any size (tests use tiny
ones; ``examples/gpt2.py`` plans GPT-2 small for 1,024 devices with ``shardwise plan``).

- `GPT2Config`: vocabulary, context length, depth, heads, width, dropout, biases.
- `GPT2`: pre-LayerNorm blocks (`Block`: `CausalSelfAttention` with one fused ``c_attn`` split
  into q, k, v and ``F.scaled_dot_product_attention(is_causal=True)``; `MLP` with GELU), the
  head's weight tied to the token embedding, nanoGPT's init, and ``configure_optimizers``
  (AdamW with decay / no-decay groups).

The constructor seeds torch's global RNG with its ``seed`` argument before drawing initial
values, so two calls with the same arguments build identical networks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

Output = tuple[torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class GPT2Config:
    """Sizes of `GPT2`: vocabulary, context length, depth, heads, width, dropout, biases."""

    vocab_size: int = 64
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused projection for q, k, v, SDPA, output
    projection, residual dropout."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd {cfg.n_embd} does not divide into {cfg.n_head} heads")
        self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        out: torch.Tensor = self.resid_dropout(self.c_proj(y))
        return out


class MLP(nn.Module):
    """GPT-2's feed-forward: 4x wider, GELU, back, dropout."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.dropout(self.c_proj(self.gelu(self.c_fc(x))))
        return out


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT2(nn.Module):
    """nanoGPT's GPT-2: token + position embeddings, dropout, `Block`s, final LayerNorm, and a
    head whose weight is the token embedding's (tied).

    ``forward(idx, targets=None)``: ``idx`` int64 ``[B, T]`` with ``T <= block_size``. With
    targets (``[B, T]``, -1 = ignored) it returns the logits of every position ``[B, T, V]``
    and the mean cross entropy; without, as nanoGPT at inference, the logits of the last
    position only (``[B, 1, V]``) and None.
    """

    def __init__(self, cfg: GPT2Config | None = None, seed: int = 0, **sizes: Any) -> None:
        super().__init__()
        cfg = cfg if cfg is not None else GPT2Config(**sizes)
        self.config = cfg
        torch.manual_seed(seed)
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(cfg.vocab_size, cfg.n_embd),
                "wpe": nn.Embedding(cfg.block_size, cfg.n_embd),
                "drop": nn.Dropout(cfg.dropout),
                "h": nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                "ln_f": nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            }
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = cast(nn.Embedding, self.transformer["wte"]).weight  # tied
        self.apply(self._init_weights)
        # residual projections scaled down by depth (GPT-2 paper)
        scaled = 0.02 / math.sqrt(2 * cfg.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=scaled)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Output:
        seq = idx.size(1)
        if seq > self.config.block_size:
            raise ValueError(f"sequence of {seq} tokens, block_size is {self.config.block_size}")
        pos = torch.arange(seq, dtype=torch.long, device=idx.device)
        t = self.transformer
        x = t["drop"](t["wte"](idx) + t["wpe"](pos))
        for block in cast(nn.ModuleList, t["h"]):
            x = block(x)
        x = t["ln_f"](x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits: torch.Tensor = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(
        self,
        weight_decay: float,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ) -> torch.optim.AdamW:
        """AdamW with two groups: matrices and embeddings (dim >= 2) decay, biases and
        LayerNorm weights (dim < 2) do not. The tied head / embedding weight appears once."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
