"""Real model shapes in plain torch, for tests: what a user brings as their own `nn.Module`.

Nothing here uses shardwise: these are the networks a user writes (or downloads), at tiny sizes
so tests run fast on 2 CPU cores. Each model's ``forward(x, targets=None)`` returns
``(logits, loss)`` (``loss`` None without targets).

- `GPT2` / `GPT2Config` (from `shardwise.testing.nanogpt`): nanoGPT's architecture
  (pre-LayerNorm blocks, a fused ``c_attn`` split into q, k, v, SDPA, GELU MLP, the head tied
  to the token embedding, nanoGPT's init) and ``configure_optimizers`` (AdamW, two groups).
- `Llama` / `LlamaConfig` / `LlamaBlock`: RMSNorm, rotary embedding from cos / sin buffers,
  grouped-query attention through SDPA, SwiGLU MLP, no biases.
- `ResNet` / `ResNetConfig` / `BasicBlock`: a CIFAR-style ResNet (3x3 stem, BatchNorm, a max
  pool, stages of basic blocks with 1x1 projection shortcuts, global average pool, Linear).
- `gpt2_hf`: a randomly initialized Hugging Face ``GPT2LMHeadModel`` (transformers, a pinned
  test dependency; imported only when called, offline); `t5_hf`: its
  ``T5ForConditionalGeneration`` (encoder-decoder).
- `token_batches`, `image_batches`: deterministic global batches for them.
- `recording_step` (a train step that keeps every gradient) and `semi_auto_matches` (that step
  in semi_auto, each step's loss and gradients checked against one device's);
  `assert_shards_match` (parameters under optimizer parallel against one device's);
  `one_step_matches` and `OneOp` (one op on a split activation) for single-op checks.

Every constructor seeds torch's global RNG with its ``seed`` argument before drawing initial
values, so two calls with the same arguments build identical networks (the single-device
reference and the parallel run each build their own copy). Build them outside a simulated
world: inside, every rank would draw its own values.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.testing.nanogpt import (  # (nanoGPT's GPT-2 lives with shardwise's test models)
    GPT2 as GPT2,
)
from shardwise.testing.nanogpt import MLP as MLP
from shardwise.testing.nanogpt import Block as Block
from shardwise.testing.nanogpt import CausalSelfAttention as CausalSelfAttention
from shardwise.testing.nanogpt import GPT2Config as GPT2Config

Output = tuple[torch.Tensor, torch.Tensor | None]

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


def t5_hf(vocab_size: int = 64, d_model: int = 32, layers: int = 2, seed: int = 0) -> nn.Module:
    """A randomly initialized ``transformers.T5ForConditionalGeneration`` (encoder-decoder,
    relative position buckets, no download). Call it as ``model(input_ids=ids,
    labels=targets).loss``: it builds the decoder inputs from the labels itself
    (``_shift_right``: item assignment into ``new_zeros``, ``masked_fill_``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=d_model // 4,
        d_ff=2 * d_model,
        num_layers=layers,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
    )
    torch.manual_seed(seed)
    model: nn.Module = T5ForConditionalGeneration(cfg)
    return model


# ---------------------------------------------------------------------------------------------
# Data
def recording_step(
    net: nn.Module,
    opt: torch.optim.Optimizer,
    loss_of: Any,
    seen: list[dict[str, torch.Tensor]],
) -> Any:
    """A train step ``step(x, y)``: ``loss_of(net, x, y)``, backward, a copy of every gradient
    (by name) appended to `seen`, the optimizer's step and ``zero_grad``; returns the loss."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = loss_of(net, x, y)
        loss.backward()
        seen.append({n: p.grad.detach().clone() for n, p in net.named_parameters()})
        opt.step()
        opt.zero_grad()
        return loss

    return step


def semi_auto_matches(
    world: Any,
    net: nn.Module,
    opt: torch.optim.Optimizer,
    loss_of: Any,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    want_losses: list[torch.Tensor],
    want_grads: list[dict[str, torch.Tensor]],
) -> tuple[Any, Any]:
    """Train `net` (replicated in simulated `world`) in semi_auto on `batches` (global; each
    rank passes its rows) with `recording_step`: each step's loss and every gradient equal
    one device's (`want_*`). Returns the `AutoParallel` and the `CommRecorder` of all steps."""
    import shardwise as sw
    from shardwise.testing import CommRecorder, assert_matches_single_device

    seen: list[dict[str, torch.Tensor]] = []
    parallel = sw.AutoParallel(recording_step(net, opt, loss_of, seen), parallel_mode="semi_auto")
    with CommRecorder() as rec:
        for s, (x, y) in enumerate(batches):
            loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want_losses[s], what=f"loss {s}")
            assert_matches_single_device(seen[s], want_grads[s], what=f"grads {s}")
    return parallel, rec


class OneOp(nn.Module):
    """`l1` (column parallel over ``(dp, mp) = split`` when given), its output through `op`,
    then a head and a cross entropy over 4 classes: one op on a split activation, for
    `one_step_matches`."""

    def __init__(
        self, op: Callable[[torch.Tensor], torch.Tensor], width: int, split: Any = None
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.op = op
        self.l1, self.head = nn.Linear(width, width), nn.Linear(width, 4)
        if split is not None:
            import shardwise as sw

            sw.shard(self.l1, in_strategy=((split[0], 1), (split[1], 1)))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.op(self.l1(x))), y)


class TiedHead(nn.Module):
    """An embedding (16 tokens, 8 wide) and a head sharing its weight (``head.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.emb(x))
        return out


def one_step_matches(
    world_size: int, net: nn.Module, single: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> tuple[Any, Any]:
    """One step of ``net(x, y).backward()`` in semi_auto on `world_size` simulated ranks (each
    passing its rows; `net` replicated) against `single`'s on the whole batch: the loss and
    every gradient block equal. Returns the `AutoParallel` and the step's `CommRecorder`."""
    import shardwise as sw
    from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

    want = single(x, y)
    want.backward()
    with simulated_world(world_size) as world:
        world.replicate(net)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(a, b)
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        with CommRecorder() as rec:
            got = parallel(world.rows(x), world.rows(y))
        assert_matches_single_device(got, want.detach(), what="loss")
        assert_grad_blocks_match(parallel, net, single)
    return parallel, rec


def assert_shards_match(parallel: Any, net: nn.Module, want: dict[str, torch.Tensor]) -> None:
    """Under optimizer parallel (`parallel`'s ``hsdp``), each parameter of `net` equals one
    device's (`want`, by name): whole where it is not sharded, else this rank's rows of it."""
    from shardwise.testing import assert_matches_single_device

    plan = parallel.optimizer_plan
    assert plan is not None
    for name, p in net.named_parameters():
        full, shard = want[name], plan.param(name)
        if not shard.sharded:
            assert_matches_single_device(p.detach(), full, what=name)
            continue
        n = shard.shard_shape[0]
        assert_matches_single_device(
            p.detach(), lambda r, f=full, n=n: f[r * n : (r + 1) * n], what=name
        )


def assert_grad_blocks_match(parallel: Any, net: nn.Module, single: nn.Module) -> None:
    """Each parameter gradient of `net` (run under `parallel`) equals this rank's block of one
    device's (`single`'s), cut by the layout `parallel`'s plan stores the parameter in."""
    from shardwise.testing import assert_matches_single_device

    plan = parallel.parallel_plan
    assert plan is not None
    for name, q in single.named_parameters():
        layout, full = plan.params[name].layout, q.grad
        assert full is not None, name

        def block(rank: int, full: torch.Tensor = full, layout: Any = layout) -> torch.Tensor:
            return full[layout.local_index(rank, tuple(full.shape))]

        assert_matches_single_device(net.get_parameter(name).grad, block, what=f"{name}.grad")


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
