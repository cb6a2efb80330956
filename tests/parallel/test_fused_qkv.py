"""A fused q/k/v projection (nanoGPT's ``c_attn = nn.Linear(C, 3C)``, then ``split(C, dim=2)``),
annotated column-parallel two ways, on `tests/zoo.py`'s GPT-2 (2 layers, C = 32, 4 heads) on 2
and 4 simulated ranks:

- plain: ``sw.shard(c_attn, in_strategy=((dp, 1), (mp, 1)))``: rank r holds rows
  ``[r * 3C/mp, (r + 1) * 3C/mp)`` of the fused weight, which mixes q with k (or k with v), so
  the split cannot keep them split: the plan gathers ``qkv`` (an AllGather of ``[B, T, 3C]``
  over mp) or, in semi_auto, moves it to rows and back (2 AlltoAlls);
- strided: ``in_strategy=(layout("dp", "None"), layout(sw.strided("mp", 3), "None"))``: the
  3C rows are 3 groups (q, k, v), each split over mp, so every rank holds its heads of q, k
  and v (DTensor's ``_StridedShard(0, split_factor=3)``); the split keeps all three split over
  mp (`ops.aten_rules.strided_split_rule`) and attention runs on each rank's heads.

One training step equals one device on the global batch: the loss and every gradient, each
gathered back to its full shape from the ranks' blocks (1e-5 relative). The collectives are
asserted exactly (kind, phase, group, count; the plan's kind, axis, count) and the strided plan
sends fewer bytes (exact totals). By sharding propagation with only c_attn and c_fc annotated,
the strided plan is Megatron's (both c_proj row parallel: two AllReduces a layer); with c_proj
annotated too it is the same plan, and costs less than plain (`planner.plan_cost`). Delayed init
cuts the strided rows; a group count that does not divide the rows is a ValueError naming the
op, dim, axis and fix."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch

import shardwise as sw
from shardwise import planner
from shardwise.layout import TensorLayout
from shardwise.optim import OptimizerPlan
from shardwise.report._summary import step_traffic
from shardwise.testing import CommRecorder, SimulatedWorld, simulated_world
from shardwise.testing import assert_matches_single_device as same

from ..cached import outside_worlds
from ..zoo import GPT2, CausalSelfAttention, GPT2Config, token_batches
from .test_zoo_megatron import ADAM, batches
from .test_zoo_megatron import reference as megatron_reference

LAYERS = 2
Kinds = Counter[tuple[str, str, tuple[int, ...]]]


pytestmark = pytest.mark.usefixtures("one_thread")


def annotate(net: GPT2, dp: int, mp: int, qkv: str, proj: bool) -> GPT2:
    """c_attn column parallel (`qkv`: "plain" or "strided"), c_fc column parallel; with `proj`
    both c_proj row parallel (the full Megatron annotation)."""
    layout = sw.Layout((dp, mp), ("dp", "mp"))
    for block in net.transformer.h:
        if qkv == "strided":
            strategy = (layout("dp", "None"), layout(sw.strided("mp", 3), "None"))
            sw.shard(block.attn.c_attn, in_strategy=strategy)
        else:
            sw.shard(block.attn.c_attn, in_strategy=((dp, 1), (mp, 1)))
        sw.shard(block.mlp.c_fc, in_strategy=((dp, 1), (mp, 1)))
        if proj:
            sw.shard(block.attn.c_proj, in_strategy=((dp, mp), (1, mp)))
            sw.shard(block.mlp.c_proj, in_strategy=((dp, mp), (1, mp)))
    return net


@outside_worlds
def reference() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The global batch, and one device's loss and gradients on it."""
    x, y = token_batches(1, 8)[0]
    net = GPT2()
    loss = net(x, y)[1]
    assert loss is not None
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}
    return x, y, loss.detach(), grads


def gathered(world: SimulatedWorld, t: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
    """The full tensor of global `shape` from every rank's block (`layout.local_index`); every
    replica of a block must hold the same values."""
    blocks = world.local_tensors(t)
    with world.outside():
        shape = tuple(n * layout.split_count(d) for d, n in enumerate(blocks[0].shape))
        full = torch.zeros(shape, dtype=blocks[0].dtype)
        for r, block in enumerate(blocks):
            full[layout.local_index(r, shape)] = block
        for r, block in enumerate(blocks):
            torch.testing.assert_close(full[layout.local_index(r, shape)], block, rtol=0, atol=0)
    return full


def train(
    dp: int, mp: int, qkv: str, proj: bool, mode: str = "sharding_propagation"
) -> tuple[planner.ParallelPlan, CommRecorder]:
    """One step on dp x mp ranks, checked against one device; the plan and its collectives."""
    x, y, want, grads = reference()
    net = annotate(GPT2(), dp, mp, qkv, proj)
    with simulated_world(dp * mp) as world:
        world.replicate(net)
        seen: dict[str, torch.Tensor] = {}

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = net(a, b)[1]
            assert loss is not None
            loss.backward()
            seen.update({n: p.grad.detach().clone() for n, p in net.named_parameters()})
            return loss

        parallel = sw.AutoParallel(step, parallel_mode=mode)
        with CommRecorder() as rec:
            loss = parallel(world.rows(x), world.rows(y))
        plan = parallel.parallel_plan
        assert plan is not None
        same(loss, want, what="loss")
        for name, full in grads.items():
            got = gathered(world, seen[name], plan.params[name].layout)
            same(got, full, what=f"{name}.grad (gathered)")
    return plan, rec


def expected(dp: int, mp: int, qkv: str, proj: bool, mode: str) -> Kinds:
    """The exact collectives of one step (groups hold rank 0)."""
    world, mpg, dpg = tuple(range(dp * mp)), tuple(range(mp)), tuple(range(0, dp * mp, mp))
    want: Kinds = Counter()

    def add(kind: str, group: tuple[int, ...], n: int, backward: str | None = None) -> None:
        want[(kind, "forward", group)] += n
        if backward is not None:
            want[(backward, "backward", group)] += n

    add("AllReduce", world, 1)  # the loss (train step: its backward seed needs none)
    want[("AllReduce", "backward", world)] += 1  # the gradient bucket of whole parameters
    if dp > 1:
        want[("AllReduce", "backward", dpg)] += 1  # the mp-split parameters, over dp
    if mode == "semi_auto":  # (proj): rows gathered for c_attn / c_fc, c_proj's partial sums
        add("AllGather", mpg, 2 * LAYERS, "ReduceScatter")  # reduced and cut to rows at once
        add("ReduceScatter", mpg, 2 * LAYERS, "AllGather")
        if qkv == "plain":  # qkv -> rows for the split, attention's output -> columns
            add("AlltoAll", mpg, 2 * LAYERS, "AlltoAll")
        return want
    add("AllGather", mpg, 1, "ReduceScatter")  # the embedding's rows, gathered for c_attn
    if qkv == "plain":  # qkv gathered for the split: attention, then c_proj, on whole rows
        add("AllGather", mpg, LAYERS, "ReduceScatter")
    # c_proj row parallel, its AllReduce (propagation's own reduction, as Megatron's) and
    # the adjoint at the column-parallel inputs: with c_proj annotated or not, both c_proj
    # strided; plain: the MLP's only
    rows = 2 if proj or qkv == "strided" else 1
    add("AllReduce", mpg, rows * LAYERS, "AllReduce")
    return want


def forward_gather_bytes(rec: CommRecorder) -> int:
    return sum(r.bytes_sent for r in rec.select("AllGather", "forward"))


# (dp, mp, annotated c_proj too): AllGather bytes sent per rank in one forward, plain and
# strided (qkv is [8, 16, 96] float32: plain gathers it per layer, strided attention's output
# [8, 16, 32] or nothing)
BYTES = {
    (1, 2, False): (57344, 8192),
    (2, 2, False): (28672, 4096),
    (1, 4, False): (86016, 12288),
    (1, 2, True): (57344, 8192),
    (2, 2, True): (28672, 4096),
}


@pytest.mark.parametrize(("dp", "mp", "proj"), list(BYTES), ids=[str(k) for k in BYTES])
def test_strided_qkv_sends_less_than_plain_column_parallel(dp: int, mp: int, proj: bool) -> None:
    mode = "sharding_propagation"
    plain, plain_rec = train(dp, mp, "plain", proj)
    strided, strided_rec = train(dp, mp, "strided", proj)
    assert plain_rec.kinds() == expected(dp, mp, "plain", proj, mode), plain_rec.summary()
    assert strided_rec.kinds() == expected(dp, mp, "strided", proj, mode), strided_rec.summary()
    assert (forward_gather_bytes(plain_rec), forward_gather_bytes(strided_rec)) == BYTES[
        (dp, mp, proj)
    ]
    assert strided_rec.total_bytes() < plain_rec.total_bytes()
    for plan, rec in ((plain, plain_rec), (strided, strided_rec)):  # (shardwise plan's count)
        assert step_traffic(plan, 0, None).total == rec.total_bytes(), rec.summary()
    if proj:  # (the same collectives less the gathers; c_attn and c_fc only: strided trades
        # plain's gathers for Megatron's AllReduces, fewer bytes, more latency at these sizes)
        assert planner.plan_cost(strided).total < planner.plan_cost(plain).total
    where = "transformer.h.0.attn/split input 0"
    plain_at = Counter((c.kind, c.axes) for c in plain.collectives() if c.where == where)
    assert plain_at == Counter({("AllGather", ("g1",) if dp > 1 else ("g0",)): 1})
    assert not [c for c in strided.collectives() if "attn/" in c.where or "c_attn" in c.where]
    # the strided weight and bias: each rank holds its heads of q, k and v
    weight = strided.params["transformer.h.0.attn.c_attn.weight"].layout
    assert weight.groups == (3, 1) and weight.local_ranges(1, (96, 32))[0] == (
        range(96 // 3 // mp, 2 * 96 // 3 // mp),
        range(32 + 32 // mp, 32 + 2 * 32 // mp),
        range(64 + 32 // mp, 64 + 2 * 32 // mp),
    )
    assert strided.params["transformer.h.0.attn.c_attn.bias"].layout.groups == (3,)
    split = strided.node("transformer.h.0.attn/split")
    assert split.rule == "shardwise" and "strided" in str(split.inputs[0])
    assert all(o.layout.split_count(2) == mp for o in split.outputs)
    assert planner.ParallelPlan.from_dict(strided.to_dict()) == strided


def test_semi_auto_megatron_drops_the_alltoalls() -> None:
    """semi_auto with all four annotated at 2 x 2: plain c_attn moves q/k/v to rows and back
    (2 AlltoAlls a layer); strided keeps the heads split, as separate q/k/v projections do."""
    plain, plain_rec = train(2, 2, "plain", True, "semi_auto")
    strided, strided_rec = train(2, 2, "strided", True, "semi_auto")
    assert plain_rec.kinds() == expected(2, 2, "plain", True, "semi_auto"), plain_rec.summary()
    assert strided_rec.kinds() == expected(2, 2, "strided", True, "semi_auto")
    assert plain_rec.count("AlltoAll") == 4 * LAYERS and strided_rec.count("AlltoAll") == 0
    assert strided_rec.total_bytes() < plain_rec.total_bytes()
    assert planner.plan_cost(strided).total < planner.plan_cost(plain).total
    for plan, rec in ((plain, plain_rec), (strided, strided_rec)):  # (shardwise plan's count)
        assert step_traffic(plan, 0, None).total == rec.total_bytes(), rec.summary()


def test_delayed_init_cuts_the_strided_rows() -> None:
    """GPT-2 built inside ``sw.no_init_parameters()``: at planning each rank materializes its
    strided rows of c_attn (its heads of q, k and v), equal to the eager build's same rows."""
    x, y, _, _ = reference()
    eager = GPT2()
    with sw.no_init_parameters():
        net = annotate(GPT2(), 1, 2, "strided", False)
    with simulated_world(2) as world:
        plan = sw.AutoParallel(net).plan(world.rows(x), world.rows(y))
        for name, p in eager.named_parameters():
            layout = plan.params[name].layout
            got = net.get_parameter(name).detach()
            same(got, lambda r, p=p, t=layout: p.detach()[t.local_index(r, tuple(p.shape))])
        assert tuple(net.transformer.h[0].attn.c_attn.weight.shape) == (48, 32)
        assert tuple(net.transformer.h[0].attn.c_attn.bias.shape) == (48,)


def test_delayed_init_attention_trains_like_one_device() -> None:
    """nanoGPT's attention alone (c_attn strided over 4 ranks: one head each), built inside
    ``sw.no_init_parameters()``: loss and gathered gradients equal the eager single device."""
    cfg = GPT2Config()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, cfg.block_size, cfg.n_embd, generator=g)
    torch.manual_seed(5)
    eager = CausalSelfAttention(cfg)
    want = eager(x).square().mean()
    want.backward()
    layout = sw.Layout((1, 4), ("dp", "mp"))
    torch.manual_seed(5)
    with sw.no_init_parameters():
        attn = CausalSelfAttention(cfg)
    strategy = (layout("dp", "None"), layout(sw.strided("mp", 3), "None"))
    sw.shard(attn.c_attn, in_strategy=strategy)
    with simulated_world(4) as world:
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
    # x's rows gathered for c_attn; attention's heads to rows for the unannotated (data
    # parallel) c_proj and back in backward; the loss; c_proj's gradient bucket
    world4 = (0, 1, 2, 3)
    assert rec.kinds() == Counter(
        {
            ("AllGather", "forward", world4): 1,
            ("AlltoAll", "forward", world4): 1,
            ("AlltoAll", "backward", world4): 1,
            ("AllReduce", "forward", world4): 1,
            ("AllReduce", "backward", world4): 1,
        }
    ), rec.summary()


def test_a_group_count_that_does_not_divide_the_rows_is_refused() -> None:
    layout = sw.Layout((1, 2), ("dp", "mp"))
    net = GPT2()
    sw.shard(
        net.transformer.h[0].attn.c_attn,
        in_strategy=(layout("dp", "None"), layout(sw.strided("mp", 5), "None")),
    )
    x, y, _, _ = reference()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(lambda a, b: net(a, b)[1], network=net)
        with pytest.raises(ValueError) as err:
            parallel(world.rows(x), world.rows(y))
    text = str(err.value)
    for part in ("transformer.h.0.attn.c_attn", "input 1 (weight)", "dim 0 of size 96",
                 "5 strided groups", "axis mp", "strided('mp', k)"):  # fmt: skip
        assert part in text, text


def test_strided_only_on_the_weights_output_features() -> None:
    layout = sw.Layout((1, 2), ("dp", "mp"))
    net = GPT2()
    sw.shard(
        net.transformer.h[0].attn.c_attn,
        in_strategy=(layout("dp", "None"), layout("None", sw.strided("mp", 2))),
    )
    x, y, _, _ = reference()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(lambda a, b: net(a, b)[1], network=net)
        with pytest.raises(ValueError, match=r"input 1 dim 1 is strided .* output features"):
            parallel(world.rows(x), world.rows(y))


def test_strided_qkv_with_optimizer_parallel() -> None:
    """hsdp level 3 on top of the strided Megatron plan at 2 x 2 (each strided block sharded
    over its dp replicas): two AdamW steps' losses and updated parameters equal one device's."""
    want, steps = megatron_reference(), batches()
    net = annotate(GPT2(), 2, 2, "strided", True)
    with simulated_world(4) as world:
        world.replicate(net)
        opt = net.configure_optimizers(weight_decay=0.1, **ADAM)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = net(a, b)[1]
            assert loss is not None
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step).hsdp(threshold=0, optimizer_level="level3")
        for s, (a, b) in enumerate(steps):
            same(parallel(world.rows(a), world.rows(b)), want[s][0], what=f"loss {s}")
            plan = parallel.optimizer_plan
            assert plan is not None
            for name, p in net.named_parameters():
                same(p.detach(), shard_rows(plan, name, want[s][2][name]), what=f"{s} {name}")


def shard_rows(plan: OptimizerPlan, name: str, full: torch.Tensor) -> Callable[[int], torch.Tensor]:
    """rank -> the part of the single-device `full` its optimizer shard of `name` holds: its
    block (`local_index`: the strided rows of c_attn), then its rows of it over dp."""
    shard = plan.param(name)
    layout, shape = shard.info.layout, shard.info.shape

    def rows(r: int) -> torch.Tensor:
        block = full[layout.local_index(r, shape)]
        if not shard.sharded:
            return block
        members = layout.matrix.group_along(r, shard.dp_axes)
        pos, n = members.index(r) % shard.shard, shard.shard_shape[0]
        return block[pos * n : (pos + 1) * n]

    return rows
