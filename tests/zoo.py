"""Real model shapes in plain torch, for tests: what a user brings as their own `nn.Module`.

Nothing here uses shardwise: these are the networks a user writes (or downloads), at tiny sizes
so tests run fast on 2 CPU cores. Each model's ``forward(x, targets=None)`` returns
``(logits, loss)`` (``loss`` None without targets).

- `GPT2` / `GPT2Config`: nanoGPT's architecture (pre-LayerNorm blocks, one fused ``c_attn``
  split into q, k, v, ``F.scaled_dot_product_attention(is_causal=True)``, GELU MLP, the head's
  weight tied to the token embedding, nanoGPT's init) and ``configure_optimizers`` (AdamW with
  decay / no-decay groups).
- `Llama` / `LlamaConfig` / `LlamaBlock`: RMSNorm, rotary embedding from cos / sin buffers,
  grouped-query attention through SDPA, SwiGLU MLP, no biases.
- `ResNet` / `ResNetConfig` / `BasicBlock`: a CIFAR-style ResNet (3x3 stem, BatchNorm, a max
  pool, stages of basic blocks with 1x1 projection shortcuts, global average pool, Linear).
- `gpt2_hf`: a randomly initialized Hugging Face ``GPT2LMHeadModel`` (transformers, a pinned
  test dependency; imported only when called, offline).
- `token_batches`, `image_batches`: deterministic global batches for them.

Every constructor seeds torch's global RNG with its ``seed`` argument before drawing initial
values, so two calls with the same arguments build identical networks (the single-device
reference and the parallel run each build their own copy). Build them outside a simulated
world: inside, every rank would draw its own values.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Output = tuple[torch.Tensor, torch.Tensor | None]

# ---------------------------------------------------------------------------------------------
# GPT-2 (nanoGPT's architecture)
# ---------------------------------------------------------------------------------------------


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
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """GPT-2's feed-forward: 4x wider, GELU, back, dropout."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


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
        return x + self.mlp(self.ln_2(x))


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
        self.lm_head.weight = self.transformer.wte.weight  # tied: one Parameter
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
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
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


# ---------------------------------------------------------------------------------------------
# Llama
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of `Llama`: ``n_kv_heads < n_heads`` is grouped-query attention."""

    vocab_size: int = 64
    max_seq_len: int = 16
    n_layer: int = 2
    dim: int = 32
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden_dim: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary(nn.Module):
    """Rotary position embedding: cos / sin tables ``[max_seq_len, head_dim]`` as buffers
    (not saved with the state dict), applied as ``x * cos + rotate_half(x) * sin``."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` is ``[B, heads, T, head_dim]``."""
        T = x.shape[-2]
        return x * self.cos[:T] + rotate_half(x) * self.sin[:T]


class LlamaBlock(nn.Module):
    """Pre-RMSNorm block: grouped-query causal attention with rotary q / k, then a SwiGLU MLP
    ``w2(silu(w1(x)) * w3(x))``; no biases anywhere."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(
                f"dim {cfg.dim}, n_heads {cfg.n_heads}, n_kv_heads {cfg.n_kv_heads}: heads must "
                "divide dim and kv heads must divide heads"
            )
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        kv = cfg.n_kv_heads * self.head_dim
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, kv, bias=False)
        self.wv = nn.Linear(cfg.dim, kv, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.rotary = Rotary(self.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotary(q), self.rotary(k)
        group = self.n_heads // self.n_kv_heads
        if group > 1:  # each kv head serves `group` consecutive query heads
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    """Token embedding, `LlamaBlock`s, RMSNorm, an untied head; ``forward(idx, targets=None)``
    returns ``(logits [B, T, V], mean cross entropy or None)``."""

    def __init__(self, cfg: LlamaConfig | None = None, seed: int = 0, **sizes: Any) -> None:
        super().__init__()
        cfg = cfg if cfg is not None else LlamaConfig(**sizes)
        self.config = cfg
        torch.manual_seed(seed)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, mean=0.0, std=0.02 if "tok_embeddings" not in name else 1.0)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Output:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ---------------------------------------------------------------------------------------------
# ResNet (CIFAR-style)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResNetConfig:
    """Sizes of `ResNet`: one stage per width (the first at stride 1, the others stride 2),
    `blocks` basic blocks per stage."""

    num_classes: int = 10
    in_channels: int = 3
    widths: tuple[int, ...] = (8, 16, 32)
    blocks: int = 1


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm; the shortcut is a 1x1 convolution + BatchNorm when
    the block changes stride or width, else the identity."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = conv3x3(cin, cout, stride)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = conv3x3(cout, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(cout),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.downsample(x))


class ResNet(nn.Module):
    """3x3 stem + BatchNorm + ReLU + 2x2 max pool, the stages, global average pool, Linear;
    ``forward(x [B, C, H, W], targets=None)`` returns ``(logits [B, classes], mean cross
    entropy or None)``."""

    def __init__(self, cfg: ResNetConfig | None = None, seed: int = 0, **sizes: Any) -> None:
        super().__init__()
        cfg = cfg if cfg is not None else ResNetConfig(**sizes)
        self.config = cfg
        torch.manual_seed(seed)
        w0 = cfg.widths[0]
        self.stem = nn.Sequential(
            conv3x3(cfg.in_channels, w0), nn.BatchNorm2d(w0), nn.ReLU(), nn.MaxPool2d(2)
        )
        stages, cin = [], w0
        for i, width in enumerate(cfg.widths):
            blocks = [BasicBlock(cin, width, stride=1 if i == 0 else 2)]
            blocks += [BasicBlock(width, width) for _ in range(cfg.blocks - 1)]
            stages.append(nn.Sequential(*blocks))
            cin = width
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, cfg.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> Output:
        x = self.stages(self.stem(x))
        logits = self.fc(torch.flatten(self.pool(x), 1))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits, targets)


# ---------------------------------------------------------------------------------------------
# Hugging Face GPT-2
# ---------------------------------------------------------------------------------------------


def gpt2_hf(
    vocab_size: int = 64,
    n_positions: int = 16,
    n_embd: int = 32,
    n_layer: int = 2,
    n_head: int = 4,
    dropout: float = 0.0,
    attn_implementation: str = "eager",
    seed: int = 0,
) -> nn.Module:
    """A randomly initialized ``transformers.GPT2LMHeadModel`` (no download: built from a
    config, with ``HF_HUB_OFFLINE=1`` set unless already set).

    Call it as ``model(input_ids=ids, labels=ids).loss`` (the labels are shifted inside). The
    head is tied to the token embedding. `dropout` sets the embedding, residual and attention
    dropout. ``attn_implementation="eager"`` (default) computes attention with matmul /
    softmax / where, ops a planner must see as they are; ``"sdpa"`` uses
    ``F.scaled_dot_product_attention`` (what `GPT2` already covers). Both are deterministic on
    CPU.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()  # tiny vocabularies make it warn about GPT-2's special ids
    cfg = HFConfig(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=vocab_size - 1,
        eos_token_id=vocab_size - 1,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(seed)
    model: nn.Module = GPT2LMHeadModel(cfg)
    return model


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def token_batches(
    steps: int, batch: int, seq: int = 16, vocab: int = 64, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches ``(idx, targets)`` of int64 ``[batch, seq]``: random token
    sequences and the same sequences shifted by one (next-token targets)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((tokens[:, :-1].clone(), tokens[:, 1:].clone()))
    return out


def image_batches(
    steps: int, batch: int, size: int = 16, channels: int = 3, classes: int = 10, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches ``(images [batch, channels, size, size], labels [batch])``."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch, channels, size, size, generator=g),
            torch.randint(0, classes, (batch,), generator=g),
        )
        for _ in range(steps)
    ]
