"""sw.Parameter: attributes, copies, pickling, .to(), module.to(), optimizers, autograd."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import shardwise as sw
from shardwise.parameter import (
    DEFAULT_COMM_FUSION,
    Parameter,
    assign_tensor,
    comm_fusion_of,
    initializer,
    parallel_optimizer_of,
    set_comm_fusion,
)


def _param() -> Parameter:
    p = Parameter(torch.arange(6.0).reshape(2, 3), name="w", parallel_optimizer=False)
    p.comm_fusion = 3
    return p


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert isinstance(b, Parameter)
    assert (b.name, b.parallel_optimizer, b.comm_fusion) == ("w", False, 3)
    assert b.requires_grad == a.requires_grad
    assert torch.equal(a.detach().cpu(), b.detach().cpu())


def test_defaults_match_mindspore() -> None:
    p = Parameter(initializer("ones", [2]))
    assert isinstance(p, torch.nn.Parameter)
    assert p.name is None and p.parallel_optimizer is True
    assert p.comm_fusion == DEFAULT_COMM_FUSION == 1
    assert p.requires_grad
    assert "name=None" in repr(p)


def test_attribute_validation() -> None:
    p = _param()
    with pytest.raises(ValueError, match="comm_fusion"):
        p.comm_fusion = -1
    with pytest.raises(TypeError):
        p.parallel_optimizer = "yes"  # type: ignore[assignment]
    with pytest.raises(TypeError):
        Parameter([1, 2])  # type: ignore[arg-type]


def test_deepcopy_and_pickle_keep_class_and_attributes() -> None:
    p = _param()
    _same(p, copy.deepcopy(p))
    _same(p, pickle.loads(pickle.dumps(p)))
    buffer = io.BytesIO()
    torch.save({"p": p}, buffer)
    buffer.seek(0)
    _same(p, torch.load(buffer, weights_only=False)["p"])


def test_to_keeps_attributes_without_graph_and_gradient_path_with_it() -> None:
    p = _param()
    with torch.no_grad():
        _same(p, p.to(torch.float64))
    assert p.to(torch.float32) is p
    differentiable = p.to(torch.float64)
    assert not isinstance(differentiable, Parameter)
    differentiable.sum().backward()
    assert p.grad is not None and torch.equal(p.grad, torch.ones(2, 3))


def test_module_to_and_deepcopy_keep_the_parameter_object() -> None:
    net = torch.nn.Module()
    net.w = _param()
    original = net.w
    net.to(torch.float64)
    assert net.w is original and net.w.dtype == torch.float64
    _same(original, net.w)
    _same(original, copy.deepcopy(net).w)


def test_works_with_optimizers_and_autograd() -> None:
    p = Parameter(torch.ones(3), name="w")
    opt = torch.optim.SGD([p], lr=0.5, momentum=0.9)
    (p * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    opt.step()
    assert torch.allclose(p.detach(), torch.tensor([0.5, 0.0, -0.5]))
    assert p.name == "w"


def test_set_comm_fusion_on_plain_and_sw_parameters() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    net[1].extra = Parameter(torch.zeros(1))
    assert comm_fusion_of(net[0].weight) == 1
    set_comm_fusion(net[1], 2)
    assert comm_fusion_of(net[1].weight) == 2 and net[1].extra.comm_fusion == 2
    assert comm_fusion_of(net[0].weight) == 1
    set_comm_fusion(net, 0, recurse=False)  # Sequential has no own parameters
    assert comm_fusion_of(net[0].weight) == 1
    assert parallel_optimizer_of(net[0].weight)
    with pytest.raises(ValueError):
        set_comm_fusion(net, True)  # type: ignore[arg-type]


def test_set_comm_fusion_without_a_module_names_the_call() -> None:
    """``set_comm_fusion(3, 1)`` (MindSpore's ``net.set_comm_fusion(3)`` written with the id
    first) raised AttributeError: 'int' object has no attribute 'parameters'."""
    with pytest.raises(
        TypeError,
        match=r"set_comm_fusion: module must be an nn.Module \(the first argument\), got int 3; "
        r"call set_comm_fusion\(net, fusion_id\)",
    ):
        set_comm_fusion(3, 1)  # type: ignore[arg-type]


def test_assign_tensor_keeps_identity_and_attributes() -> None:
    p = Parameter(torch.empty(2, 3, device="meta"), name="w")
    opt = torch.optim.SGD([p], lr=1.0)
    ref = p
    assign_tensor(p, torch.ones(2, 3))
    assert ref is p and p.device.type == "cpu" and p.name == "w"
    p.grad = torch.ones(2, 3)
    opt.step()
    assert torch.equal(p.detach(), torch.zeros(2, 3))


def test_built_inside_a_simulated_world_it_trains_like_one_device() -> None:
    """In `simulated_world` a tensor holds every rank's value (a tensor subclass, which cannot
    be wrapped in another class): the Parameter is that tensor marked a parameter, as
    ``nn.Parameter`` does it, with its attributes; a network of them trains like one device."""
    from shardwise.testing import assert_matches_single_device, simulated_world

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = sw.Parameter(torch.linspace(-1, 1, 12).reshape(4, 3), "w", comm_fusion=2)
            self.b = sw.Parameter(torch.zeros(3), parallel_optimizer=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = x @ self.w + self.b
            return out

    x = torch.arange(16.0).reshape(4, 4) / 16
    want = Net()(x).square().mean()
    with simulated_world(2) as world:
        net = Net()
        assert [n for n, _ in net.named_parameters()] == ["w", "b"]
        assert sw.parameter.comm_fusion_of(net.w) == 2
        assert not sw.parameter.parallel_optimizer_of(net.b)
        assert isinstance(net.w, torch.nn.Parameter) and net.w.requires_grad

        def step(a: torch.Tensor) -> torch.Tensor:
            loss = net(a).square().mean()
            loss.backward()
            return loss

        loss = sw.AutoParallel(step)(world.rows(x))
        assert_matches_single_device(loss, want.detach())
