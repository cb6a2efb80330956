"""A train step's tensor inputs that require grad get one device's gradient.

shardwise differentiates the sum of every rank's copy of the step (N copies), so before, a
rank's input rows got N times their gradient (2.0 x on 2 ranks, silently). The wrapper now puts
a hook on each such input (`parallel/_input_grads.input_gradients`): the shares summed over the
axes the input is replicated on (``full_batch``: every axis; the rows the plan cut from the
whole batch are zero elsewhere), divided by N. Under ``data_parallel`` with the rows split over
every axis that is a local division; no collective.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.tanh(self.fc1(x)))
        return out


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 5, (8,), generator=g)
    y[:3] = -100  # (the ranks count different targets: a weighted mean)
    return x, y


def step_of(net: nn.Module) -> object:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        return loss

    return step


@pytest.mark.parametrize(
    ("layout", "ranks"), [("data_parallel", 2), ("megatron", 4), ("full_batch", 2)]
)
def test_input_gradients_equal_one_devices(layout: str, ranks: int) -> None:
    x, y = batch()
    ref, xr = Net(), x.clone().requires_grad_()
    want = F.cross_entropy(ref(xr), y)
    want.backward()
    assert xr.grad is not None
    net = Net()
    with simulated_world(ranks) as world:
        world.replicate(net)
        if layout == "megatron":
            sw.shard(net.fc1, in_strategy=((2, 1), (2, 1)))
            sw.shard(net.fc2, in_strategy=((2, 2), (1, 2)))
        parallel = sw.AutoParallel(step_of(net))
        if layout == "full_batch":
            parallel.dataset_strategy("full_batch")
            args = (world.same(x).requires_grad_(), world.same(y))
        else:
            args = (world.rows(x).requires_grad_(), world.rows(y))
        with CommRecorder() as rec:
            loss = parallel(*args)
        grad = args[0].grad  # (full_batch: the whole batch's; the step saw its cut rows)
        assert grad is not None
        assert_matches_single_device(loss, want.detach(), what="loss")
        whole = layout == "full_batch"
        expected = xr.grad if whole else world.rows(xr.grad)
        assert_matches_single_device(grad, expected, what="input gradient")
    extra = [r.kind for r in rec.records if r.label == "input gradient"]
    assert extra == (["AllReduce"] if whole else []), rec.summary()


def test_other_backwards_of_the_input_are_left_alone() -> None:
    """The hooks act only while the step's own ``loss.backward()`` runs and go when the call
    ends: a later plain backward through the input, or another wrapper's call on it, gets its
    own gradient; a tensor passed twice is corrected once."""
    x, y = batch()
    ref, xr = Net(), x.clone().requires_grad_()
    F.cross_entropy(ref(xr), y).backward()
    assert xr.grad is not None
    net = Net()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(a: torch.Tensor, again: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(net(a), b)
            loss.backward()
            return loss

        xs = world.rows(x).requires_grad_()
        sw.AutoParallel(step)(xs, xs, world.rows(y))
        assert_matches_single_device(xs.grad, world.rows(xr.grad), what="input gradient")
        xs.grad = None
        (xs * 3.0).sum().backward()  # (plain code after the call)
        assert_matches_single_device(xs.grad, torch.full_like(x, 3.0)[:4], what="plain")


def test_torch_autograd_grad_in_the_step() -> None:
    """``torch.autograd.grad(loss, [x, *params])`` ends the capture as ``loss.backward()``
    does (it ran on the fake inputs, which do not require grad, and failed); the input's and
    the parameters' gradients equal one device's."""
    x, y = batch()
    ref, xr = Net(), x.clone().requires_grad_()
    want = torch.autograd.grad(F.cross_entropy(ref(xr), y), [xr, *ref.parameters()])
    net = Net()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
            loss = F.cross_entropy(net(a), b)
            return (loss, *torch.autograd.grad(loss, [a, *net.parameters()]))

        _, gx, *gp = sw.AutoParallel(step)(world.rows(x).requires_grad_(), world.rows(y))
        assert_matches_single_device(gx, world.rows(want[0]), what="input gradient")
        for got, expected in zip(gp, want[1:], strict=True):
            assert_matches_single_device(got, expected, what="parameter gradient")


def test_a_gradient_taken_mid_step_and_a_gradient_penalty() -> None:
    """``torch.autograd.grad(..., retain_graph=True)`` before the loss (monitoring) runs
    without ending the capture (it used to end it there: the loss after it ran outside the
    plan, 1.2224 against 1.3430); computing with gradients from ``create_graph=True`` (a
    gradient penalty) is refused at capture, naming the op (it was silently wrong)."""
    from shardwise.planner import CaptureError

    x, y = batch()

    def loss_of(net: nn.Module, a: torch.Tensor, b: torch.Tensor, penalty: bool) -> torch.Tensor:
        a = a.clone().requires_grad_()
        out = net(a)
        (g,) = torch.autograd.grad(out.sum(), a, retain_graph=True, create_graph=penalty)
        loss = F.cross_entropy(out, b)
        return loss + g.pow(2).sum() if penalty else loss

    ref = Net()
    want = loss_of(ref, x, y, False)
    want.backward()
    for penalty in (False, True):
        net = Net()
        with simulated_world(2) as world:
            world.replicate(net)

            def step(
                a: torch.Tensor, b: torch.Tensor, penalty: bool = penalty, net: nn.Module = net
            ) -> torch.Tensor:
                loss = loss_of(net, a, b, penalty)
                loss.backward()
                return loss

            parallel = sw.AutoParallel(step, network=net)
            if penalty:
                with pytest.raises(CaptureError, match=r"pow at .*create_graph=True"):
                    parallel(world.rows(x), world.rows(y))
                continue
            assert_matches_single_device(parallel(world.rows(x), world.rows(y)), want.detach())
            grads = {n: p.grad for n, p in net.named_parameters()}
            assert_matches_single_device(grads, {n: p.grad for n, p in ref.named_parameters()})


@pytest.mark.parametrize("call", ["loss.backward", "torch.autograd.backward"])
def test_backward_with_create_graph_is_refused_at_capture(call: str) -> None:
    """``loss.backward(create_graph=True)`` (gradients that carry a graph, for a penalty on
    ``p.grad``) is a `CaptureError` naming the call's line; it used to crash inside the
    gradient buckets ("a leaf Variable that requires grad ... in-place")."""
    from shardwise.planner import CaptureError

    x, y = batch()
    net = Net()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(net(a), b)
            if call == "loss.backward":
                loss.backward(create_graph=True)
            else:
                torch.autograd.backward([loss], create_graph=True)
            return loss

        with pytest.raises(CaptureError, match=r"create_graph=True\) at test_input_gradients"):
            sw.AutoParallel(step)(world.rows(x), world.rows(y))


@pytest.mark.parametrize("between", ["none", "h * 2", "h + extra", "h + x"])
def test_an_input_another_wrapper_returned_keeps_its_shares(between: str) -> None:
    """A train step's input computed from another wrapped call's result (an encoder wrapped
    on its own, its rows fed to the step, directly or through ops of the caller's) is not
    divided: its gradient flows on into that call's backward, whose buckets divide by N (the
    encoder's gradients came out 1/N of one device's, 0.0655 against 0.131 on 2 ranks,
    silently). The gradient on its way to the caller's own tensors mixed in after the call is
    divided there, on that edge only (``h + x``, a skip connection: x's gradient was the
    direct path's plus the encoder path's / N)."""
    x, y = batch()
    y = y.clamp(min=0)
    extra = torch.linspace(-1, 1, 64).reshape(8, 8)

    def nets() -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(0)
        return nn.Linear(6, 8), nn.Linear(8, 5)

    def joined(h: torch.Tensor, e: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if between == "h + x":  # (a skip connection around the encoder: x on both paths)
            return h + F.pad(x, (0, 2))
        return h * 2 if between == "h * 2" else h + e if between == "h + extra" else h

    enc, head = nets()
    xr, er = x.clone().requires_grad_(), extra.clone().requires_grad_()
    F.cross_entropy(head(joined(torch.tanh(enc(xr)), er, xr)), y).backward()
    want = {f"enc.{n}": p.grad for n, p in enc.named_parameters()}
    want |= {f"head.{n}": p.grad for n, p in head.named_parameters()}
    enc, head = nets()

    def step(h: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(head(h), b)
        loss.backward()
        return loss

    with simulated_world(2) as world:
        world.replicate(enc)
        world.replicate(head)
        encoder = sw.AutoParallel(lambda rows: torch.tanh(enc(rows)))
        xs, es = world.rows(x).requires_grad_(), world.rows(extra).requires_grad_()
        sw.AutoParallel(step)(joined(encoder(xs), es, xs), world.rows(y))
        got = {f"enc.{n}": p.grad for n, p in enc.named_parameters()}
        got |= {f"head.{n}": p.grad for n, p in head.named_parameters()}
        assert_matches_single_device(got, want, what="grads")
        # the caller's tensors before the encoder and mixed in after it: one device's rows
        assert_matches_single_device(xs.grad, world.rows(xr.grad), what="x.grad")
        if between == "h + extra":
            assert_matches_single_device(es.grad, world.rows(er.grad), what="extra.grad")


def test_an_input_computed_from_a_leaf_of_the_caller() -> None:
    """``step(x * 2)`` with ``x`` requiring grad (no wrapped call before it): the input is
    divided, and ``x.grad`` is its rows of one device's gradient."""
    x, y = batch()
    ref, xr = Net(), x.clone().requires_grad_()
    F.cross_entropy(ref(xr * 2), y).backward()
    assert xr.grad is not None
    net = Net()
    with simulated_world(2) as world:
        world.replicate(net)
        xs = world.rows(x).requires_grad_()
        sw.AutoParallel(step_of(net))(xs * 2, world.rows(y))
        assert_matches_single_device(xs.grad, world.rows(xr.grad), what="x.grad")


@pytest.mark.parametrize("layout", ["data_parallel", "full_batch"])
def test_input_gradients_of_a_wrapped_network(layout: str) -> None:
    """The module form (``AutoParallel(net)``, the loss and its backward after the call): each
    input that requires grad enters the network through a node that divides its gradient, so
    ``x.grad`` is one device's (it was N times it) and the parameters' equal one device's."""
    x, y = batch()
    y = y.clamp(min=0)
    ref, xr = Net(), x.clone().requires_grad_()
    F.cross_entropy(ref(xr), y).backward()
    assert xr.grad is not None
    net = Net()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net)
        if layout == "full_batch":
            parallel.dataset_strategy("full_batch")
            xs, ys = world.same(x).requires_grad_(), world.same(y)
            F.cross_entropy(parallel(xs), ys).backward()  # (the whole batch's loss)
            want = xr.grad
        else:
            xs, ys = world.rows(x).requires_grad_(), world.rows(y)
            F.cross_entropy(parallel(xs), ys).backward()  # (this rank's rows' mean)
            want = world.rows(xr.grad)
        assert_matches_single_device(xs.grad, want, what="x.grad")
        got = {n: p.grad for n, p in net.named_parameters()}
        assert_matches_single_device(got, {n: p.grad for n, p in ref.named_parameters()})


def test_a_wrapped_network_given_x_and_2x() -> None:
    """A wrapped network given ``x`` and ``2 * x``: each path's gradient is divided once at its
    entry, so ``x.grad`` is one device's (the direct share plus twice the other's)."""

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.net(a) * self.net(b)
            return out

    x, _ = batch()
    ref, xr = Two(), x.clone().requires_grad_()
    ref(xr, 2 * xr).pow(2).mean().backward()
    net = Two()
    with simulated_world(2) as world:
        world.replicate(net)
        xs = world.rows(x).requires_grad_()
        sw.AutoParallel(net)(xs, 2 * xs).pow(2).mean().backward()
        assert_matches_single_device(xs.grad, world.rows(xr.grad), what="x.grad")


def test_an_input_the_step_returns_as_it_is_stays_the_callers() -> None:
    """A step that returns its input (``return loss, a``) does not mark the caller's autograd
    node as a call's result: a later call on the same tensor still gets one device's gradient
    (it got N times it: the input was no longer divided)."""
    x, y = batch()
    ref, xr = Net(), x.clone().requires_grad_()
    F.cross_entropy(ref(xr + 0), y).backward()
    assert xr.grad is not None
    net = Net()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            loss = F.cross_entropy(net(a), b)
            loss.backward()
            return loss, a

        parallel = sw.AutoParallel(step)
        xs = world.rows(x).requires_grad_()
        e = xs + 0
        for call in range(2):
            xs.grad = None
            parallel(e, world.rows(y))
            assert_matches_single_device(xs.grad, world.rows(xr.grad), what=f"call {call}")


def test_a_tensor_mixed_in_and_passed_itself() -> None:
    """``step(encoder(x) + e, e)``: `e` is a step input (divided by its own hook) and is mixed
    into the encoder's result; the edge into `e` is not divided a second time (e.grad was 0.75
    of one device's on 2 ranks)."""
    x, y = batch()
    y = y.clamp(min=0)
    extra = torch.linspace(-1, 1, 64).reshape(8, 8)

    def nets() -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(0)
        return nn.Linear(6, 8), nn.Linear(8, 5)

    enc, head = nets()
    er = extra.clone().requires_grad_()
    (F.cross_entropy(head(torch.tanh(enc(x)) + er), y) + F.cross_entropy(head(er), y)).backward()
    enc, head = nets()

    def step(h: torch.Tensor, e: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(head(h), b) + F.cross_entropy(head(e), b)
        loss.backward()
        return loss

    with simulated_world(2) as world:
        world.replicate(enc)
        world.replicate(head)
        encoder = sw.AutoParallel(lambda rows: torch.tanh(enc(rows)))
        es = world.rows(extra).requires_grad_()
        sw.AutoParallel(step)(encoder(world.rows(x)) + es, es, world.rows(y))
        assert_matches_single_device(es.grad, world.rows(er.grad), what="e.grad")
