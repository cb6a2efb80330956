"""sharding_propagation under `AutoParallel` on 2, 4 and 8 simulated ranks: seed 002's network
(MatMul annotated, ReLU and MatMul propagated) trained as the seed trains it (MSE loss, momentum
SGD lr 0.2 / momentum 0.1) equals one device: every loss, every parameter block after every
step; the collectives of a step are asserted exactly. Also reachable through
``set_auto_parallel_context(parallel_mode=AUTO_PARALLEL, search_mode="sharding_propagation")``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.parallel import AutoParallel
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..planner.test_plan import step_of
from ..planner.test_propagate import Seed002

STEPS, LR, MOMENTUM = 3, 0.2, 0.1
Strategy = tuple[tuple[int, int], tuple[int, int]]


def _data(batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.rand(batch, 32, generator=g), torch.rand(batch, 16, generator=g))] * STEPS


def _net(strategy: Strategy) -> Seed002:
    net = Seed002(annotate=False)
    net.matmul.shard(strategy)
    return net


def _single(
    strategy: Strategy,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """One device: each step's loss and the parameters after it."""
    net = _net(strategy)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    losses, params = [], []
    for x, y in batches:
        loss = F.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        params.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return losses, params


def _train(
    ranks: int, strategy: Strategy, context: bool = False, load: Path | None = None
) -> tuple[AutoParallel, Counter[tuple[str, str, tuple[int, ...]]]]:
    """STEPS steps on `ranks` ranks checked against one device; the first step's collectives."""
    batches = _data(2 * ranks)  # (seed 002: 2 rows per rank)
    want, after = _single(strategy, batches)
    net = _net(strategy)
    kinds: Counter[tuple[str, str, tuple[int, ...]]] = Counter()
    with simulated_world(ranks) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        mode = None if context else "sharding_propagation"
        parallel = AutoParallel(step, parallel_mode=mode)
        if load is not None:
            parallel.load_operator_strategy_file(load)
        for s, (x, y) in enumerate(batches):
            with CommRecorder() as rec:
                loss = parallel(world.rows(x), world.rows(y))
            kinds = kinds or rec.kinds()
            assert_matches_single_device(loss, want[s], what=f"loss {s}")
            plan = parallel.parallel_plan
            assert plan is not None
            for name, p in net.named_parameters():
                layout, shape = plan.param_layouts()[name]
                full = after[s][name]
                assert_matches_single_device(
                    p.detach(),
                    lambda r, f=full, a=layout, s=shape: f[a.local_slice(r, s)],
                    what=f"{name} after step {s}",
                )
    return parallel, kinds


G4 = (0, 1, 2, 3)
W8 = (0, 1, 2, 3, 4, 5, 6, 7)


def test_seed002_on_8_ranks() -> None:
    parallel, kinds = _train(8, ((2, 4), (4, 1)))
    assert parallel.strategies() == {
        "matmul/MatMul": ((2, 4), (4, 1)),
        "relu/ReLU": ((2, 4),),
        "matmul2/MatMul": ((2, 4), (4, 1)),
        "mse_loss": ((8, 1), (8, 1)),
    }
    assert kinds == Counter(
        {
            ("AlltoAll", "forward", G4): 1,  # the input rows to matmul's (2, 4)
            ("AllReduce", "forward", G4): 2,  # matmul and matmul2: K split over 4
            ("AllReduce", "forward", W8): 1,  # the loss
            ("AllReduce", "backward", G4): 2,  # the adjoints of matmul's and matmul2's
            ("AllReduce", "backward", (0, 4)): 1,  # both weights' gradients: one bucket over dp
        }
    )


@pytest.mark.parametrize(
    ("ranks", "strategy", "relu", "matmul2"),
    [
        (2, ((1, 2), (2, 1)), ((1, 2),), ((1, 2), (2, 1))),
        (4, ((2, 2), (2, 1)), ((2, 2),), ((2, 2), (2, 1))),
    ],
    ids=["2", "4"],
)
def test_seed002_on_2_and_4_ranks(
    ranks: int,
    strategy: Strategy,
    relu: tuple[tuple[int, ...], ...],
    matmul2: tuple[tuple[int, ...], ...],
) -> None:
    parallel, kinds = _train(ranks, strategy)
    got = parallel.strategies()
    assert got["relu/ReLU"] == relu and got["matmul2/MatMul"] == matmul2
    plan = parallel.parallel_plan
    assert plan is not None
    forward = Counter({k: n for k, n in kinds.items() if k[1] == "forward"})
    planned = Counter(c.kind for c in plan.collectives())
    assert Counter(k[0] for k in forward.elements()) == planned


def test_the_context_way() -> None:
    try:
        sw.set_auto_parallel_context(
            parallel_mode=sw.ParallelMode.AUTO_PARALLEL, search_mode="sharding_propagation"
        )
        parallel, _ = _train(8, ((2, 4), (4, 1)), context=True)
    finally:
        sw.reset_auto_parallel_context()
    assert parallel.parallel_mode == "sharding_propagation"
    assert parallel.strategies()["relu/ReLU"] == ((2, 4),)


def test_strategies_explain_and_a_saved_plan_runs_without_search(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`strategies()` / `explain()` read the plan; the operator strategy file records the
    propagated strategies, and a wrapper that loads it runs that plan without searching."""
    first, _ = _train(8, ((2, 4), (4, 1)))
    assert first.explain("relu/ReLU").startswith(
        "relu/ReLU: ((2, 4),) (propagated from matmul/MatMul (annotated))"
    )
    with pytest.raises(ValueError, match=r"no op 'relu'.*close: \['relu/ReLU'"):
        first.explain("relu")
    first.save_operator_strategy_file(tmp_path / "plan.json")

    def no_search(*args: object, **kwargs: object) -> None:
        raise AssertionError("searched although a plan was loaded")

    from shardwise.parallel import _graph_capture

    for mode in ("sharding_propagation", "recursive_programming"):  # (the planners it calls)
        monkeypatch.setitem(_graph_capture._PLANNERS, mode, no_search)
    again, _ = _train(8, ((2, 4), (4, 1)), load=tmp_path / "plan.json")
    assert again.parallel_plan == first.parallel_plan
    assert again.strategies() == first.strategies()
    # a loaded plan carries no alternatives: the rule and what the op moves
    loaded = again.explain("relu/ReLU")
    assert loaded.startswith("relu/ReLU: ((2, 4),) (sharding propagation's choice)")
    assert "a sharding_propagation plan loaded from a file carries no alternatives" in loaded


def test_a_conv_net_propagates_from_its_conv() -> None:
    """Only Conv2D is annotated (batch over 2, output channels over 2, 4 ranks): BatchNorm,
    ReLU, MaxPool and Flatten take the conv's (2, 2) layout (no move between them, the unique
    zero-redistribution answer); two steps equal one device."""
    from .test_cnn_parity import LR as LR_CNN
    from .test_cnn_parity import ConvNet, check_blocks, data, single

    def net() -> ConvNet:
        made = ConvNet({"conv": ((2, 1, 1, 1), (2, 1, 1, 1)), "bn": None, "act": None})
        for m in (made.bn, made.relu, made.pool):
            m.in_strategy = None
        return made

    losses, states = single(net())
    model, batches = net(), data()
    with simulated_world(4) as world:
        world.replicate(model)
        parallel = AutoParallel(model, parallel_mode="sharding_propagation")
        opt = torch.optim.SGD(model.parameters(), lr=LR_CNN)
        for step, (x, y) in enumerate(batches):
            logits = parallel(world.rows(x))
            loss = sw.ops.AllReduce()(F.cross_entropy(logits, world.rows(y))) / 4
            loss.backward()
            assert_matches_single_device(loss, torch.tensor(losses[step]), what=f"loss {step}")
            plan = parallel.parallel_plan
            assert plan is not None
            check_blocks(model, plan, states[step])
            opt.step()
            opt.zero_grad()
    got = parallel.strategies()
    assert got["bn/BatchNorm"] == ((2, 2, 1, 1), (2,), (2,), (2,), (2,))
    assert got["relu/ReLU"] == got["pool/MaxPool"] == got["flatten/Flatten"] == ((2, 2, 1, 1),)
    assert [e for e in plan.edges if 0 < e.consumer < 4 and e.steps] == []


@pytest.mark.parametrize("mode", ["sharding_propagation", "semi_auto"])
def test_hugging_face_gpt2_with_an_arange_of_the_local_batch(mode: str) -> None:
    """transformers' causal mask starts from ``torch.arange(batch_size)``, the batch size read
    from this rank's input. The factory now runs with the captured global size where the call
    gave another one (as ops on whole inputs do), so it makes the whole tensor the plan has:
    before, under sharding_propagation, the plan's move of it met this rank's 2 rows instead of
    8 ("redistribute: the local block has shape [2]")."""
    from ..zoo import gpt2_hf, token_batches

    x, _ = token_batches(1, 8)[0]
    single = gpt2_hf()
    want = single(input_ids=x, labels=x).loss
    want.backward()
    net = gpt2_hf()
    with simulated_world(4) as world:
        world.replicate(net)
        grads: dict[str, torch.Tensor] = {}

        def step(ids: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(input_ids=ids, labels=ids).loss
            loss.backward()
            grads.update({n: p.grad.detach().clone() for n, p in net.named_parameters()})
            return loss

        loss = AutoParallel(step, parallel_mode=mode)(world.rows(x))
        assert_matches_single_device(loss, want.detach(), what="loss")
        for name, p in single.named_parameters():
            assert p.grad is not None
            assert_matches_single_device(grads[name], p.grad, what=f"{name}.grad")


@pytest.mark.parametrize("mode", ["sharding_propagation", "recursive_programming"])
def test_a_resnet_with_nothing_annotated_is_data_parallel(mode: str) -> None:
    """A training BatchNorm given split rows keeps them split, its statistics shared
    (`local split_batch_norm`), under the automatic modes too: they had no such candidate, so a
    ResNet gathered its batch after the stem (or split channels) and ran whole on every rank.
    Two steps equal one device; a step moves no activation, only the statistics."""
    from ..zoo import ResNet, image_batches

    batches, ref = image_batches(2, 8, size=8), ResNet(widths=(8, 16))
    one = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for x, y in batches:
        loss = ref(x, y)[1]
        loss.backward()
        one.step()
        one.zero_grad()
        want.append(loss.detach())
    net = ResNet(widths=(8, 16))
    with simulated_world(4) as world:
        world.replicate(net)
        step = step_of(net, torch.optim.SGD(net.parameters(), lr=0.1))
        parallel = AutoParallel(step, parallel_mode=mode)
        for s, (x, y) in enumerate(batches):
            with CommRecorder() as rec:
                loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want[s], what=f"loss {s}")
        for name, p in net.named_parameters():
            assert_matches_single_device(p.detach(), ref.get_parameter(name).detach(), what=name)
    plan = parallel.parallel_plan
    assert plan is not None
    norms = [n for n in plan.nodes if n.op.endswith("batch_norm")]
    assert len(norms) == 6 and all(n.local == "split_batch_norm" for n in norms)
    assert all(n.in_strategy[0] == (4, 1, 1, 1) for n in norms)
    forward = Counter(r.kind for r in rec.records if r.phase == "forward")
    assert forward == Counter({"AllGather": 6, "AllReduce": 1})  # (statistics; the loss)


class Interleaved(torch.nn.Module):
    """A weight annotated with its dim 0 split over every axis in reverse mesh order (the
    later axes outer: ``("mp", "dp")``), behind an unannotated ReLU."""

    def __init__(self, names: tuple[str, ...], shape: tuple[int, ...]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(48, 24))
        self.relu = sw.ops.ReLU()
        layout, split = sw.Layout(shape, names), tuple(reversed(names))
        self.mm = sw.ops.MatMul().shard((layout("None", split), layout(split, "None")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mm(self.relu(x), self.w).square().mean()


@pytest.mark.parametrize(
    ("names", "shape"), [(("dp", "mp"), (2, 4)), (("c", "b", "a"), (2, 2, 2))], ids=["2x4", "2x2x2"]
)
def test_an_interleaved_annotation_stores_its_weight_as_annotated(
    names: tuple[str, ...], shape: tuple[int, ...]
) -> None:
    """sharding_propagation stores the weight as the annotation reads it ([6, 24] per rank), as
    semi_auto does: only mesh-order splits were storage candidates, so it stored the weight
    split over fewer axes ([12, 24]), sliced it every step and all-reduced its gradient over
    the others. Both modes now move the same (but the loss, which propagation reduces as a
    scalar); loss and gradients equal one device's."""
    from ..zoo import assert_grad_blocks_match

    x = torch.randn(16, 48, generator=torch.Generator().manual_seed(1))
    ref = Interleaved(names, shape)
    want = ref(x)
    want.backward()
    moved: dict[str, Counter[tuple[str, str, tuple[int, ...]]]] = {}
    for mode in ("semi_auto", "sharding_propagation"):
        net = Interleaved(names, shape)
        with simulated_world(8) as world:
            world.replicate(net)
            parallel = AutoParallel(net, parallel_mode=mode)
            with CommRecorder() as rec:
                loss = parallel(world.rows(x))
                loss.backward()
            assert_matches_single_device(loss, want.detach(), what=f"{mode} loss")
            assert_grad_blocks_match(parallel, net, ref)
            assert world.local(net.w, 0).shape == (6, 24)
        plan = parallel.parallel_plan
        assert plan is not None
        layout, full = plan.param_layouts()["w"]
        assert layout.local_shape(full) == (6, 24)
        assert [e for e in plan.edges if e.value == "param:w" and e.steps] == []  # (no Slice)
        assert [r.label for r in rec.records if r.label] == []  # (no gradient bucket)
        moved[mode] = Counter((r.kind, r.phase, r.group) for r in rec.records if r.numel > 1)
    assert moved["sharding_propagation"] == moved["semi_auto"]


def test_hugging_face_llama_mlp_takes_megatron_from_two_annotations() -> None:
    """HF's LlamaMLP with ``gate_proj`` column- and ``down_proj`` row-parallel on dp 2 x mp 2:
    ``up_proj`` reads the value gate_proj's input was gathered for, and goes column-parallel
    too (one AllGather and one ReduceScatter over mp per layer). Its activation had more
    placements than every combination covers (then one input is varied at a time), and the
    column-parallel weight with the activation gathered for gate_proj was never tried: up_proj
    went row-parallel, and its partial sum cost a second ReduceScatter."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    net = LlamaForCausalLM(cfg)
    single = LlamaForCausalLM(cfg)
    single.load_state_dict(net.state_dict())
    mlp = net.model.layers[0].mlp
    sw.shard(mlp.gate_proj, in_strategy=((2, 1), (2, 1)))
    sw.shard(mlp.down_proj, in_strategy=((2, 2), (1, 2)))
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    want = single(input_ids=ids, labels=ids).loss
    with simulated_world(4) as world:
        world.replicate(net)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(input_ids=x, labels=x).loss
            loss.backward()
            return loss

        parallel = AutoParallel(step, parallel_mode="sharding_propagation")
        with CommRecorder() as rec:
            assert_matches_single_device(parallel(world.rows(ids)), want.detach(), what="loss")
    assert parallel.strategies()["model.layers.0.mlp.up_proj/linear"] == ((2, 1, 1), (2, 1))
    forward = Counter((r.kind, r.group) for r in rec.select(phase="forward"))
    assert forward == {
        ("AllGather", (0, 1)): 1,
        ("ReduceScatter", (0, 1)): 1,
        ("AllReduce", (0, 1, 2, 3)): 1,
    }, forward


class SortedMoE(torch.nn.Module):
    """A sorted-dispatch MoE: every expert reads ``x.index_select(0, token_index)`` (whole on
    every rank), its outputs gathered by the router's top-k and added back with
    ``index_add_``."""

    def __init__(self, d: int = 8, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.k = k
        self.router = torch.nn.Linear(d, experts, bias=False)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(d, d) for _ in range(experts)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        d = x.shape[1]
        top_v, top_i = torch.topk(F.softmax(self.router(x), -1), self.k, -1)
        token = torch.arange(x.shape[0]).repeat_interleave(self.k)
        ys = torch.stack([ex(x.index_select(0, token)) for ex in self.experts], 1)
        picked = torch.gather(ys, 1, top_i.reshape(-1, 1, 1).expand(-1, 1, d)).squeeze(1)
        out = torch.zeros_like(x).index_add_(0, token, picked * top_v.reshape(-1, 1))
        return F.mse_loss(out, y)


def moe_propagated() -> AutoParallel:
    """One step of `SortedMoE` under sharding_propagation, nothing annotated, on 2 ranks;
    its loss and every gradient block checked against one device."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 8, generator=g)
    ref = SortedMoE()
    want = ref(x, y)
    want.backward()
    net = SortedMoE()
    with simulated_world(2) as world:
        world.replicate(net)
        grads: dict[str, torch.Tensor] = {}

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = net(a, b)
            loss.backward()
            grads.update({n: p.grad.detach().clone() for n, p in net.named_parameters()})
            return loss

        parallel = AutoParallel(step, parallel_mode="sharding_propagation")
        loss = parallel(world.rows(x), world.rows(y))
        assert_matches_single_device(loss, want.detach(), what="loss")
    plan = parallel.parallel_plan
    assert plan is not None
    for name, p in ref.named_parameters():
        layout, shape = plan.param_layouts()[name]
        assert p.grad is not None
        full = p.grad
        assert_matches_single_device(
            grads[name], lambda r, f=full, a=layout, s=shape: f[a.local_slice(r, s)], what=name
        )
    return parallel


def test_nothing_annotated_may_store_a_weight_split() -> None:
    """docs/parallel.md: with nothing annotated the matrix is one axis and each op takes what
    costs least on it (the docs said the plan is data parallel). The experts read an input
    every rank holds whole, so each takes its contraction split (its AllReduce is the op's
    own, not priced): the weights stored (None, g0), their gradients reduced over no axis;
    the router, reading the split batch, stays data parallel. Equal to one device."""
    parallel = moe_propagated()
    plan = parallel.parallel_plan
    assert plan is not None
    layouts = {n: str(t.layout) for n, t in plan.params.items()}
    assert all("(None, g0)" in layouts[f"experts.{e}.weight"] for e in range(4)), layouts
    assert "(None, None)" in layouts["router.weight"], layouts
    text = str(plan)
    assert "bucket AllReduce over no axis (scaled only) fusion=-1: experts.3.weight" in text
