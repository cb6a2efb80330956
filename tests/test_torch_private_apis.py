"""Every private torch API shardwise uses still exists, with the shape shardwise relies on.

A top-level import of a private name fails loudly at import time, but most of these are
attributes read at run time, and two (the optimizers' global hook dicts, the default store) are
read with a fallback that would silently change behaviour. Each case names the shardwise module
that uses the API (the list README.md's "Private torch APIs" paragraph gives), so a torch
upgrade that changes one fails here first, saying where to look.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import simulated_world


def _attr(module: str, *names: str) -> object:
    obj: object = importlib.import_module(module)
    for name in names:
        obj = getattr(obj, name)
    return obj


def _callable(module: str, *names: str) -> Callable[[], None]:
    def check() -> None:
        assert callable(_attr(module, *names)), f"{module}.{'.'.join(names)} is not callable"

    return check


def _engine_queue_callback() -> None:
    engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
    assert callable(engine.queue_callback)


def _tensor_internals() -> None:
    base = torch.zeros(4)
    view = base[1:]
    assert view._base is base
    assert isinstance(base.untyped_storage()._cdata, int)
    sub = torch.Tensor._make_subclass(torch.nn.Parameter, torch.zeros(2), True)
    assert isinstance(sub, torch.nn.Parameter) and sub.requires_grad


def _module_dicts() -> None:
    m = torch.nn.BatchNorm1d(2)
    assert "weight" in m._parameters and "running_mean" in m._buffers
    m.register_buffer("scratch", torch.zeros(1), persistent=False)
    assert "scratch" in m._non_persistent_buffers_set and "running_mean" not in (
        m._non_persistent_buffers_set
    )


def _local_tensor_world() -> None:
    with simulated_world(2) as world:
        x = world.rank_map(lambda r: torch.full((1,), float(r)))
        assert [float(t) for t in x._local_tensors.values()] == [0.0, 1.0]
        assert isinstance(world.mode._per_rank_rng_states, dict)
    lt = importlib.import_module("torch.distributed._local_tensor")
    assert callable(lt._get_rng_state) and callable(lt._set_rng_state)


def _fake_capture() -> None:
    fake = importlib.import_module("torch._subclasses.fake_tensor")
    for name in ("FakeTensorMode", "FakeTensor", "DataDependentOutputException"):
        assert hasattr(fake, name), name
    assert hasattr(fake, "DynamicOutputShapeException")
    assert hasattr(importlib.import_module("torch.utils._python_dispatch"), "TorchDispatchMode")


def _dtensor_rules() -> None:
    from torch.distributed.tensor import Shard

    from shardwise.ops._dtensor import Spec, _propagator, mesh_of, propagate, rule_count

    assert rule_count() > 1000  # DTensor's sharding strategies (about 1,160 overloads)
    # (the per-mesh-dim registry, asked one mesh dim at a time by _dtensor._per_axis)
    single = _propagator().op_single_dim_strategy_funcs
    assert torch.ops.aten.add.Tensor in single and len(single) > 900
    mesh = mesh_of((2,), ("g0",), (0, 1))  # no process group
    x = Spec((Shard(0),), (8, 16, 64), (1024, 64, 1), "float32")
    ins, outs = propagate(torch.ops.aten.view.default, (x, [-1, 64]), {}, mesh)
    assert ins == [(Shard(0),)] and outs == [(Shard(0),)]
    # the sizes are part of the propagator's cache key (its runtime schema info): the same
    # input viewed two ways gets two answers, not the first one cached
    y = Spec((Shard(2),), (8, 16, 32), (512, 32, 1), "float32")
    _, folded = propagate(torch.ops.aten.view.default, (y, [128, 32]), {}, mesh)
    _, split = propagate(torch.ops.aten.view.default, (y, [8, 16, 4, 8]), {}, mesh)
    assert folded == [(Shard(1),)] and split == [(Shard(2),)], (folded, split)
    # (a view is asked uncached without its size rewrite, which is put back afterwards)
    p = _propagator()
    assert callable(p.propagate_op_sharding_non_cached)
    assert torch.ops.aten.view.default in p.op_to_shape_and_stride_idx


def _storage_use_count() -> None:
    base = torch.zeros(4)
    alone = int(torch._C._storage_Use_Count(base.untyped_storage()._cdata))
    view = base[1:]
    shared = int(torch._C._storage_Use_Count(base.untyped_storage()._cdata))
    assert shared == alone + 1, (alone, shared)  # (a view holds a reference to the storage)
    del view


def _function_mode_stack() -> None:
    from torch.overrides import TorchFunctionMode

    mode = TorchFunctionMode()
    depth = torch._C._len_torch_function_stack()
    torch._C._push_on_torch_function_stack(mode)
    try:
        assert torch._C._len_torch_function_stack() == depth + 1
        assert torch._C._get_function_stack_at(depth) is mode
    finally:
        assert torch._C._pop_torch_function_stack() is mode
    assert torch._C._len_torch_function_stack() == depth


def _meta_parameters() -> None:
    from shardwise.launch._meta_params import meta_parameters

    with meta_parameters():
        linear = torch.nn.Linear(2048, 2048)
        plain = torch.zeros(3)
    assert linear.weight.device.type == "meta" and isinstance(linear.weight, torch.nn.Parameter)
    assert plain.device.type == "cpu"
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # (put back)


def _default_store() -> None:
    assert callable(dist.distributed_c10d._get_default_store)


def _profiler_event_tree() -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.ones(256)
    roots = prof.profiler.kineto_results.experimental_event_tree()
    stack, kinds = list(roots), set()
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        kinds.add(type(node.extra_fields).__name__)
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            fields = node.extra_fields
            assert fields.device.type == "cpu" and isinstance(fields.alloc_size, int)
            assert isinstance(fields.ptr, int) and isinstance(node.start_time_ns, int)
    assert "_ExtraFields_Allocation" in kinds, kinds


CASES: dict[str, Callable[[], None]] = {
    "testing/_world: _disable_current_modes": _callable(
        "torch.utils._python_dispatch", "_disable_current_modes"
    ),
    "testing/_world, communication/_dry: fake process group": _callable(
        "torch.testing._internal.distributed.fake_pg", "FakeStore"
    ),
    "launch/_meta_params: Tensor._make_subclass builds every Parameter": _meta_parameters,
    "testing/_world: LocalTensor, its per-rank values and RNG states": _local_tensor_world,
    "layout/_dtensor, ops/aten_rules: _StridedShard": _callable(
        "torch.distributed.tensor.placement_types", "_StridedShard"
    ),
    "parallel/_runtime, optim/_engine_gather, optim/_engine_reduce: _current_graph_task_id": (
        _callable("torch._C", "_current_graph_task_id")
    ),
    "parallel/_runtime: _will_engine_execute_node": _callable(
        "torch._C", "_will_engine_execute_node"
    ),
    "parallel/_runtime, optim/_engine_reduce: queue_callback": _engine_queue_callback,
    "parallel/_runtime: _storage_Use_Count": _storage_use_count,
    "parallel/_stepping: the torch-function mode stack": _function_mode_stack,
    "optim/_engine_gather, parameter/_parameter, parameter/_tape: tensor internals": (
        _tensor_internals
    ),
    "parameter/_deferred: Module._parameters / _buffers / _non_persistent_buffers_set": (
        _module_dicts
    ),
    "communication/_init: _get_default_store": _default_store,
    "planner/_fake: fake tensors, TorchDispatchMode, Module._parameters": _fake_capture,
    "ops/_dtensor: DTensor's sharding propagator and a mesh without process group": (
        _dtensor_rules
    ),
    "communication/mesh: Backend.Options": _callable(
        "torch._C._distributed_c10d", "Backend", "Options"
    ),
    "launch/store, launch/rendezvous: TCPStore": _callable(
        "torch._C._distributed_c10d", "TCPStore"
    ),
    "launch/rendezvous: PrefixStore": _callable("torch._C._distributed_c10d", "PrefixStore"),
    "report/_measure: the profiler's event tree and its allocation records": (_profiler_event_tree),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_private_torch_api_is_there(case: str) -> None:
    CASES[case]()
