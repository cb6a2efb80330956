"""``sw.shard``'s op form on torch modules and ``sw.reshard`` in networks of plain torch ops.

The op form gives an ``nn.Linear`` or ``nn.Embedding`` the strategy of its op (one entry per
tensor: input, weight), as a primitive's ``shard()`` would. ``sw.reshard`` pins an activation's
layout; both are nodes of the captured graph and carried out from the plan. Each network
equals one device (output, loss and every gradient block, 1e-5), with its collectives asserted
exactly; bad annotations give errors naming the module and the fix.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.planner import ParallelPlan, PlanError
from shardwise.planner._graph import op_strategy
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

LAYOUT = sw.Layout((2, 2), ("dp", "mp"))
WORLD, ALL, MP, DP = 4, (0, 1, 2, 3), (0, 1), (0, 2)


class Tagger(nn.Module):
    """Embedding (split on the embedding dim) -> Linear (row parallel) -> per-token loss."""

    def __init__(self, emb: tuple = ((2, 1), (1, 2)), head: tuple = ((2, 2), (1, 2))) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = sw.shard(nn.Embedding(16, 8), in_strategy=emb)
        self.head = sw.shard(nn.Linear(8, 5), in_strategy=head)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.emb(ids))
        return F.cross_entropy(logits.view(-1, 5), y.view(-1))


class Resharded(nn.Module):
    """Two Linears with an activation pinned to (dp, mp) between them by ``sw.reshard``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = sw.reshard(torch.relu(self.fc1(x)), LAYOUT("dp", "mp"))
        return F.mse_loss(self.fc2(h), y)


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16, (8, 3), generator=g)
    labels = torch.randint(0, 5, (8, 3), generator=g)
    return ids, labels, torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def train_once(
    make: type[nn.Module], x: torch.Tensor, y: torch.Tensor
) -> tuple[sw.AutoParallel, CommRecorder]:
    """One step on 4 simulated ranks against one device: the loss and every gradient block."""
    ref = make()
    want = ref(x, y)
    want.backward()
    net = make()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        grads: dict[str, torch.Tensor] = {}

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = net(a, b)
            loss.backward()
            grads.update({n: p.grad for n, p in net.named_parameters()})
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        with CommRecorder() as rec:
            loss = parallel(world.rows(x), world.rows(y))
        assert_matches_single_device(loss, want.detach(), what="loss")
        plan = parallel.parallel_plan
        assert plan is not None
        for name, p in ref.named_parameters():
            layout, full = plan.params[name].layout, p.grad

            def block(r: int, f: torch.Tensor = full, a: object = layout) -> torch.Tensor:
                return f[a.local_slice(r, tuple(f.shape))]  # type: ignore[attr-defined]

            assert_matches_single_device(grads[name], block, what=name)
    return parallel, rec


def test_embedding_and_linear_op_form() -> None:
    ids, labels, _, _ = data()
    parallel, rec = train_once(Tagger, ids, labels)
    plan = parallel.parallel_plan
    assert plan is not None
    assert str(plan.params["emb.weight"].layout).count("None") == 1  # split on the embedding dim
    assert plan.params["emb.weight"].layout.local_shape((16, 8)) == (16, 4)
    assert plan.params["head.weight"].layout.local_shape((5, 8)) == (5, 4)
    edges = [str(e) for e in plan.edges if e.kept]
    assert edges == [
        "param:head.bias (None) -> (None) partial-sum[g1]: kept on the first rank of g1"
    ]
    assert rec.kinds() == Counter(
        {
            ("AllGather", "forward", MP): 1,  # ids: rows over all -> over dp
            ("ReduceScatter", "forward", MP): 1,  # head: row parallel, summed to rows over all
            ("AllReduce", "forward", ALL): 1,  # the loss, on each rank's rows
            ("AllGather", "backward", MP): 1,  # (its adjoint)
            ("AllReduce", "backward", ALL): 1,  # head.bias: whole, one bucket
            ("AllReduce", "backward", DP): 1,  # emb.weight, head.weight: split over mp
        }
    ), rec.summary()


def test_reshard_is_a_graph_op(tmp_path: Path) -> None:
    _, _, x, y = data()
    parallel, rec = train_once(Resharded, x, y)
    plan = parallel.parallel_plan
    assert plan is not None
    node = next(n for n in plan.nodes if n.op == "shardwise.reshard")
    assert node.rule == "user" and str(node.outputs[0]) == "(g0, g1)"
    # fc2 cannot follow h's columns split (its rule would move an intermediate), so it takes
    # semi_auto's data-parallel strategy: h goes (dp, mp) -> rows over all and back
    assert str(plan.nodes[node.index + 1].inputs[0]) == "((g0, g1), None)"
    assert rec.kinds() == Counter(
        {
            ("AlltoAll", "forward", MP): 2,  # rows -> (dp, mp) at the reshard; back for fc2
            ("AlltoAll", "backward", MP): 2,  # (their adjoints)
            ("AllReduce", "forward", ALL): 1,  # the loss
            ("AllReduce", "backward", ALL): 1,  # every gradient, one bucket
        }
    ), rec.summary()
    plan.save(tmp_path / "plan.json")
    assert ParallelPlan.load(tmp_path / "plan.json") == plan


def test_op_form_next_to_a_primitive() -> None:
    """An annotated nn.Linear (column parallel) feeding a shardwise primitive: one plan for
    both; the output rows equal one device's."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(5)
            self.fc = sw.shard(nn.Linear(8, 8), in_strategy=((2, 1), (2, 1)))
            self.relu = sw.ops.ReLU().shard(((2, 2),))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.relu(self.fc(x))
            return out

    x = torch.randn(8, 8)
    want = Mixed()(x).detach()
    net = Mixed()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        rows = world.rows(x)
        parallel = sw.AutoParallel(net)
        got = parallel(rows)
        assert_matches_single_device(got, lambda r: want[2 * r : 2 * r + 2])
        plan = parallel.parallel_plan
        assert plan is not None
        assert [n.rule for n in plan.nodes] == ["user", "user"]


@pytest.mark.parametrize(
    ("emb", "head", "match"),
    [
        # the vocabulary split (Gather's masked lookup) is not in the op form yet
        # (the example keeps the job's 4 devices: the vocabulary's 2 moved to the embedding dim)
        (((2, 1), (2, 1)), ((2, 2), (1, 2)), r"emb .*vocabulary.*e\.g\. \(\(2, 1\), \(1, 2\)\)"),
        # 5 output features cannot be split 2 ways
        (((2, 1), (1, 2)), ((2, 1), (2, 1)), r"head.*5"),
        # one axis on the ids' rows and the embedding dim: named as nn.Linear's are (it was
        # worded in DTensor placements: "cannot take input 0 as annotated ((Shard(dim=0), ...")
        (
            (LAYOUT("dp", "None"), LAYOUT("None", "dp")),
            (LAYOUT("dp", "mp"), LAYOUT("None", "mp")),
            r"emb .*: device axis 'dp' splits both input 0 \(ids\) dim 0 and input 1 \(weight\) "
            r"dim 1 \(the embedding dim\); .*use another axis or 'None' for one of them",
        ),
        # a weight layout of the wrong rank: with the fix, as other rank errors
        (
            (LAYOUT("dp", "None"), LAYOUT("mp")),
            (LAYOUT("dp", "mp"), LAYOUT("None", "mp")),
            r"emb .*: input 1 \(weight\) has 2 dims \(shape \[16, 8\]\) but its Layout call "
            r"layout\('mp'\) has 1; give one alias or 'None' per dim",
        ),
    ],
)
def test_bad_op_form_strategies(emb: tuple, head: tuple, match: str) -> None:
    ids, labels, _, _ = data()
    net = Tagger(emb, head)
    with simulated_world(WORLD) as world:
        parallel = sw.AutoParallel(lambda a, b: net(a, b), network=net)
        with pytest.raises(PlanError, match=match):
            parallel(world.rows(ids), world.rows(labels))


def test_op_form_refuses_out_strategy() -> None:
    linear = nn.Linear(8, 8)
    with pytest.raises(ValueError, match="op form of Linear"):
        sw.shard(linear, in_strategy=((2, 1), (2, 1)), out_strategy=((2, 1),))
    assert op_strategy(linear) is None  # (nothing half set)


class _TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.fc1, self.fc2 = nn.Linear(8, 6), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)


def test_op_form_takes_the_strategy_strategies_prints() -> None:
    """``strategies()`` prints an ``nn.Linear``'s op with its bias (input, weight, bias);
    given back to ``sw.shard`` it plans as the two-entry form (it was refused as three inputs
    of a one-input forward). A bias entry that does not split as the weight's rows is refused
    naming the two-entry form."""
    _, _, x, y = data()
    printed, again = _TwoLinears(), _TwoLinears()
    sw.shard(printed.fc1, in_strategy=((2, 1), (2, 1)))
    strategies = []
    for net in (printed, again):
        with simulated_world(WORLD) as world:
            world.replicate(net)
            parallel = sw.AutoParallel(lambda a, b, net=net: net(a, b), network=net)
            parallel(world.rows(x), world.rows(y))
            strategies.append(parallel.strategies())
        if net is printed:
            assert strategies[0]["fc1/linear"] == ((2, 1), (2, 1), (2,))
            sw.shard(again.fc1, in_strategy=strategies[0]["fc1/linear"])
    assert strategies[1] == strategies[0]
    with pytest.raises(ValueError, match=r"bias \(1,\) must be split as the weight's rows"):
        sw.shard(nn.Linear(8, 6), in_strategy=((2, 1), (2, 1), (1,)))
    layouts = (LAYOUT("dp", "None"), LAYOUT("mp", "None"), LAYOUT("mp"))
    assert op_strategy(sw.shard(nn.Linear(8, 6), in_strategy=layouts)) == layouts[:2]


class Residual(nn.Module):
    """A block whose input is resharded by ``sw.shard`` while the residual uses it as is."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.sub = sw.shard(nn.Linear(8, 8), in_strategy=(LAYOUT("dp", "mp"),))
        self.scale = nn.Parameter(torch.full((8,), 0.5))

    def forward(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.sub(h) + h * self.scale, y)


def test_resharded_input_and_its_original_are_two_values() -> None:
    """``sw.shard(module, in_strategy=...)`` moves the module's input; the residual still
    reads the original, in its own layout."""
    _, _, x, _ = data()
    y = torch.randn(8, 8, generator=torch.Generator().manual_seed(9))
    parallel, _ = train_once(Residual, x, y)
    plan = parallel.parallel_plan
    assert plan is not None
    reshard = next(n for n in plan.nodes if n.op == "shardwise.reshard")
    assert str(reshard.outputs[0]) == "(g0, g1)"


class ScaledLinear(nn.Linear):
    """A user's ``nn.Linear`` subclass; with `twice`, its forward makes two torch calls."""

    def __init__(self, twice: bool = False) -> None:
        super().__init__(8, 8)
        self.twice = twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        return out * 2 if self.twice else out


def test_op_form_on_a_linear_subclass() -> None:
    """An ``nn.Linear`` subclass takes the op form as ``nn.Linear`` does (column parallel:
    its weight stored as row blocks, the returned rows equal one device's); one whose forward
    makes a second call is refused naming the module, that call and the fix."""
    torch.manual_seed(7)
    net, x = sw.shard(ScaledLinear(), in_strategy=((2, 1), (2, 1))), torch.randn(8, 8)
    want = net(x).detach()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net)
        with CommRecorder() as rec:
            got = parallel(world.rows(x))
        plan = parallel.parallel_plan
        assert plan is not None and plan.nodes[0].rule == "user"
        assert plan.params["weight"].layout.local_shape((8, 8)) == (4, 8)
        assert_matches_single_device(got, lambda r: want[2 * r : 2 * r + 2])  # (rows, returned)
        assert rec.kinds() == Counter(  # rows over dp in; the columns back to rows over all
            {("AllGather", "forward", MP): 1, ("AlltoAll", "forward", MP): 1}
        ), rec.summary()
    twice = sw.shard(ScaledLinear(twice=True), in_strategy=((2, 1), (2, 1)))
    with simulated_world(WORLD) as world:
        world.replicate(twice)
        with pytest.raises(ValueError, match=r"sw.shard on .*also called .*mul.*reshard"):
            sw.AutoParallel(twice)(world.rows(x))


def test_a_view_that_cuts_a_split_dim_unevenly_is_a_plan_error() -> None:
    """A column-parallel Linear's 6 output features split 2 ways, then viewed as (3, 2): no
    rule splits 3 evenly, so planning stops with a PlanError naming the op, the split dim, the
    layer that split it and the fix (it is not silently run data parallel instead; the fix
    asked for a divisible global batch)."""

    class Uneven(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = sw.shard(nn.Linear(8, 6), in_strategy=((1, 1), (2, 1)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).view(4, 3, 2)

    net, x = Uneven(), torch.randn(4, 8)
    with simulated_world(2) as world:
        world.replicate(net)
        fix = r"view .*unevenly sharded.* Fix: the op cuts input 0 \(global shape \[4, 6\], dim 1 "
        fix += r"split in 2\) \(made by lin/linear\)"
        with pytest.raises(PlanError, match=fix + r".*make the groups .*sw.strided"):
            sw.AutoParallel(net)(world.rows(x))


class StridedIds(nn.Module):
    """An embedding whose ids are split over ``("mp", "dp")``: the later mesh axis outer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        ids_layout = LAYOUT(("mp", "dp"), "None")
        self.emb = sw.shard(nn.Embedding(16, 8), in_strategy=(ids_layout, LAYOUT("None", "None")))

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.emb(ids).sum(-1), y.float())


def test_embedding_ids_split_with_the_later_axis_outer() -> None:
    """A valid MindSpore layout that DTensor's embedding rule cannot take (its placement is
    strided): the op form was refused ('the sharding rule ... cannot take input 0 as
    annotated'); the lookup now keeps the ids' placement
    (`aten_rules.strided_ids_embedding_rule`)."""
    ids, labels, _, _ = data()
    parallel, rec = train_once(StridedIds, ids, labels)
    plan = parallel.parallel_plan
    assert plan is not None
    node = plan.nodes[0]
    placed = (str(node.inputs[0]), str(node.outputs[0]))
    assert placed == ("((g1, g0), None)", "((g1, g0), None, None)")
    assert rec.kinds() == Counter(
        {  # (rows over (dp, mp) to (mp, dp) and the lookups back: a strided move gathers the
            # dim, over both axes in one AllGather, docs/redistribution.md; its adjoint a
            # ReduceScatter)
            ("AllGather", "forward", ALL): 2,
            ("AllReduce", "forward", ALL): 1,  # the loss
            ("ReduceScatter", "backward", ALL): 1,
            ("AllReduce", "backward", ALL): 1,  # emb.weight: whole
        }
    ), rec.summary()


class _Attention(nn.Module):
    """nn.MultiheadAttention, whose out_proj is never called as a module (its weights go to
    F.multi_head_attention_forward), and a branch that uses an annotated head only on a flag."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True, dropout=0.0)
        self.head = nn.Linear(16, 3)
        self.spare = sw.shard(nn.Linear(16, 3), in_strategy=((2, 2), (1, 2)))  # (never used)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out, _ = self.mha(x, x, x, need_weights=False)
        return F.cross_entropy(self.head(out.mean(1)), y)


def test_op_form_on_a_module_never_called_is_refused() -> None:
    """``sw.shard`` on ``nn.MultiheadAttention.out_proj`` was silently ignored (the plan was
    plain data parallel): the op form applies to the module's own call, which never happens.
    It is a PlanError naming the module, the op that used its weights, and the fix; an
    annotated module whose weights the step uses in no op of its own kind (`spare`, only in an
    L2 penalty over every parameter) is no error."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 5, 16, generator=g), torch.randint(0, 3, (8,), generator=g)
    net = _Attention()
    with simulated_world(WORLD) as world:
        world.replicate(net)

        def penalized(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # (L2 over all)
            return net(a, b) + 1e-4 * sum(p.square().sum() for p in net.parameters())

        parallel = sw.AutoParallel(penalized, network=net)
        parallel(world.rows(x), world.rows(y))  # (spare: only in the penalty, no error)
    net = _Attention()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        sw.shard(net.mha.out_proj, in_strategy=((2, 2), (1, 2)))
        parallel = sw.AutoParallel(lambda a, b: net(a, b), network=net)
        match = (
            r"sw.shard on mha.out_proj .*never called as a module during the step; its weights "
            r"are used directly by another op, multi_head_attention_forward in mha .*Annotate a "
            r"module that is called, write the projection as a called nn.Linear, or remove"
        )
        with pytest.raises(PlanError, match=match):
            parallel(world.rows(x), world.rows(y))


@pytest.mark.parametrize(
    ("make", "strategy", "x", "match"),
    [
        # a 3-D input with an entry per dim: it said "input 0 (x) has 2 dims" (it has 3) and
        # named no module ("PlanError  (torch.nn.functional.linear ...")
        (
            lambda: nn.Linear(8, 8),
            ((1, 1, 1), (2, 1)),
            torch.randn(4, 3, 8),
            r"^sw.shard on the top-level nn.Linear \(torch.nn.functional.linear at .*\): "
            r"nn.Linear's op form takes 2 entries for input 0 \(x\): \(rows, in_features\) "
            r"whatever the input's rank \(rows: its dim 0; this input has shape \[4, 3, 8\]\); "
            r"its strategy \(1, 1, 1\) has 3; give 2, e.g. \(1, 1\)",
        ),
        (
            lambda: nn.Linear(8, 8),
            ((2, 1), (1, 1, 1)),
            torch.randn(4, 3, 8),
            r"nn.Linear's op form takes 2 entries for input 1 \(weight\): "
            r"\(out_features, in_features\); its strategy \(1, 1, 1\) has 3",
        ),
        (
            lambda: nn.Embedding(16, 8),
            ((2, 1, 1), (1, 1)),
            torch.randint(0, 16, (4, 3)),
            r"^sw.shard on the top-level nn.Embedding \(torch.nn.functional.embedding at .*\): "
            r"input 0 \(ids\) has 2 dims but its strategy \(2, 1, 1\) has 3 values",
        ),
    ],
)
def test_op_form_entry_counts_name_the_reading_and_the_module(
    make: object, strategy: tuple, x: torch.Tensor, match: str
) -> None:
    torch.manual_seed(0)
    module = make()  # type: ignore[operator]
    y = torch.randn(4, 3, 8)
    with simulated_world(2) as world:
        sw.shard(module, in_strategy=strategy)
        world.replicate(module)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = F.mse_loss(module(a), b)
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        with pytest.raises(PlanError, match=match):
            parallel(world.rows(x), world.rows(y))


@pytest.mark.parametrize("batch_first", [False, True])
def test_megatron_on_a_sequence_first_encoder_layer_names_dim_0(batch_first: bool) -> None:
    """The op form splits nn.Linear's input over dim 0, which is the sequence (5) in torch's
    default sequence-first ``nn.TransformerEncoderLayer``: the PlanError said "use a batch
    divisible by 2" although the batch (8) divides. It now names dim 0, its size and shape, and
    the fixes; with ``batch_first=True`` the layer trains as one device."""

    def make() -> nn.TransformerEncoderLayer:
        torch.manual_seed(0)
        return nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=batch_first)

    x = torch.randn(8, 5, 16, generator=torch.Generator().manual_seed(1))  # (batch 8, seq 5)
    order = (lambda t: t) if batch_first else (lambda t: t.transpose(0, 1))
    want = make()(order(x)).pow(2).mean()
    net = make()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        sw.shard(net.linear1, in_strategy=((2, 1), (2, 1)))
        sw.shard(net.linear2, in_strategy=((2, 2), (1, 2)))

        def step(a: torch.Tensor) -> torch.Tensor:
            loss = net(order(a)).pow(2).mean()
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        if batch_first:
            assert_matches_single_device(parallel(world.rows(x)), want.detach(), what="loss")
            return
        with pytest.raises(PlanError) as caught:
            parallel(world.rows(x))
    said = str(caught.value)
    assert "sw.shard on linear1" in said, said
    assert "splits dim 0 of the input (nn.Linear's rows) 2 ways" in said, said
    assert "shape [5, 8, 16], has 5 entries in dim 0" in said, said
    assert "batch_first=True" in said and "a dim 0 divisible by 2" in said, said
    assert "use a batch divisible" not in said, said
