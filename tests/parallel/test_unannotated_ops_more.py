"""More unannotated torch ops under `AutoParallel` (semi_auto: data parallel), 2 and 4 ranks.

A GPT-style block written with plain torch ops only (token + position `nn.Embedding`,
`nn.LayerNorm`, a fused qkv `nn.Linear` split per head with `view` / `transpose`, attention
scores ``q @ k.transpose(-2, -1)`` masked with a causal ``torch.tril`` mask made in the forward,
softmax, `nn.Dropout(0.1)` in train mode on the attention weights and the residual branches, a
GeLU MLP, residuals, a final LayerNorm and head, cross entropy on token targets) trains for 3
SGD steps exactly as on one device with the same seed: the loss on every rank, every gradient,
and the collectives (the loss's AllReduce and one gradient AllReduce: every parameter's
gradient in one bucket). A second
network exercises the remaining ops (cat / stack / indexing / permute / chunk / var / rsqrt /
pow / where / bmm / scaled_dot_product_attention / casts); then the errors for ops that would
touch the split dim 0.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.parallel import AutoParallel
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

BATCH, SEQ, VOCAB, EMBED, HEADS, STEPS, LR, SEED = 8, 6, 17, 16, 2, 3, 0.1, 1234


class GPTBlock(nn.Module):
    """One pre-norm transformer block with embeddings and a head, plain torch ops only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.tok, self.pos = nn.Embedding(VOCAB, EMBED), nn.Embedding(SEQ, EMBED)
        self.ln1, self.ln2, self.ln_f = (nn.LayerNorm(EMBED) for _ in range(3))
        self.qkv, self.proj = nn.Linear(EMBED, 3 * EMBED), nn.Linear(EMBED, EMBED)
        self.fc, self.fc_out = nn.Linear(EMBED, 4 * EMBED), nn.Linear(4 * EMBED, EMBED)
        self.head = nn.Linear(EMBED, VOCAB)
        self.drop = nn.Dropout(0.1)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape  # local rows under AutoParallel
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (t.view(b, s, HEADS, c // HEADS).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (c // HEADS) ** -0.5
        causal = torch.tril(torch.ones(s, s, dtype=torch.bool, device=x.device))  # whole [S, S]
        weights = self.drop(scores.masked_fill(~causal, float("-inf")).softmax(dim=-1))
        # reshape, not .contiguous().view(): in a simulated world LocalTensor.contiguous is a
        # Python method that bypasses torch-function modes, so its result would be untracked
        y = (weights @ v).transpose(1, 2).reshape(b, s, c)
        out: torch.Tensor = self.drop(self.proj(y))
        return out

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.long()  # the plan's shape trace feeds float meta inputs
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        x = x + self.attention(self.ln1(x))
        x = x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)))))
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # [B, V, S] against [B, S]: flattening with view(-1, V) would merge the split dim 0
    return F.cross_entropy(logits.transpose(1, 2), targets)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(9)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def single_device() -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Losses and gradients (after each step's backward, before the update), seeded."""
    net = GPTBlock()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    torch.manual_seed(SEED)
    losses, grads = [], []
    for tokens, targets in batches():
        loss = lm_loss(net(tokens), targets)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    return losses, grads


@pytest.mark.parametrize("world_size", [2, 4])
def test_gpt_block_of_torch_ops_trains_like_one_device(world_size: int) -> None:
    losses, grads = single_device()
    net, data = GPTBlock(), batches()
    ranks = tuple(range(world_size))
    # No primitive consumes a parameter, so every parameter is replicated and its gradient is
    # all-reduced over all ranks once per step: the per-parameter AllReduces (one per parameter
    # before) are one 25 MB bucket now; the forward's only collective is the mean loss's
    # AllReduce, whose backward needs none (loss.backward(): the seed is ones on every rank, so
    # the adjoint AllReduce would only multiply it by the world size).
    comms = Counter({("AllReduce", "forward", ranks): 1, ("AllReduce", "backward", ranks): 1})

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(net(tokens), targets)
        loss.backward()
        return loss

    with simulated_world(world_size) as world:
        world.replicate(net)
        parallel = AutoParallel(step)
        assert parallel.network is net
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        torch.manual_seed(SEED)  # dropout masks: drawn once, globally, as on one device
        for i, (tokens, targets) in enumerate(data):
            with CommRecorder() as rec:
                loss = parallel(world.rows(tokens), world.rows(targets))
            assert rec.kinds() == comms, rec.summary()
            assert_matches_single_device(loss, losses[i], what=f"loss {i}")
            got = {n: p.grad for n, p in net.named_parameters()}
            assert_matches_single_device(got, grads[i], what=f"grads {i}")
            opt.step()
            opt.zero_grad()


class MoreOps(nn.Module):
    """The other newly supported ops, each keeping dim 0 (the batch) first and whole."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.lin = nn.Linear(4, 8)
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.norm = nn.LayerNorm(8, elementwise_affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, 3, 4]
        h = self.lin(x)  # [B, 3, 8]
        a, b = h.chunk(2, dim=-1)
        h = torch.cat([b, a], dim=-1) + torch.stack([a, b], dim=-1).flatten(2)
        h = h.float().to(torch.float32).type_as(x)
        h = h * torch.rsqrt(h.var(-1, keepdim=True, unbiased=False) + 1e-5) + h.pow(2) ** 0.5
        h = torch.where(h > 0, h, 0.1 * h).permute(0, 2, 1).unsqueeze(-1).squeeze(-1)  # [B, 8, 3]
        att = torch.bmm(h.transpose(1, 2), h)  # [B, 3, 3]
        h = F.scaled_dot_product_attention(
            h.transpose(1, 2), h.transpose(1, 2), att, is_causal=True
        )
        out: torch.Tensor = (
            self.norm(h[..., :2] @ self.w[:2]) + (h[:, 0].unsqueeze(-1) ** 2 + 1).sqrt()
        )
        return out


def test_more_ops_match_one_device() -> None:
    x, y = torch.randn(8, 3, 4), torch.randn(8, 3, 8)
    ref = MoreOps()
    want = F.mse_loss(ref(x), y)
    want.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    net = MoreOps()

    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(net(a), b)
        loss.backward()
        return loss

    with simulated_world(4) as world:
        world.replicate(net)
        got = AutoParallel(step, network=net)(world.rows(x), world.rows(y))
        assert_matches_single_device(got, want.detach(), what="loss")
        assert_matches_single_device(
            {n: p.grad for n, p in net.named_parameters()}, grads, what="grads"
        )


class Refused(nn.Module):
    def __init__(self, body: str) -> None:
        super().__init__()
        self.body = body
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.lin(x)  # [B, 3, 4], dim 0 split
        if self.body == "index":
            return h[1:]
        if self.body == "index_ellipsis":
            return h[..., 0, :, :]
        if self.body == "cat":
            return torch.cat([h, h])
        if self.body == "transpose":
            return h.transpose(-3, 1)
        if self.body == "squeeze":
            return h.squeeze()
        if self.body == "layer_norm":
            return F.layer_norm(h, h.shape)
        return self.lin.weight @ h[:, 0]  # matmul


@pytest.mark.parametrize(
    "body", ["index", "index_ellipsis", "cat", "transpose", "squeeze", "layer_norm", "matmul"]
)
def test_ops_touching_dim_0_are_planned(body: str) -> None:
    """Ops that index, join, move or reduce over the data-parallel dim are planned by their
    sharding rules (the rows are gathered where the op needs them whole) and match one device;
    an output whose dim 0 does not divide by the ranks leaves whole."""
    torch.manual_seed(0)
    net, x = Refused(body), torch.randn(4, 3, 4)
    want = net(x).detach()
    with simulated_world(2) as world:
        parallel = AutoParallel(world.replicate(net))
        got = parallel(world.rows(x))
        rows = want.dim() > 0 and want.shape[0] % 2 == 0
        assert_matches_single_device(got, world.rows(want) if rows else want, what=body)
        assert parallel.parallel_plan is not None


class Changing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.twice = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.lin(x)
        return torch.tanh(h) if self.twice else torch.relu(h)


def test_a_network_whose_ops_change_between_steps_is_planned_again() -> None:
    """The plan is captured from one call: another op at the same place in a later call (before
    any backward) captures and plans that call too (more in test_replan.py)."""
    torch.manual_seed(0)
    net, x = Changing(), torch.randn(4, 4)
    want = torch.relu(net.lin(x)).detach(), torch.tanh(net.lin(x)).detach()
    with simulated_world(2) as world:
        parallel = AutoParallel(world.replicate(net))
        first = parallel(world.rows(x))
        net.twice = True
        second = parallel(world.rows(x))
    assert_matches_single_device(first, lambda r: want[0][2 * r : 2 * r + 2])
    assert_matches_single_device(second, lambda r: want[1][2 * r : 2 * r + 2])


class MaskedAttention(nn.Module):
    """Attention with an additive float mask of shape `mask_shape` (broadcast from the right to
    the scores' ``[B, H, S, S]``): ``[S, S]`` with S equal to the batch size is still one mask
    for every batch row, not a mask to split with the batch."""

    def __init__(self, mask_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.register_buffer("mask", torch.randn(mask_shape))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, 2, 4).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        return F.mse_loss(h.transpose(1, 2).flatten(2), y)


@pytest.mark.parametrize("mask_shape", [(4, 4), (4, 1, 4, 4), (2, 4, 4)])
def test_attention_mask_dims_are_matched_from_the_right(mask_shape: tuple[int, ...]) -> None:
    """A mask's dims are matched to the scores' from the right: with batch 4 and sequence 4, a
    ``[S, S]`` mask (and a per-head ``[H, S, S]`` one) is one mask for every rank's rows, a
    ``[B, 1, S, S]`` one is split with the batch; the loss and gradients equal one device's,
    with the loss's AllReduce and one gradient bucket only."""
    torch.manual_seed(0)
    net, x, y = MaskedAttention(mask_shape), torch.randn(4, 4, 8), torch.randn(4, 4, 8)
    want = net(x, y)
    want.backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    net.zero_grad()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(a, b)
            loss.backward()
            return loss

        with CommRecorder() as rec:
            loss = AutoParallel(step, "semi_auto")(world.rows(x), world.rows(y))
    assert_matches_single_device(loss, want.detach(), what="loss")
    for n, p in net.named_parameters():
        assert_matches_single_device(p.grad, grads[n], what=f"{n}.grad")
    assert rec.kinds() == Counter(
        {("AllReduce", "forward", (0, 1)): 1, ("AllReduce", "backward", (0, 1)): 1}
    ), rec.summary()
