"""``F.scaled_dot_product_attention`` with ``dropout_p > 0`` in semi_auto: masks as one device's.

One device computes such a call on CPU by torch's math form and draws the dropout mask of the
attention weights ``[B, H, L, S]`` there. The plan marks the node (``NodePlan.local ==
"attention_dropout"``) and each rank computes the math form on its blocks, dropping its
weights by its block of one mask of the global shape, drawn as one device draws it. So with the
same seed, training equals one device: the loss and every gradient (1e-5 relative), with no
collective beyond the data-parallel ones (the loss's AllReduce, one gradient bucket).

Cases: nanoGPT with dropout 0.1 (attention and residual) on 2 and 4 ranks; nanoGPT at 2 x 2 with
the heads split (strided ``c_attn``, attention annotated with ``sw.shard``) and with the
Megatron annotation (row-parallel ``c_proj`` before the residual dropouts); Hugging Face's
``GPT2LMHeadModel`` with its own SDPA attention and dropout; a bare attention call with a
boolean mask, an explicit scale and grouped-query heads; the query's rows split (no causal
mask), so each rank's block of the mask is a block of rows.

Other ops that fill a tensor with random numbers inside (torch's ``nn.TransformerEncoder``:
``F.multi_head_attention_forward``'s attention dropout; ``F.alpha_dropout``) draw the whole
tensor as one device does and keep their block (the plan's ``draws``), laid out in memory as
one device's (a dropout of a transposed tensor), and so do random tensors shaped like a split
one (``torch.randn_like(std)``, a VAE's noise; ``torch.randn(h.shape)``); a random tensor drawn
from a split one's values (``torch.bernoulli(p)``) is refused at plan time.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.planner import ParallelPlan
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..cached import outside_worlds
from ..zoo import GPT2, CausalSelfAttention, GPT2Config, gpt2_hf, recording_step, token_batches
from .test_zoo_megatron import SDPA_2X2, block_of, megatron, per_layer

STEPS, BATCH, SEED = 2, 8, 7
ADAM = {"lr": 1e-3, "eps": 1e-6}
DROPOUT = "attention_dropout"

pytestmark = pytest.mark.usefixtures("one_thread")


def nanogpt() -> nn.Module:
    return GPT2(GPT2Config(dropout=0.1))


def hf() -> nn.Module:
    return gpt2_hf(dropout=0.1, attn_implementation="sdpa")


MODELS: dict[str, Any] = {
    "nanogpt": (nanogpt, lambda m, x, y: m(x, y)[1]),
    "hf": (hf, lambda m, x, y: m(input_ids=x, labels=x).loss),
}


@outside_worlds
def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return token_batches(STEPS, BATCH)


@outside_worlds
def single_device(name: str) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Per step on one device (dropout drawn from seed `SEED`): the loss, every gradient."""
    make, loss_of = MODELS[name]
    net = make()
    grads: list[dict[str, torch.Tensor]] = []
    step = recording_step(net, torch.optim.AdamW(net.parameters(), **ADAM), loss_of, grads)
    torch.manual_seed(SEED)
    losses = [step(x, y).detach() for x, y in batches()]
    return losses, grads


def train(world: Any, name: str, net: nn.Module, want: Any) -> tuple[sw.AutoParallel, list[Any]]:
    """`net` trained in semi_auto from seed `SEED` on `batches()`: each step's loss and every
    gradient (this rank's block) equal one device's, `want` (``(single_device(name),
    batches())``, made before entering `world`: they draw); returns the wrapper and each step's
    collectives."""
    _, loss_of = MODELS[name]
    (want_losses, want_grads), steps = want
    world.replicate(net)
    seen: list[dict[str, torch.Tensor]] = []
    step = recording_step(net, torch.optim.AdamW(net.parameters(), **ADAM), loss_of, seen)
    parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
    kinds = []
    torch.manual_seed(SEED)
    for s, (x, y) in enumerate(steps):
        with CommRecorder() as rec:
            loss = parallel(world.rows(x), world.rows(y))
        assert_matches_single_device(loss, want_losses[s], what=f"loss {s}")
        for n, grad in seen[s].items():
            full = block_of(parallel, n, want_grads[s][n])
            assert_matches_single_device(grad, full, what=f"step {s} {n}.grad")
        kinds.append(rec.kinds())
    return parallel, kinds


def dropout_nodes(parallel: sw.AutoParallel) -> list[Any]:
    plan = parallel.parallel_plan
    assert plan is not None
    return [n for n in plan.nodes if n.local == DROPOUT]


@pytest.mark.parametrize(("name", "ranks"), [("nanogpt", 2), ("nanogpt", 4), ("hf", 2)])
def test_data_parallel_attention_dropout_matches_one_device(name: str, ranks: int) -> None:
    """Each layer's attention keeps its rows split and drops its block of the global mask: per
    step only the loss's AllReduce and one gradient bucket."""
    net, want = MODELS[name][0](), (single_device(name), batches())
    with simulated_world(ranks) as world:
        parallel, kinds = train(world, name, net, want)
    world_group = tuple(range(ranks))
    want = Counter({("AllReduce", "forward", world_group): 1})
    want[("AllReduce", "backward", world_group)] = 1
    assert kinds == [want] * STEPS
    nodes = dropout_nodes(parallel)
    assert len(nodes) == 2  # (one a layer)
    assert all(n.outputs[0].layout.split_count(0) == ranks for n in nodes)


class HeadsSplit(CausalSelfAttention):
    """nanoGPT's attention, its SDPA call annotated batch over dp, heads over mp."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = (
            t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            for t in self.c_attn(x).split(self.n_embd, dim=2)
        )
        y = SDPA_2X2(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        out: torch.Tensor = self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))
        return out


def test_heads_split_attention_dropout_matches_one_device() -> None:
    """2 x 2, q / k / v split by heads (strided ``c_attn``): each rank's weights are its batch
    rows and heads of the global ones, and so is its block of the mask; attention runs with no
    collective (per layer only the rows gathered for ``c_attn`` and its adjoint, and the
    row-parallel heads' AlltoAlls into ``c_proj``'s data-parallel input)."""
    net = nanogpt()
    layout = sw.Layout((2, 2), ("dp", "mp"))
    for block in net.transformer.h:
        strided = (layout("dp", "None"), layout(sw.strided("mp", 3), "None"))
        sw.shard(block.attn.c_attn, in_strategy=strided)
        block.attn.__class__ = HeadsSplit
    want = single_device("nanogpt"), batches()
    with simulated_world(4) as world:
        parallel, kinds = train(world, "nanogpt", net, want)
    assert kinds[0] == kinds[1]
    assert not any(kind == "AllReduce" and group == (0, 1) for kind, _, group in kinds[0])
    nodes = dropout_nodes(parallel)
    assert len(nodes) == 2
    for n in nodes:  # batch over dp, heads over mp
        split = n.outputs[0].layout
        assert [split.split_count(d) for d in range(4)] == [2, 2, 1, 1], str(n)


def test_megatron_with_dropout_matches_one_device() -> None:
    """The Megatron annotation at 2 x 2 with dropout 0.1: attention drops its weights as one
    device (its data-parallel math form), and each residual dropout of a row-parallel
    ``c_proj``'s partial sum runs data parallel (no rule fills a partial sum in place: its
    AllReduce comes before the dropout instead of at the residual add): the same collectives
    as without dropout (`test_zoo_megatron.per_layer`), loss and every gradient as one
    device's."""
    net = megatron(nanogpt(), 2, 2)
    want = single_device("nanogpt"), batches()
    with simulated_world(4) as world:
        parallel, kinds = train(world, "nanogpt", net, want)
    assert kinds == [per_layer(2, 2)] * STEPS
    assert len(dropout_nodes(parallel)) == 2


class Attention(nn.Module):
    """One attention call on projections of `x`: a boolean mask, an explicit scale and grouped
    query heads (`kind` "masked"), or the query's rows split over the ranks with no mask
    (`kind` "rows")."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.q, self.kv = nn.Linear(8, 8), nn.Linear(8, 8)
        self.sdpa = F.scaled_dot_product_attention
        if kind == "rows":  # (each rank: its rows of the queries, every key)
            self.sdpa = sw.shard(self.sdpa, in_strategy=((1, 1, 2, 1), (1, 1, 1, 1), (1, 1, 1, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, 4, 2).transpose(1, 2)
        if self.kind == "rows":
            k = v = self.kv(x).view(B, T, 4, 2).transpose(1, 2)
            return self.sdpa(q, k, v, dropout_p=0.3)  # type: ignore[no-any-return]
        k, v = self.kv(x).view(B, T, 2, 4).transpose(1, 2).split(2, dim=-1)
        mask = torch.ones(T, T, dtype=torch.bool).tril(-1)  # (row 0 masked whole: zeros)
        out: torch.Tensor = self.sdpa(
            q, k, v, attn_mask=mask, dropout_p=0.3, scale=0.7, enable_gqa=True
        )
        return out


@pytest.mark.parametrize("kind", ["masked", "rows"])
def test_attention_call_with_dropout_matches_one_device(kind: str) -> None:
    torch.manual_seed(0)
    net, x = Attention(kind), torch.randn(4, 6, 8)
    torch.manual_seed(SEED)
    want = net(x)
    want.pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    net.zero_grad()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(a: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = net(a)
            out.pow(2).sum().backward()
            return out

        parallel = sw.AutoParallel(step).dataset_strategy("full_batch")
        torch.manual_seed(SEED)
        got = parallel(world.same(x))
        plan = parallel.parallel_plan
        assert plan is not None
        (node,) = [n for n in plan.nodes if n.local == DROPOUT]
        split = node.outputs[0].layout
        assert split.split_count(2 if kind == "rows" else 0) == 2, str(node)
        assert_matches_single_device(got, want.detach())  # (returned whole: full_batch)
        for n, p in net.named_parameters():
            assert_matches_single_device(p.grad, grads[n], what=f"{n}.grad")


class TorchEncoder(nn.Module):
    """torch's own ``nn.TransformerEncoder`` (pre-norm, causal, batch first): its attention is
    ``F.multi_head_attention_forward``, which draws its attention dropout inside, and its
    ``dropout1`` drops the attention's output, a transposed (non-contiguous) tensor."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 32)
        layer = nn.TransformerEncoderLayer(
            32, 4, 64, dropout=dropout, batch_first=True, norm_first=True
        )
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 64)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        h = self.enc(self.emb(x), mask=mask, is_causal=True)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_torch_transformer_encoder(dropout: float) -> None:
    """torch's ``nn.TransformerEncoder`` trains data parallel as one device, with its default
    dropout too: the loss and every gradient equal, the loss's AllReduce and one gradient
    bucket only. Each ``multi_head_attention_forward`` is planned with its one draw (the
    attention weights' mask, ``[B, H, L, S]`` split on B: this rank's block of one draw), and
    the plan saves and loads with it."""
    (x, y), ref = batches()[0], TorchEncoder(dropout)
    torch.manual_seed(SEED)
    want = ref(x, y)
    want.backward()
    net = TorchEncoder(dropout)
    with simulated_world(2) as world:
        world.replicate(net)
        grads: dict[str, torch.Tensor] = {}

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(a, b)
            loss.backward()
            grads.update(
                {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
            )
            return loss

        parallel = sw.AutoParallel(step, "semi_auto")
        torch.manual_seed(SEED)
        with CommRecorder() as rec:
            loss = parallel(world.rows(x), world.rows(y))
        assert_matches_single_device(loss, want.detach(), what="loss")
        for n, p in ref.named_parameters():
            assert_matches_single_device(grads[n], p.grad, what=f"{n}.grad")
        assert rec.kinds() == Counter(
            {("AllReduce", "forward", (0, 1)): 1, ("AllReduce", "backward", (0, 1)): 1}
        ), rec.summary()
    plan = parallel.parallel_plan
    assert plan is not None
    drawing = [n for n in plan.nodes if n.local == "global_draws"]
    assert len(drawing) == (2 if dropout else 0)
    for n in drawing:
        assert n.op.endswith("multi_head_attention_forward")
        ((placed, shape, order),) = n.draws
        assert shape == (8, 4, 16, 16) and placed.layout.split_count(0) == 2
        assert order == (0, 1, 2, 3)  # (the attention weights: contiguous)
        assert "draw (g0, None, None, None) [8, 4, 16, 16]" in str(plan)
    # each layer's dropout1 drops the attention's output, [B, T, C] with T outer in memory
    dropout1 = [n for n in plan.nodes if n.name.endswith("dropout1/dropout") and n.draws]
    assert [n.draws[0][2] for n in dropout1] == ([(1, 0, 2)] * 2 if dropout else [])
    assert ParallelPlan.from_dict(plan.to_dict()) == plan


class Noisy(nn.Module):
    """A Linear on rows split over the ranks, then a random op (`body`)."""

    def __init__(self, body: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.body = nn.Linear(8, 8), body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.body == "alpha_dropout":  # (fills a noise tensor in place: planned draws)
            return F.alpha_dropout(h, 0.5, True)
        if self.body == "transposed":  # (F.dropout of a non-contiguous tensor)
            return F.dropout(h.transpose(1, 2), 0.5).transpose(1, 2)
        if self.body == "batch_inner":  # (rows between dims in memory: one row a rank)
            return F.dropout(self.lin(x.transpose(0, 1)).transpose(0, 1), 0.5)
        if self.body == "rand_like":  # (a VAE's noise: drawn whole, this rank's block kept)
            return h + torch.randn_like(h.transpose(1, 2)).transpose(1, 2) * torch.rand_like(h)
        if self.body == "randn_shape":  # (a factory given a split tensor's local shape)
            return h * torch.randn(h.shape)
        return h * torch.bernoulli(torch.sigmoid(h))  # (drawn from a split tensor's values)


@pytest.mark.parametrize(
    "body", ["alpha_dropout", "transposed", "batch_inner", "rand_like", "randn_shape", "bernoulli"]
)
def test_random_draws_on_split_rows(body: str) -> None:
    """Draws on split rows are one device's (each rank its block of the whole draw, laid out
    in memory as one device's: with the rows between two dims in memory and one row a rank,
    the rank's block alone cannot tell the order, the plan's draw does), or refused at plan
    time naming the op, its random aten op and the fix."""
    net, x = Noisy(body), torch.randn(2 if body == "batch_inner" else 4, 3, 8)
    torch.manual_seed(SEED)
    want = net(x).detach()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net)
        torch.manual_seed(SEED)
        if body == "bernoulli":
            with pytest.raises(ValueError, match=r"bernoulli .* draws random numbers inside"):
                parallel(world.rows(x))
            return
        with CommRecorder() as rec:
            got = parallel(world.rows(x))
        assert_matches_single_device(got, world.rows(want), what=body)
        assert not rec.kinds(), rec.summary()


def test_attention_planned_in_eval_drops_as_one_device_when_trained() -> None:
    """A wrapped module first called in ``eval()`` (its attention's ``dropout_p`` 0: planned
    with the attention kernel), then in ``train()``: the attention drops its weights as one
    device does (its math form with this rank's block of the global mask)."""
    x = batches()[0][0]
    ref, net = nanogpt(), nanogpt()
    torch.manual_seed(SEED)
    want = ref(x)[0].detach()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net)
        net.eval()
        parallel(world.rows(x))
        plan = parallel.parallel_plan
        assert plan is not None and not dropout_nodes(parallel)  # (no dropout when planned)
        net.train()
        torch.manual_seed(SEED)
        got = parallel(world.rows(x))[0]
        assert parallel.parallel_plan is plan  # (the same plan: nothing planned again)
        assert_matches_single_device(got, world.rows(want), what="logits")


def test_encoder_planned_in_eval_is_planned_again_when_trained() -> None:
    """torch's encoder first called in ``eval()`` (``multi_head_attention_forward`` planned
    without draws), then trained: the attention's first draw has no planned block, so the call
    is planned again with its draws (the first plan kept for ``eval()``), and the loss equals
    one device's."""
    (x, y), ref, net = batches()[0], TorchEncoder(0.1), TorchEncoder(0.1)
    torch.manual_seed(SEED)
    want = ref(x, y).detach()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(lambda a, b: net(a, b), network=net)
        net.eval()
        parallel(world.rows(x), world.rows(y))
        first = parallel.parallel_plan
        assert first is not None and not any(n.draws for n in first.nodes)
        net.train()
        torch.manual_seed(SEED)
        got = parallel(world.rows(x), world.rows(y))
        plan = parallel.parallel_plan
        assert plan is not None and plan != first
        assert sum(1 for n in plan.nodes if n.local == "global_draws") == 2
        assert_matches_single_device(got, want, what="loss")


class Vae(nn.Module):
    """A VAE's reparameterization: ``mu + torch.randn_like(std) * std`` on split rows."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.dec = nn.Linear(6, 8), nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu, logvar = self.enc(x).chunk(2, -1)
        std = torch.exp(0.5 * logvar)
        z = mu + torch.randn_like(std) * std
        rec = F.mse_loss(self.dec(z), x, reduction="sum") / x.shape[0]
        kld = -0.5 * torch.mean(torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=1))
        return rec + kld


@pytest.mark.parametrize("ranks", [2, 4])
def test_vae_noise_trains_as_one_device(ranks: int) -> None:
    """A VAE's noise drawn with ``torch.randn_like(std)`` on split rows (refused at plan time
    before): losses and every gradient equal one device's over two Adam steps, with the
    data-parallel collectives only."""
    g = torch.Generator().manual_seed(9)
    batches = [(torch.randn(8, 6, generator=g),) for _ in range(STEPS)]
    ref = Vae()
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    want, grads = [], []
    torch.manual_seed(SEED)
    for (x,) in batches:
        loss = ref(x)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()
        want.append(loss.detach())
    net = Vae()
    with simulated_world(ranks) as world:
        world.replicate(net)
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        seen: list[dict[str, torch.Tensor]] = []

        def step(x: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(x)
            loss.backward()
            seen.append({n: p.grad.detach().clone() for n, p in net.named_parameters()})  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        torch.manual_seed(SEED)
        with CommRecorder() as rec:
            for s, (x,) in enumerate(batches):
                assert_matches_single_device(parallel(world.rows(x)), want[s], what=f"loss {s}")
                assert_matches_single_device(seen[s], grads[s], what=f"grads {s}")
    ranks_ = tuple(range(ranks))  # (the two loss terms: a partial sum, a partial mean)
    want_kinds = {
        ("AllReduce", "forward", ranks_): 2 * STEPS,
        ("AllReduce", "backward", ranks_): STEPS,
    }
    assert rec.kinds() == Counter(want_kinds), rec.summary()
