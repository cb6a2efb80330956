"""The plan executor's fast paths stay exact over many steps (`parallel._spans`).

With ``watch_every_op=False`` (the fast paths are opt-in), from a plan's third run on, a
module whose every op runs on this rank's rows as the network calls it (a GPT block under data
parallel) runs without the executor watching each op, and after the optimizer step the
executor stays off the mode stack until the network is called again. Each case trains 5 steps
on 2 simulated ranks and equals one device at every step (loss and every gradient, 1e-5), with
the collectives counted (the loss's AllReduce forward, the gradient bucket's backward):

- GPT-2 with dropout 0: its blocks run unwatched from the third step;
- a block with dropout 0.1: it draws its masks through the executor every step;
- a block whose ``view`` names the global batch size: it keeps the plan's local shape;
- two optimizer steps in one call, each loss read before ``backward``;
- no backward at all (an evaluation call).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.parallel._executor import PlanExecutor
from shardwise.parallel._spans import span_candidates
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..zoo import GPT2, recording_step, token_batches

STEPS, BATCH, WORLD = 5, 8, 2
SIZES = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64, "block_size": 16}
RANKS = tuple(range(WORLD))


pytestmark = pytest.mark.usefixtures("one_thread", "fast_paths")


class Block(nn.Module):
    """Linear, GELU, dropout, linear, residual; with `global_view` its ``view`` names the
    global batch size (plain torch would fail on a rank's rows; the plan gives it the local
    shape, every step)."""

    def __init__(self, p: float, global_view: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)
        self.p, self.global_view = p, global_view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.a(x))
        if self.global_view:
            h = torch.tanh(h.view(BATCH, 4, 8)).view(BATCH, 32)
        h = nn.functional.dropout(h, self.p, self.training)
        return self.b(h) + x


class Net(nn.Module):
    def __init__(self, p: float = 0.0, global_view: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.block, self.out = nn.Linear(16, 16), Block(p, global_view), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.out(self.block(self.inp(x)))
        return logits, nn.functional.cross_entropy(logits, y)


def _data(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if name != "gpt2":
        g = torch.Generator().manual_seed(3)
        return [
            (torch.randn(BATCH, 16, generator=g), torch.randint(0, 4, (BATCH,), generator=g))
            for _ in range(STEPS)
        ]
    return token_batches(STEPS, BATCH, 16, 64)


MAKE: dict[str, Callable[[], nn.Module]] = {
    "gpt2": lambda: GPT2(**SIZES),
    "dropout": lambda: Net(p=0.1),
    "view": lambda: Net(global_view=True),
}


def _one_device(name: str, steps_per_call: int = 1) -> tuple[list[Any], list[Any]]:
    """Per optimizer step: the loss and every gradient on one device (masks seeded as the
    parallel run seeds them)."""
    net = MAKE[name]()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    losses, grads = [], []
    step = recording_step(net, opt, lambda m, a, b: m(a, b)[1], grads)
    torch.manual_seed(7)
    for x, y in _data(name):
        for _ in range(steps_per_call):
            losses.append(step(x, y).detach())
    return losses, grads


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls reaching the executor (one entry per call of the wrapper)."""
    calls: list[int] = []
    original = PlanExecutor.__torch_function__

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[-1] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PlanExecutor, "__torch_function__", counted)
    return calls


@pytest.mark.parametrize("name", ["gpt2", "dropout", "view"])
def test_many_steps_match_one_device(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    want_losses, want_grads = _one_device(name)
    net, batches = MAKE[name](), _data(name)
    calls = _count_calls(monkeypatch)
    with simulated_world(WORLD) as world:
        world.replicate(net)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        seen: list[dict[str, torch.Tensor]] = []
        step = recording_step(net, opt, lambda m, x, y: m(x, y)[1], seen)
        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        torch.manual_seed(7)
        for s, (x, y) in enumerate(batches):
            calls.append(0)
            with CommRecorder() as rec:
                loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want_losses[s], what=f"loss {s}")
            assert_matches_single_device(seen[s], want_grads[s], what=f"grads {s}")
            want = Counter(
                {("AllReduce", "forward", RANKS): 1, ("AllReduce", "backward", RANKS): 1}
            )
            assert rec.kinds() == want, rec.summary()
    if name == "gpt2":  # the blocks and the optimizer-step tail run unwatched from step 3
        assert calls[2] < 0.6 * calls[1], calls
    else:  # dropout masks, global sizes: every op of those blocks is watched every step
        assert calls[2] == calls[1], calls


def test_two_optimizer_steps_in_one_call_reading_the_loss_before_backward() -> None:
    """Two forward / backward / step cycles per call (the executor parks after the first
    step and comes back when the network is called for the second); each cycle reads its loss
    before ``backward``, so that loss's AllReduce runs on its own: 4 collectives a call."""
    want_losses, want_grads = _one_device("gpt2", steps_per_call=2)
    net, batches = MAKE["gpt2"](), _data("gpt2")
    with simulated_world(WORLD) as world:
        world.replicate(net)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        seen: list[dict[str, torch.Tensor]] = []
        read: list[torch.Tensor] = []

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            for _ in range(2):
                loss: torch.Tensor = net(x, y)[1]
                read.append(loss.detach().clone())
                loss.backward()
                seen.append({n: p.grad.detach().clone() for n, p in net.named_parameters()})
                opt.step()
                opt.zero_grad()

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        for s, (x, y) in enumerate(batches):
            with CommRecorder() as rec:
                parallel(world.rows(x), world.rows(y))
            for c, k in enumerate((2 * s, 2 * s + 1)):  # (the capture's reads come first)
                assert_matches_single_device(read[c - 2], want_losses[k], what=f"loss {k}")
                assert_matches_single_device(seen[c - 2], want_grads[k], what=f"grads {k}")
            want = Counter(
                {("AllReduce", "forward", RANKS): 2, ("AllReduce", "backward", RANKS): 2}
            )
            assert rec.kinds() == want, rec.summary()


def test_a_call_without_backward_still_reduces_the_loss() -> None:
    want_losses, _ = _one_device("gpt2")
    net, (x, y) = MAKE["gpt2"](), _data("gpt2")[0]
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(
            lambda x, y: net(x, y)[1], parallel_mode="semi_auto", network=net
        )
        for _ in range(3):
            with CommRecorder() as rec, torch.no_grad():
                loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want_losses[0], what="loss")
            assert rec.kinds() == Counter({("AllReduce", "forward", RANKS): 1}), rec.summary()


def test_span_candidates_are_the_outermost_local_modules() -> None:
    """Pure selection rule: all ops local, contiguous, at least 4, callable, outermost."""
    net = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.ModuleList([nn.ReLU()]))
    modules = list(net.named_modules())
    names = ["0/a", "0/b", "0.0/linear", "0.1/relu", "1.0/relu", "1.0/x", "1.0/y", "1.0/z", "t"]
    local = [True] * 8 + [False]
    assert span_candidates(names, local, modules) == {"0", "1.0"}  # ("1" is a ModuleList)
    local[1] = None  # (a view not seen yet)
    assert span_candidates(names, local, modules) == {"1.0"}
    names[5] = "0/late"  # (module 0's ops no longer contiguous)
    local[1] = True
    assert span_candidates(names, local, modules) == set()


def test_square_linears_as_wide_as_the_batch_run_unwatched() -> None:
    """Linears whose weight has the output's shape (``F.linear`` on a batch as wide as the
    features, 16 x 16): no such op returns its weight itself, so their blocks run unwatched
    from the third step as any other (they were taken for ops that may return a parameter,
    `_param_reads.passing`, which kept every op watched: 10 calls a step), and train as one
    device."""
    width = 16

    def make() -> nn.Module:
        torch.manual_seed(0)
        block = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(width, width), nn.Tanh())])
        return nn.Sequential(nn.Linear(width, width), block, nn.Linear(width, 1))

    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(width, width, generator=g), torch.randn(width, 1, generator=g))]
    data *= STEPS

    def stepper(net: nn.Module) -> Callable[..., torch.Tensor]:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    ref = make()
    one = stepper(ref)
    want = [one(x, y).detach() for x, y in data]
    net = make()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(stepper(net), parallel_mode="semi_auto")
        calls: list[int] = []
        original = PlanExecutor.__torch_function__

        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls[-1] += 1
            return original(self, *args, **kwargs)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(PlanExecutor, "__torch_function__", counted)
            for s, (x, y) in enumerate(data):
                calls.append(0)
                loss = parallel(world.rows(x), world.rows(y))
                assert_matches_single_device(loss, want[s], what=f"loss {s}")
        for name, p in ref.named_parameters():
            assert_matches_single_device(net.get_parameter(name).detach(), p, what=name)
    assert calls[2] < 0.6 * calls[1], calls
