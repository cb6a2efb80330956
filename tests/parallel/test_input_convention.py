"""One input convention for both wrapper forms and both parallel modes (MindSpore's).

Under ``dataset_strategy("data_parallel")`` (the default) every rank passes its own rows of the
global batch; under ``"full_batch"`` every rank passes all of it. For each parallel mode
(``semi_auto``, ``data_parallel``) x form (wrapped module, wrapped train step) x strategy, on 2
and 4 simulated ranks, two SGD steps give the loss and the gradients (as the optimizer sees
them) of one device on the same global batch. A plain-torch MLP runs every combination; a
network with an annotated MatMul (contraction split over 2 ranks) runs the semi_auto ones. A
wrapped module either returns its output (the loss built outside, ``"module"``) or computes its
loss itself (``"module_loss"``: ``out["loss"]`` as a Hugging Face model's ``out.loss``), whose
value is the global batch's on every rank in both modes (data_parallel mode returned each
rank's own loss).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.parallel import AutoParallel
from shardwise.testing import assert_matches_single_device, simulated_world

BATCH, STEPS = 8, 2


def _output(logits: torch.Tensor, labels: torch.Tensor | None) -> Any:
    """The logits, or with `labels` a dict holding the loss too (a Hugging Face model's)."""
    if labels is None:
        return logits
    return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.5

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        return _output(self.fc2(torch.relu(self.fc1(x))), labels)


class Annotated(MLP):
    """The MLP with its first layer as a MatMul whose contraction is split over 2 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(self.fc1.weight.detach().t().clone())
        self.b = nn.Parameter(self.fc1.bias.detach().clone())
        del self.fc1
        self.matmul = sw.ops.MatMul().shard(((1, 2), (2, 1)))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        return _output(self.fc2(torch.relu(self.matmul(x, self.w) + self.b)), labels)


class Recording(torch.optim.SGD):
    """SGD that keeps a copy of every gradient it is asked to apply."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1)
        self.seen: list[list[torch.Tensor]] = []

    def step(self, closure: Any = None) -> Any:
        self.seen.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


@functools.cache  # (not tests/cached.outside_worlds: real-process workers import this file alone)
def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches (made once: a first call outside a simulated world makes them plain)."""
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def single_device(cls: type[MLP]) -> tuple[list[float], list[list[torch.Tensor]]]:
    net = cls()
    opt = Recording(net.parameters())
    losses = []
    for x, y in data()[:STEPS]:
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt.seen


def train_step_form(n: int, net: nn.Module, mode: str, strategy: str) -> Any:
    """(wrapper, optimizer, call(x, y) -> loss) for a wrapped train step on `n` ranks."""
    opt = Recording(net.parameters())

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    wrapper = AutoParallel(train_step, parallel_mode=mode).dataset_strategy(strategy)
    return wrapper, opt, lambda x, y: wrapper(x, y)


def module_form(n: int, net: nn.Module, mode: str, strategy: str) -> Any:
    """(wrapper, optimizer, call(x, y) -> loss) for a wrapped module on `n` ranks: the loss is
    built outside the wrapper, as the user's code would."""
    opt = Recording(net.parameters())
    wrapper = AutoParallel(net, parallel_mode=mode, optimizer=opt).dataset_strategy(strategy)

    def call(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = wrapper(x)
        if strategy == "full_batch":  # the whole output on every rank: the global loss
            loss = F.cross_entropy(out, y)
            shown = loss
        elif mode == "semi_auto":  # rows: a loss equal on every rank, as the wrapper asks
            loss = sw.ops.AllReduce()(F.cross_entropy(out, y)) / n
            shown = loss
        else:  # data_parallel mode averages the gradients at the optimizer step
            loss = F.cross_entropy(out, y)
            shown = sw.ops.AllReduce()(loss.detach()) / n
        loss.backward()
        opt.step()
        opt.zero_grad()
        return shown

    return wrapper, opt, call


def module_loss_form(n: int, net: nn.Module, mode: str, strategy: str) -> Any:
    """(wrapper, optimizer, call(x, y) -> loss) for a wrapped module that computes its loss
    (``net(x, labels=y)["loss"]``): the loss it returns is the global batch's, and its
    ``backward()`` gives one device's gradients, in every mode and strategy."""
    opt = Recording(net.parameters())
    wrapper = AutoParallel(net, parallel_mode=mode, optimizer=opt).dataset_strategy(strategy)

    def call(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = wrapper(x, labels=y)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return wrapper, opt, call


FORMS = {"module": module_form, "module_loss": module_loss_form, "train_step": train_step_form}


def check_grads(
    wrapper: AutoParallel, net: nn.Module, got: list[torch.Tensor], want: list[torch.Tensor]
) -> None:
    """Each gradient the optimizer saw is this rank's block of the single-device one."""
    plan = wrapper.parallel_plan
    for (name, _), g, w in zip(net.named_parameters(), got, want, strict=True):
        if plan is not None and name in plan.params:
            layout, shape = plan.param_layouts()[name]
            assert_matches_single_device(
                g, lambda r, w=w, a=layout, s=shape: w[a.local_slice(r, s)], what=name
            )
        else:
            assert_matches_single_device(g, w, what=name)


def run_case(n: int, net: nn.Module, case: tuple[str, str, str], give: Any, want: Any) -> None:
    """Train `net` (every rank's copy) STEPS steps as `case` (mode, form, strategy) says,
    feeding each global batch of `data()` through `give` (whole or this rank's rows), and
    compare with `want` (`single_device`'s losses and gradients)."""
    (mode, form, strategy), (losses, grads) = case, want
    wrapper, opt, call = FORMS[form](n, net, mode, strategy)
    for step, (x, y) in enumerate(data()[:STEPS]):
        loss = call(give(x), give(y))
        assert_matches_single_device(loss, torch.tensor(losses[step]), what=f"loss {step}")
        check_grads(wrapper, net, opt.seen[step], grads[step])


CASES = [
    (cls, mode, form, strategy)
    for cls in (MLP, Annotated)
    for mode in ("semi_auto", "data_parallel")
    for form in FORMS
    for strategy in ("data_parallel", "full_batch")
    if cls is MLP or mode == "semi_auto"
]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    ("cls", "mode", "form", "strategy"),
    CASES,
    ids=["-".join([c.__name__, m, f, s]) for c, m, f, s in CASES],
)
def test_matches_one_device(
    world_size: int, cls: type[MLP], mode: str, form: str, strategy: str
) -> None:
    net, want = cls(), single_device(cls)
    with simulated_world(world_size) as world:
        world.replicate(net)
        split = world.same if strategy == "full_batch" else world.rows
        run_case(world_size, net, (mode, form, strategy), split, want)


@pytest.mark.parametrize("mode", ["semi_auto", "data_parallel"])
def test_full_batch_takes_a_plain_tensor_made_outside_the_world(mode: str) -> None:
    """In a simulated world a global batch made outside it (not `world.same`) is every rank's
    (data_parallel mode's cut failed on it with torch's LocalTensor assertion)."""
    net, want = MLP(), single_device(MLP)
    with simulated_world(2) as world:
        world.replicate(net)
        run_case(2, net, (mode, "train_step", "full_batch"), lambda t: t, want)


@pytest.mark.parametrize("form", ["module", "train_step"])
def test_full_batch_that_does_not_divide_names_the_convention(form: str) -> None:
    net, (x, y) = MLP(), data()[0]
    with simulated_world(4) as world:
        world.replicate(net)
        make = module_form if form == "module" else train_step_form
        _, _, call = make(4, net, "data_parallel", "full_batch")
        with pytest.raises(
            ValueError,
            match=r"'full_batch' \(every rank passes the whole global "
            r"batch.*batch dim 6, not divisible by the 4 ranks.*'data_parallel'",
        ):
            call(world.same(x[:6]), world.same(y[:6]))


def test_semi_auto_full_batch_that_does_not_divide_warns_and_runs_whole() -> None:
    """semi_auto keeps a full_batch input whose rows do not divide by the devices whole (every
    op on all rows on every rank: one device's results, no speed-up); that ran silently, while
    the docs said it raised. A UserWarning names each such input, its rows and the fix, once
    per plan (not again in a call that reuses it)."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(7, 6, generator=g), torch.randint(0, 3, (7,), generator=g)
    ref = MLP()
    want = F.cross_entropy(ref(x), y)
    net = MLP()
    with simulated_world(2) as world:
        world.replicate(net)
        _, _, call = train_step_form(2, net, "semi_auto", "full_batch")
        with pytest.warns(UserWarning) as caught:
            loss = call(world.same(x), world.same(y))
        assert_matches_single_device(loss, want, what="loss")
        said = [str(w.message) for w in caught if "cannot be split" in str(w.message)]
        assert len(said) == 2, said
        assert said[0].startswith("input args[0]: dim 0 of global shape [7, 6] (7 rows)"), said
        assert "over 2 devices" in said[0] and "divisible by 2" in said[0], said
        assert said[1].startswith("input args[1]: dim 0 of global shape [7] (7 rows)"), said
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            call(world.same(x), world.same(y))


@pytest.mark.parametrize("mode", ["semi_auto", "data_parallel"])
def test_ranks_passing_different_row_counts_are_named(mode: str) -> None:
    """Under the data_parallel convention every rank passes as many rows; a last batch split
    unevenly (3 rows on rank 0, 2 on rank 1) failed in a simulated world with
    "'LocalIntNode' object has no attribute 'int_'" (semi_auto) or "NYI" (data_parallel)."""
    net, (x, y) = MLP(), data()[0]
    with simulated_world(2) as world:
        world.replicate(net)
        _, _, call = train_step_form(2, net, mode, "data_parallel")
        uneven = [world.from_local_tensors([t[:3], t[3:5]]) for t in (x, y)]
        with pytest.raises(ValueError, match=r"other sizes on some ranks.*drop_remainder=True"):
            call(*uneven)


@pytest.mark.parametrize("form", ["module", "train_step"])
@pytest.mark.parametrize("mode", ["semi_auto", "data_parallel"])
def test_full_batch_with_each_ranks_own_rows_is_refused(mode: str, form: str) -> None:
    """Under ``"full_batch"`` every rank passes the whole batch; each rank passing its own rows
    (of the same shape: a shuffled batch here) trained each rank on another batch and returned
    another loss per rank, silently. The first call compares every rank's inputs with rank
    0's."""
    net, (x, y) = MLP(), data()[0]
    with simulated_world(4) as world:
        world.replicate(net)
        make = module_form if form == "module" else train_step_form
        _, _, call = make(4, net, mode, "full_batch")
        with pytest.raises(ValueError, match=r"'full_batch'.*differs on rank 1 from rank 0's"):
            call(world.rank_map(lambda r: x.roll(r, 0)), world.same(y))


def test_replicas_of_a_per_input_block_must_pass_the_same_block() -> None:
    """A per-input strategy splitting the rows in 2 on 4 ranks: ranks 0 and 1 hold one block,
    ranks 2 and 3 the other; each rank passing its own quarter is refused, each pair passing its
    half trains as one device."""
    (losses, _), net, (x, y) = single_device(MLP), MLP(), data()[0]
    with simulated_world(4) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), 0.1)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(net(a), b)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        wrapper = AutoParallel(step, parallel_mode="semi_auto").dataset_strategy(((2, 1), (2,)))
        with pytest.raises(ValueError, match=r"differs on rank 1 from rank 0's, rank 3 from rank"):
            wrapper(world.rows(x), world.rows(y))
        half = [world.rank_map(lambda r, t=t: t.chunk(2)[r // 2]) for t in (x, y)]
        assert_matches_single_device(wrapper(*half), torch.tensor(losses[0]))


@pytest.mark.parametrize("form", ["module", "train_step"])
def test_full_batch_takes_this_ranks_share(form: str) -> None:
    """semi_auto under ``"full_batch"``: the first unannotated op takes this rank's rows of the
    whole batch (a local slice), so the plain-torch layers run on 8 / 4 rows per rank, as under
    ``"data_parallel"``; the loss still equals one device's."""
    (losses, _), net, (x, y) = single_device(MLP), MLP(), data()[0]
    seen: list[int] = []
    with simulated_world(4) as world:
        world.replicate(net)
        net.fc2.register_forward_pre_hook(lambda _m, args: seen.append(int(args[0].shape[0])))
        make = module_form if form == "module" else train_step_form
        _, _, call = make(4, net, "semi_auto", "full_batch")
        loss = call(world.same(x), world.same(y))
        assert_matches_single_device(loss, torch.tensor(losses[0]))
    assert seen[-1] == BATCH // 4  # (the first call is planned on a global-shape trace first)


class _Reads(nn.Module):
    """The input read only by `sw.reshard` to `layout`, or only by a primitive."""

    def __init__(self, layout: sw.Layout | None) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 16, generator=torch.Generator().manual_seed(1)))
        self.layout = layout
        self.mm = sw.ops.MatMul().shard(((1, 4), (4, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout is None:
            out: torch.Tensor = self.mm(x, self.w)
            return out
        return sw.reshard(x, self.layout) @ self.w


_L = sw.Layout((2, 2), ("dp", "mp"))


@pytest.mark.parametrize(
    ("layout", "want"),
    [
        (_L("None", "None"), {}),  # (was: 2 AllGathers of the entry-cut rows)
        (_L("None", "mp"), {"AllReduce": 1}),  # (was: AlltoAll + AllGather, then this)
        (_L("dp", "None"), {"AllGather": 1}),  # (the output gathered whole; was 2)
        (None, {"AllReduce": 1}),  # MatMul wanting columns (was: an AlltoAll before it)
    ],
)
def test_full_batch_input_read_by_a_layout_taker_is_cut_locally(
    layout: sw.Layout | None, want: dict[str, int]
) -> None:
    """Under ``"full_batch"`` an input read only by ``sw.reshard`` or primitives stays whole and
    each cuts its block out of it (docs/parallel.md: "a local slice, with no communication"):
    it was cut to rows at entry, then moved again (a helper review). The forward's collectives
    are the op's own and the output's only; values equal one device's."""
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    net = _Reads(layout)
    expected = net(x).detach()
    with simulated_world(4) as world:
        world.replicate(net)
        parallel = AutoParallel(net).dataset_strategy("full_batch")
        with sw.CommRecorder() as rec:
            got = parallel(world.same(x))
        assert_matches_single_device(got, expected)
    counts = {k: rec.count(k) for k in ("AllReduce", "AllGather", "AlltoAll")}
    assert {k: n for k, n in counts.items() if n} == want
