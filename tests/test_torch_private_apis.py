"""Private torch APIs stay in `shardwise._torch`, and each one shardwise uses is still there.

Two kinds of test:

- `test_private_torch_api_is_there`: every private torch API shardwise uses still exists, with
  the shape shardwise relies on. A top-level import of a private name fails loudly at import
  time, but most of these are attributes read at run time, and some (the default store, the
  engine's graph task) are read with a fallback that would silently change behaviour. Each case
  names the module of `shardwise/_torch/` that wraps the API (README.md's "Private torch APIs"
  paragraph lists them), so a torch upgrade that changes one fails here first, saying where to
  look; `testing/_world` keeps the simulated world's own.
- `test_private_torch_apis_only_in_torch_package`: no other module of shardwise (`testing/`
  aside) touches a private torch name (`tests/torch_private_scan.py`: an ``ast`` scan).
"""

from __future__ import annotations

import datetime
import importlib
import inspect
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tests.torch_private_scan import private_torch_uses

import shardwise
from shardwise.testing import simulated_world

PACKAGE = Path(shardwise.__file__).parent
TORCH_PACKAGE = PACKAGE / "_torch"
EXEMPT_PACKAGES = ("_torch", "testing")  # (`testing/` builds the simulated world on torch's own)


def _attr(module: str, *names: str) -> object:
    obj: object = importlib.import_module(module)
    for name in names:
        obj = getattr(obj, name)
    return obj


def _callable(module: str, *names: str) -> Callable[[], None]:
    def check() -> None:
        assert callable(_attr(module, *names)), f"{module}.{'.'.join(names)} is not callable"

    return check


def _autograd_engine() -> None:
    from shardwise._torch import autograd_engine as ae

    seen: list[tuple[int, bool]] = []
    ended: list[int] = []
    w = torch.ones(2, requires_grad=True)
    store = w.view_as(w).grad_fn.next_functions[0][0]  # (the node that stores w.grad)

    def hook(g: torch.Tensor) -> torch.Tensor:
        seen.append((ae.current_graph_task_id(), ae.will_engine_execute_node(store)))
        ae.queue_callback(lambda: ended.append(ae.current_graph_task_id()))
        return g

    w.register_hook(hook)
    assert ae.current_graph_task_id() == -1
    (w * 2).sum().backward()
    assert len(seen) == 1 and seen[0][0] != -1 and seen[0][1] is True, seen
    assert ended == [seen[0][0]], ended  # (the callback runs at the end of that backward)


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        return g * 2


def _backward_node_class() -> None:
    from shardwise._torch.autograd_engine import backward_node_class

    y = _Double.apply(torch.ones(1, requires_grad=True))
    assert isinstance(y.grad_fn, backward_node_class(_Double))
    assert not isinstance((y * 1).grad_fn, backward_node_class(_Double))


def _node_metadata() -> None:
    from shardwise._torch.autograd_engine import node_metadata

    y = _Double.apply(torch.ones(1, requires_grad=True))
    for node in (y.grad_fn, (y * 3).grad_fn):  # (a Python Function's node, a C++ one)
        node_metadata(node)["mark"] = 1
    assert node_metadata((y * 3 + 1).grad_fn.next_functions[0][0].next_functions[0][0]) == {
        "mark": 1
    }


def _storage() -> None:
    from shardwise._torch.storage import storage_key, storage_use_count, version, view_base

    base = torch.zeros(4)
    before = version(base)
    base[1:].add_(1)  # (a change through a view counts on the base)
    assert isinstance(before, int) and version(base) == before + 1
    alone = storage_use_count(base)
    view = base[1:]
    assert storage_use_count(base) == alone + 1  # (a view holds a reference to the storage)
    assert view_base(view) is base and view_base(base) is None
    assert isinstance(storage_key(base), int) and storage_key(view) == storage_key(base)
    meta = torch.empty(4, device="meta")
    assert storage_key(meta[2:]) == storage_key(meta) != storage_key(torch.empty(4, device="meta"))
    # (delayed init, parameter/_tape.py: a deferred meta tensor changed in place after its block
    # is found by its version, which in-place ops bump on meta tensors too, under no_grad, and
    # which a Parameter made from it, a view and a detached alias share)
    param, kept = torch.nn.Parameter(meta), meta.detach()
    with torch.no_grad():
        for change in (lambda: param.fill_(1), lambda: param[1:].mul_(2)):
            before = version(kept)
            change()
            assert version(kept) == version(param) == before + 1
    torch.nn.init.zeros_(param)
    assert version(kept) == before + 2


def _function_mode_stack() -> None:
    from torch.overrides import TorchFunctionMode

    from shardwise._torch import function_modes as fm

    mode = TorchFunctionMode()
    depth = fm.len_torch_function_stack()
    fm.push_on_torch_function_stack(mode)
    try:
        assert fm.len_torch_function_stack() == depth + 1
        assert fm.get_function_stack_at(depth) is mode
    finally:
        assert fm.pop_torch_function_stack() is mode
    assert fm.len_torch_function_stack() == depth


def _subclass() -> None:
    import shardwise as sw
    from shardwise._torch.subclass import make_subclass
    from shardwise.launch._meta_params import meta_parameters

    data = torch.zeros(2)
    sub = make_subclass(torch.nn.Parameter, data, True)
    assert isinstance(sub, torch.nn.Parameter) and sub.requires_grad
    assert sub.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
    with meta_parameters():  # (`subclass_data_rewritten`)
        linear = torch.nn.Linear(2048, 2048)
        own = sw.Parameter(torch.zeros(3))
        plain = torch.zeros(3)
    assert linear.weight.device.type == "meta" and isinstance(linear.weight, torch.nn.Parameter)
    assert own.device.type == "meta"  # (`make_subclass` looks torch's function up each call)
    assert plain.device.type == "cpu"
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # (put back)


def _module_state() -> None:
    from shardwise._torch import module_state as ms

    m = torch.nn.BatchNorm1d(2)
    assert "weight" in ms.own_parameters(m) and "running_mean" in ms.own_buffers(m)
    m.register_buffer("scratch", torch.zeros(1), persistent=False)
    names = ms.non_persistent_buffer_names(m)
    assert "scratch" in names and "running_mean" not in names
    ms.own_parameters(m)["bias"] = None  # (the live dicts)
    assert m.bias is None
    net = torch.nn.Sequential(m)
    fake = torch.ones(2)
    with ms.reparametrize(net, {id(m.weight): fake, id(m.running_mean): fake}):
        assert m.weight is fake and m.running_mean is fake
    assert isinstance(m.weight, torch.nn.Parameter) and m.running_mean is not fake


def _tensor_hooks() -> None:
    from shardwise._torch.tensor_hooks import reattach_hooks, swapped_on_conversion

    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        m = torch.nn.Linear(2, 1)
        seen: list[torch.dtype] = []
        m.weight.register_hook(lambda g: seen.append(g.dtype))
        m.to(torch.float64)  # (swapped: autograd no longer runs the hook)
        m(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
        assert seen == []
        assert swapped_on_conversion(m.parameters()) == [m.weight, m.bias]
        reattach_hooks(m.weight)
        reattach_hooks(m.weight)  # (again, nothing swapped since: still once)
        reattach_hooks(m.bias)  # (no hooks: nothing)
        m(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
        assert seen == [torch.float64]  # (once)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert swapped_on_conversion([torch.nn.Parameter(torch.ones(1))]) == []


def _c10d() -> None:
    from shardwise._torch import c10d

    timeout = datetime.timedelta(seconds=7)
    opts = c10d.gloo_options(timeout)
    assert isinstance(opts, c10d.BackendOptions) and opts._timeout == timeout
    assert hasattr(c10d.BackendOptions, "_timeout")  # (what `nccl_options` sets)
    if dist.is_nccl_available():
        assert c10d.nccl_options(timeout)._timeout == timeout
    assert c10d.TCPStore is dist.TCPStore and c10d.PrefixStore is dist.PrefixStore
    assert c10d.Store is dist.Store
    with pytest.raises((RuntimeError, ValueError)):
        c10d.default_store()  # (no process group)
    store = c10d.fake_process_group().FakeStore()
    dist.init_process_group("fake", rank=3, world_size=8, store=store)
    try:
        assert isinstance(c10d.default_store(), c10d.Store)
        assert dist.get_world_size() == 8 and dist.get_rank() == 3
        assert c10d.live_group_count() == 1
        name = c10d.member_group_name([5, 3])  # (the name the group below gets)
        pg = dist.new_group([3, 5], use_local_synchronization=True)
        assert pg.group_name == name and c10d.live_group_count() == 2
        assert c10d.member_group_name([3, 5]) != name  # (one group more held)
    finally:
        dist.destroy_process_group()


def _strided_shard() -> None:
    from torch.distributed.tensor import Placement

    from shardwise._torch.dtensor import StridedShard

    p = StridedShard(1, split_factor=2)
    assert isinstance(p, Placement) and p.dim == 1 and p.split_factor == 2
    assert p == StridedShard(1, split_factor=2) != StridedShard(1, split_factor=3)


def _dtensor_rules() -> None:
    from torch.distributed.tensor import Shard

    from shardwise._torch import dtensor as dt
    from shardwise.ops._dtensor import Spec, propagate

    assert dt.rule_count() > 1000  # DTensor's sharding strategies (about 1,160 overloads)
    assert dt.has_rule(torch.ops.aten.mm.default)
    # (the per-mesh-dim registry, asked one mesh dim at a time by ops/_dtensor._per_axis)
    single = dt.sharding_propagator().op_single_dim_strategy_funcs
    assert torch.ops.aten.add.Tensor in single and len(single) > 900
    assert dt.has_single_dim_rule(torch.ops.aten.add.Tensor)
    mesh = dt.mesh_without_process_group((2,), ("g0",), (0, 1))  # no process group
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
    p = dt.sharding_propagator()
    assert callable(p.propagate_op_sharding_non_cached)
    assert torch.ops.aten.view.default in p.op_to_shape_and_stride_idx
    z = dt.tensor_spec(mesh, (Shard(0),), (4, 4), (4, 1), "float32")
    ins, outs = dt.ask_propagator(torch.ops.aten.add.Tensor, (z, z), {})
    assert ins == [(Shard(0),), (Shard(0),)] and outs == [(Shard(0),)]


def _dtensor_given_meta() -> None:
    """The propagator learns an op's output metadata from ``_propagate_tensor_meta_non_cached``
    (a fake run); `ask_propagator` hands it the captured metadata instead: the same metadata in
    the same structure as the fake run's, the same answers, and no fake run."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    from shardwise._torch import dtensor as dt

    aten = torch.ops.aten
    mesh = dt.mesh_without_process_group((2, 2), ("a", "b"), (0, 1, 2, 3))
    x, w = torch.randn(8, 12, 6), torch.randn(6)
    cases = [  # (one tensor; a tuple of three; values and indices; a Tensor[]; a bool tensor)
        (aten.mm.default, (x[0], torch.randn(6, 4)), {}),
        (aten.native_layer_norm.default, (x, [6], w, w, 1e-5), {}),
        (aten.max.dim, (x, 1, True), {}),
        (aten.split.Tensor, (x, 4, 1), {}),
        (aten.gt.Scalar, (x.transpose(0, 1), 0.0), {}),
    ]
    real = ShardingPropagator._propagate_tensor_meta_non_cached
    fake_runs: list[object] = []

    def counted(self: ShardingPropagator, schema: object) -> object:
        fake_runs.append(schema)
        return real(self, schema)

    p = dt.sharding_propagator()
    for op, args, kwargs in cases:
        place = (Shard(0), Replicate())
        spec_of = {
            id(t): dt.tensor_spec(mesh, place, tuple(t.shape), t.stride(), str(t.dtype)[6:])
            for t in args
            if isinstance(t, torch.Tensor)
        }
        a = tuple(spec_of.get(id(t), t) for t in args)
        got = op(*args, **kwargs)
        outs = [t for t in (got if isinstance(got, tuple | list) else [got])]
        meta = [(tuple(t.shape), t.stride(), str(t.dtype)[6:]) for t in outs]
        schema = dt.OpSchema(op, a, kwargs)
        assert dt._meta_tree(op, meta) == real(p, schema), op  # (the fake run's, as given)
        ShardingPropagator._propagate_tensor_meta_non_cached = counted  # type: ignore[method-assign]
        try:
            p.propagate_op_sharding.cache_clear()
            given = dt.ask_propagator(op, a, kwargs, meta)
            assert not fake_runs, (op, fake_runs)
            p.propagate_op_sharding.cache_clear()
            ran = dt.ask_propagator(op, a, kwargs)
            assert len(fake_runs) == 1, (op, fake_runs)  # (DTensor's own fake run, as before)
        finally:
            ShardingPropagator._propagate_tensor_meta_non_cached = real  # type: ignore[method-assign]
            fake_runs.clear()
        assert given == ran, (op, given, ran)


def _dispatch() -> None:
    from shardwise._torch import dispatch

    assert isinstance(torch.ops.aten.add.Tensor, dispatch.OpOverload)
    assert isinstance(torch.ops.aten.add, dispatch.OpOverloadPacket)
    assert issubclass(torch.Tensor, dispatch.TensorBase)
    assert callable(dispatch.TensorBase.contiguous)
    assert dispatch.argument_names(torch.ops.aten.native_dropout.default) == ("input", "p", "train")
    aten = torch.ops.aten  # (the schemas' alias annotations: views, in-place, list views)
    assert dispatch.returned_aliases(aten.detach.default) == ((0,),)
    assert dispatch.returned_aliases(aten.mul_.Tensor) == ((0,),)
    assert dispatch.returned_aliases(aten.unbind.int) == ((0,),)
    assert dispatch.returned_aliases(aten._unsafe_view.default) == ((),)
    assert dispatch.returned_aliases(aten.max.dim) == ((), ())
    seen: list[object] = []

    class Seen(dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Seen():
        torch.ones(2) + 1
    assert torch.ops.aten.add.Tensor in seen, seen


def _fake_tensors() -> None:
    from shardwise._torch.fake import (
        DATA_DEPENDENT,
        FakeTensor,
        FakeTensorMode,
        empty_fake,
        holds_fake,
    )

    class Wrapper(torch.Tensor):  # (a traceable wrapper subclass: LocalTensor, DTensor)
        @staticmethod
        def __new__(cls, inner: torch.Tensor) -> Wrapper:
            return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

        def __init__(self, inner: torch.Tensor) -> None:
            self.inner = inner

        def __tensor_flatten__(self) -> tuple[list[str], None]:
            return ["inner"], None

        @staticmethod
        def __tensor_unflatten__(inner: Any, meta: Any, size: Any, stride: Any) -> Wrapper:
            return Wrapper(inner["inner"])

        @classmethod
        def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            raise NotImplementedError

    with FakeTensorMode():
        x = torch.ones(4, 3)
        assert holds_fake(x)
        assert (x @ x.T).shape == (4, 4)
        assert isinstance(x, FakeTensor)
        for read in (lambda: x.sum().item(), lambda: torch.nonzero(x)):
            with pytest.raises(DATA_DEPENDENT):
                read()
    assert not isinstance(torch.ones(1), FakeTensor)
    mode = FakeTensorMode()
    e = empty_fake(mode, (4, 3), (1, 4), torch.bfloat16, torch.device("cpu"))
    assert isinstance(e, FakeTensor) and e.fake_mode is mode and e.device.type == "cpu"
    assert (e.shape, e.stride(), e.dtype) == ((4, 3), (1, 4), torch.bfloat16)
    with mode:
        assert (e.T @ e).shape == (3, 3)
    assert holds_fake(Wrapper(x)) and not holds_fake(Wrapper(torch.ones(4, 3)))
    assert not holds_fake(torch.ones(1))


def _profiler_events() -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    from shardwise._torch.profiler_events import Allocation, Range, events

    activities = [ProfilerActivity.CPU]
    with (
        profile(activities=activities, profile_memory=True) as prof,
        record_function("shardwise.test:window"),
    ):
        torch.ones(256)
    got = list(events(prof, "shardwise.test:"))
    allocations = [e for e in got if isinstance(e, Allocation)]
    assert any(a.nbytes == 1024 for a in allocations), allocations
    assert all(isinstance(a.ptr, int) and isinstance(a.time_ns, int) for a in allocations)
    ranges = [e for e in got if isinstance(e, Range)]
    assert [r.name for r in ranges] == ["shardwise.test:window"], ranges
    assert ranges[0].start_ns <= ranges[0].end_ns


def _clip_grad() -> None:
    from shardwise._torch.clip_grad import (
        TORCH_CLIP_WITH_NORM,
        TORCH_TOTAL_NORM,
        guard_clipping,
        total_norm_replaced,
    )

    # (a level-1 hsdp engine put guards in front of the steps for good: `guard_clipping`)
    in_place = torch.nn.utils.clip_grad._clip_grads_with_norm_, torch.nn.utils.get_total_norm
    t = torch.zeros(2, requires_grad=True)
    t.grad = torch.tensor([3.0, 4.0])
    assert float(TORCH_TOTAL_NORM([t.grad], 2.0, False, None)) == 5.0
    seen: list[int] = []

    def total(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):  # type: ignore[no-untyped-def]
        seen.append(len(tensors))
        return torch.tensor(10.0)

    with total_norm_replaced(total):  # (every name clip_grad_norm_ is imported by)
        assert float(torch.nn.utils.clip_grad_norm_([t], 1.0)) == 10.0
        assert float(torch.nn.utils.clip_grad.clip_grad_norm_([t], 1.0)) == 10.0
    assert seen == [1, 1] and float(torch.nn.utils.clip_grad_norm_([t], 1.0)) != 10.0
    # the scaling step: called after the total norm, with the parameters and that same tensor
    scaled: list[tuple[list[torch.Tensor], float, torch.Tensor]] = []
    norm = torch.tensor(7.0)

    def scale(parameters, max_norm, total_norm, foreach=None):  # type: ignore[no-untyped-def]
        scaled.append((list(parameters), max_norm, total_norm))
        TORCH_CLIP_WITH_NORM(parameters, max_norm, total_norm, foreach)

    with total_norm_replaced(lambda *a, **k: norm, scale):
        assert torch.nn.utils.clip_grad_norm_((p for p in [t]), 0.5) is norm
    assert len(scaled) == 1 and scaled[0][0][0] is t and scaled[0][1:] == (0.5, norm)
    assert torch.nn.utils.clip_grad._clip_grads_with_norm_ is in_place[0]
    # the two-step form's name on torch.nn.utils: torch's total norm, replaceable
    assert float(torch.nn.utils.get_total_norm([t.grad])) == float(TORCH_TOTAL_NORM([t.grad]))
    with total_norm_replaced(total, None, lambda *a, **k: norm):
        assert torch.nn.utils.get_total_norm([t.grad]) is norm
    assert torch.nn.utils.get_total_norm is in_place[1]
    # clip_grad_value_ groups the gradients with the module's function, looked up at call time
    grouped: list[object] = []
    t.grad = torch.tensor([3.0, 4.0])

    def grouping(tensors, *args, **kwargs):  # type: ignore[no-untyped-def]
        grouped.append(tensors)
        return {}

    with total_norm_replaced(total, None, None, grouping):
        torch.nn.utils.clip_grad_value_([t], 0.1)
    assert len(grouped) == 1 and grouped[0][0][0] is t.grad and t.grad.tolist() == [3.0, 4.0]
    torch.nn.utils.clip_grad_value_([t], 0.5)  # (torch's own again)
    assert t.grad.tolist() == [0.5, 0.5]
    # guards in front of every step, asked with the call's arguments (None: the step runs)
    asked: list[tuple[str, int]] = []
    active: list[bool] = []

    def guard(step, args):  # type: ignore[no-untyped-def]
        asked.append((step, len(args)))
        return (lambda *a, **k: norm) if active and step == "total_norm" else None

    guard_clipping(guard)
    t.grad = torch.tensor([3.0, 4.0])
    assert float(torch.nn.utils.clip_grad_norm_([t], 10.0)) == 5.0
    assert ("total_norm", 4) in asked and ("scale", 4) in asked, asked
    active.append(True)
    assert torch.nn.utils.clip_grad_norm_([t], 10.0) is norm
    torch.nn.utils.clip_grad_value_([t], 1.0)
    assert ("group", 1) in asked and t.grad.tolist() == [1.0, 1.0]
    assert abs(float(torch.nn.utils.get_total_norm([t.grad])) - 2**0.5) < 1e-6
    assert ("public", 1) in asked
    active.clear()


def _checkpointing() -> None:
    from torch.utils.checkpoint import checkpoint

    from shardwise._torch.checkpointing import checkpointing, in_activation_checkpoint

    seen: list[tuple[bool, bool]] = []

    def region(t: torch.Tensor) -> torch.Tensor:
        seen.append((in_activation_checkpoint(), checkpointing()))
        return t * 2

    x = torch.ones(2, requires_grad=True)
    checkpoint(region, x, use_reentrant=False)  # (saved-tensor hooks of torch.utils.checkpoint)
    checkpoint(region, x, use_reentrant=True)  # (a frame of torch/utils/checkpoint.py)
    region(x)
    with torch.no_grad():
        region(x)
    assert seen == [(True, True), (True, True), (False, False), (False, False)], seen
    # a non-reentrant region's frame (its pack hook's closure) and its recompute_fn
    from shardwise._torch.checkpointing import around_recomputation, checkpoint_frame

    frames: list[object] = []
    ran: list[str] = []

    def sine(t: torch.Tensor) -> torch.Tensor:
        frames.append(checkpoint_frame())
        return t.sin()

    out = checkpoint(sine, x, use_reentrant=False)
    assert frames[0] is not None and checkpoint_frame() is None
    # how many tensors it saved (sin saves its input) and whether its recomputation stops early
    from torch.utils.checkpoint import set_checkpoint_early_stop

    from shardwise._torch.checkpointing import saved_count, stops_early

    assert saved_count(frames[0]) == 1 and stops_early(frames[0])
    with set_checkpoint_early_stop(False):
        checkpoint(sine, x, use_reentrant=False)
    assert not stops_early(frames[1])
    del frames[1]

    def around(run: Callable[[], None]) -> None:
        ran.append("around")
        run()

    around_recomputation(frames[0], around)
    out.sum().backward()
    assert ran == ["around"] and len(frames) == 2 and frames[1] is None  # (recomputing)
    # a reentrant region's ctx (CheckpointFunction.forward's local) and its run_function
    from shardwise._torch.checkpointing import (
        around_rerun,
        in_reentrant_backward,
        reentrant_context,
    )

    contexts: list[object] = []

    backward: list[bool] = []

    def cosine(t: torch.Tensor) -> torch.Tensor:
        contexts.append(reentrant_context())
        backward.append(in_reentrant_backward())
        return t.cos()

    out = checkpoint(cosine, x, use_reentrant=True)
    assert contexts[0] is not None and reentrant_context() is None
    around_rerun(contexts[0], around)
    out.sum().backward()
    assert ran == ["around", "around"] and contexts[1] is None  # (rerun in backward)
    assert backward == [False, True]  # (CheckpointFunction.backward on the stack)
    # preserve_rng_state: a reentrant ctx's attribute, a non-reentrant recompute_fn's closure
    from shardwise._torch.checkpointing import checkpoint_region

    regions: list[object] = []
    for reentrant in (True, False):
        for keep in (True, False):
            checkpoint(
                lambda t: regions.append(checkpoint_region()) or t.sin(),
                x,
                use_reentrant=reentrant,
                preserve_rng_state=keep,
            )
            found = regions[-1]
            assert isinstance(found, tuple) and found[1] is keep, (reentrant, keep)
            if reentrant:
                assert vars(found[0])["preserve_rng_state"] is keep
            else:
                names = found[0].recompute_fn.__code__.co_freevars
                assert "preserve_rng_state" in names


def _function_apply() -> None:
    from shardwise._torch.function_apply import running_function

    seen: list[object] = []

    class Inner(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            seen.append(running_function())
            seen.append(running_function(lambda cls: cls is Inner))
            return x * 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * 2

    class Outer(torch.autograd.Function):
        @staticmethod
        def forward(x: torch.Tensor) -> torch.Tensor:  # (new style, no ctx)
            seen.append(running_function())
            return Inner.apply(x) + 1

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            pass

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g

    Outer.apply(torch.ones(2, requires_grad=True))
    assert seen == [Outer, Inner, Outer], seen  # (innermost first; the skipped one passed over)
    assert running_function() is None


def _grad_scaler() -> None:
    from shardwise._torch.grad_scaler import agree_on_overflow

    net = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    seen: list[float] = []

    def reduce(t: torch.Tensor) -> torch.Tensor:  # (another rank found an overflow)
        seen.append(float(t))
        return torch.ones_like(t)

    agree_on_overflow(scaler, reduce)
    scaler.scale(net(torch.ones(1, 2)).sum()).backward()
    before = net.weight.detach().clone()
    scaler.step(opt)  # (unscale_ -> the private _unscale_grads_ -> our verdict: skipped)
    scaler.update()
    assert seen == [0.0] and torch.equal(net.weight, before) and scaler.get_scale() == 2.0**15


def _pytree() -> None:
    from collections import namedtuple

    from shardwise._torch import pytree

    Pair = namedtuple("Pair", "a b")
    tree = {"x": [1, Pair(2, 3)], "y": (torch.Size([4]),)}
    leaves, spec = pytree.tree_flatten(tree)
    assert leaves == [1, 2, 3, 4] and pytree.tree_unflatten(leaves, spec) == tree
    assert pytree.tree_structure(tree) == spec and pytree.tree_leaves(tree) == leaves
    paths = [pytree.keystr(k) for k, _ in pytree.tree_flatten_with_path(tree)[0]]
    assert paths == ["['x'][0]", "['x'][1].a", "['x'][1].b", "['y'][0][0]"], paths
    assert pytree.tree_map(lambda v: v * 2, [1, (2,)]) == [2, (4,)]
    assert pytree.tree_map_only(int, str, [1, 2.0]) == ["1", 2.0]
    assert tuple in pytree.SUPPORTED_NODES and torch.Size in pytree.SUPPORTED_NODES


def _local_tensor_world() -> None:
    with simulated_world(2) as world:
        x = world.rank_map(lambda r: torch.full((1,), float(r)))
        assert [float(t) for t in x._local_tensors.values()] == [0.0, 1.0]
        assert isinstance(world.mode._per_rank_rng_states, dict)
    lt = importlib.import_module("torch.distributed._local_tensor")
    assert callable(lt._get_rng_state) and callable(lt._set_rng_state)


def _local_tensor_mode_dispatch() -> None:
    """`testing/_sim_mode` subclasses LocalTensorMode: its ``__torch_dispatch__(func,
    types, args, kwargs)``, its ``_disable`` flag, ``rank_map``; an op's ``_schema`` alias
    info tells a write into the first argument."""
    lt = importlib.import_module("torch.distributed._local_tensor")
    names = list(inspect.signature(lt.LocalTensorMode.__torch_dispatch__).parameters)
    assert names == ["self", "func", "types", "args", "kwargs"], names
    # (its per-rank runner, for an op given a per-rank int beside plain tensors)
    run = list(inspect.signature(lt._for_each_rank_run_func).parameters)
    assert run == ["func", "ranks", "args", "kwargs", "alias"], run
    with simulated_world(2) as world:
        assert world.mode._disable is False and callable(world.mode.rank_map)
        with world.outside():
            assert world.mode._disable is True
        # (its seeding, patched in by _patch_random_functions, made quiet by the guard)
        assert getattr(torch.manual_seed, "quiet", False)
        assert getattr(torch.random.manual_seed, "quiet", False)
    assert not hasattr(torch.manual_seed, "quiet")
    alias = torch.ops.aten.add_.Tensor._schema.arguments[0].alias_info
    assert alias is not None and alias.is_write


def _rnn_check() -> None:
    from shardwise._torch.rnn import hidden_check

    for cls in (torch.nn.GRU, torch.nn.LSTM, torch.nn.RNN):
        check = hidden_check(cls(2, 3))
        assert check is not None, cls
        assert list(inspect.signature(check).parameters)[:2] == ["hx", "expected_hidden_size"]
        check(torch.zeros(1, 4, 3), (1, 4, 3))  # (the right size passes)
        with pytest.raises(RuntimeError, match="Expected hidden size"):
            check(torch.zeros(1, 5, 3), (1, 4, 3))


def _transformer() -> None:
    from shardwise._torch.transformer import (
        canonical_masks,
        fast_path_devices,
        mask_checked,
        nested_enabled,
    )
    from shardwise.parallel._nested_encoders import _padded_forward

    x = torch.randn(4, 5, 8)
    pad = torch.zeros(4, 5, dtype=torch.bool)
    pad[1, -2:] = True
    mask, padding = canonical_masks(x, None, pad)
    assert mask is None and padding is not None and padding.dtype == x.dtype
    assert torch.equal(padding, torch.zeros(4, 5).masked_fill(pad, float("-inf")))
    assert "cpu" in fast_path_devices()
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (norm_first: "use_nested_tensor is False")
        unfit = torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, norm_first=True), 1
        )
    assert not nested_enabled(unfit)
    unaligned = pad.clone()
    unaligned[2, 1] = True
    for check in (True, False):
        enc = torch.nn.TransformerEncoder(layer, 2, mask_check=check).eval()
        assert nested_enabled(enc) and mask_checked(enc) is check
        for p in (pad, unaligned):  # (torch's own path: zeros where it packed, replayed alike)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (nested tensors are a prototype)
                want = enc(x, src_key_padding_mask=p)
                got = _padded_forward(enc, x, src_key_padding_mask=p)
            assert torch.allclose(got, want, atol=1e-6), (check, p)
            assert bool((want[1, -2:] == 0).all()) is (p is pad or not check), (check, p)


def _functorch() -> None:
    from torch.func import grad, jvp, vmap

    from shardwise._torch.functorch import current_transform

    seen: list[str | None] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append(current_transform())
        return x.sin().sum()

    assert current_transform() is None
    vmap(f)(torch.ones(2, 3))
    grad(f)(torch.ones(3))
    jvp(f, (torch.ones(3),), (torch.ones(3),))
    vmap(grad(f))(torch.ones(2, 3))  # (the innermost: grad)
    assert seen == [
        "torch.func.vmap",
        "torch.func.grad / vjp / jacrev",
        "torch.func.jvp / jacfwd",
        "torch.func.grad / vjp / jacrev",
    ], seen
    assert current_transform() is None


CASES: dict[str, Callable[[], None]] = {
    "_torch/autograd_engine: graph task id, will_engine_execute_node, queue_callback": (
        _autograd_engine
    ),
    "_torch/autograd_engine: an autograd Function's _backward_cls": _backward_node_class,
    "_torch/autograd_engine: a graph node's metadata dict": _node_metadata,
    "_torch/storage: storage _cdata, _storage_Use_Count, Tensor._base, Tensor._version": _storage,
    "_torch/function_modes: the torch-function mode stack": _function_mode_stack,
    "_torch/subclass: Tensor._make_subclass, replaced for meta parameters": _subclass,
    "_torch/module_state: Module._parameters / _buffers / _non_persistent_buffers_set": (
        _module_state
    ),
    "_torch/tensor_hooks: Tensor._backward_hooks, handed to autograd again": _tensor_hooks,
    "_torch/c10d: Backend.Options, _timeout, _get_default_store, stores, fake pg": _c10d,
    "_torch/dtensor: _StridedShard": _strided_shard,
    "_torch/dtensor: DTensor's sharding propagator and a mesh without process group": (
        _dtensor_rules
    ),
    "_torch/dtensor: ShardingPropagator._propagate_tensor_meta_non_cached, handed the "
    "captured output metadata": _dtensor_given_meta,
    "_torch/dispatch: TorchDispatchMode, OpOverload(Packet), TensorBase, OpOverload._schema "
    "(argument names, alias annotations)": (_dispatch),
    "_torch/fake: fake tensors and their data-dependent exceptions": _fake_tensors,
    "_torch/profiler_events: the profiler's event tree and its allocation records": (
        _profiler_events
    ),
    "_torch/pytree: torch.utils._pytree": _pytree,
    "_torch/function_apply: Function.apply's frame and its cls": _function_apply,
    "_torch/checkpointing: top saved-tensor hooks, CheckpointFunction.forward and its ctx's "
    "run_function, CheckpointFunction.backward, the pack hook's frame, its recompute_fn, "
    "weak_holders and early_stop": (_checkpointing),
    "_torch/clip_grad: clip_grad._get_total_norm, _clip_grads_with_norm_": _clip_grad,
    "_torch/grad_scaler: GradScaler._unscale_grads_ and its found_inf dict": _grad_scaler,
    "_torch/rnn: nn.RNNBase.check_hidden_size(hx, expected_hidden_size, msg)": _rnn_check,
    "_torch/transformer: F._canonical_mask, _privateuse1_backend_name, TransformerEncoder's "
    "use_nested_tensor / mask_check and its nested path's zeros": _transformer,
    "_torch/functorch: _C._functorch.maybe_current_level, the current interpreter's key": (
        _functorch
    ),
    "testing/_replaced: _disable_current_modes": _callable(
        "torch.utils._python_dispatch", "_disable_current_modes"
    ),
    "testing/_world: fake process group": _callable(
        "torch.testing._internal.distributed.fake_pg", "FakeStore"
    ),
    "testing/_world: LocalTensor, its per-rank values and RNG states": _local_tensor_world,
    "testing/_sim_mode: LocalTensorMode's dispatch, _disable, rank_map, seeding, its "
    "per-rank runner": (_local_tensor_mode_dispatch),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_private_torch_api_is_there(case: str) -> None:
    CASES[case]()


def test_each_case_names_a_torch_module_and_each_module_has_a_case() -> None:
    modules = {p.stem for p in TORCH_PACKAGE.glob("*.py") if p.stem != "__init__"}
    named = {case.split(":")[0].removeprefix("_torch/") for case in CASES}
    assert named - {"testing/_world", "testing/_replaced", "testing/_sim_mode"} <= modules, sorted(
        named - modules
    )
    assert modules <= named, f"no case checks _torch/{sorted(modules - named)}"


_FIX = (
    "move each into the module of src/shardwise/_torch/ for its API family (a new one: with a "
    "case in CASES here) and import it from there"
)


def _scanned_modules(package: Path) -> list[Path]:
    return [
        p
        for p in sorted(package.rglob("*.py"))
        if p.relative_to(package).parts[0] not in EXEMPT_PACKAGES
    ]


def test_private_torch_apis_only_in_torch_package() -> None:
    found = [
        f
        for path in _scanned_modules(PACKAGE)
        for f in private_torch_uses(
            path.read_text(encoding="utf-8"), f"src/shardwise/{path.relative_to(PACKAGE)}"
        )
    ]
    assert not found, (
        f"{len(found)} uses of private torch APIs outside src/shardwise/_torch/; {_FIX}:\n  "
        + "\n  ".join(found)
    )


@pytest.mark.parametrize(
    ("code", "what"),
    [
        ("import torch\ntorch._C._current_graph_task_id()", "torch._C._current_graph_task_id"),
        ("from torch._C._distributed_c10d import TCPStore", "torch._C._distributed_c10d"),
        ("from torch.utils import _pytree as pytree", "torch.utils._pytree"),
        ("from torch.distributed.tensor import _ops", "torch.distributed.tensor._ops"),
        ("import torch.distributed as dist\ndist.distributed_c10d._get_default_store()", "_get"),
        ("from torch import nn\nT = nn.Module\nT._parameters", "torch.nn.Module._parameters"),
        ("t.untyped_storage()._cdata", "._cdata"),
        ("prof.profiler.kineto_results.experimental_event_tree()", ".experimental_event_tree"),
        ("import importlib\nimportlib.import_module('torch._dynamo.x')", "torch._dynamo.x"),
        ("from torch.distributed import DeviceMesh as M\nM('cpu', _rank=0)", "_rank="),
        ("import operator\noperator.attrgetter('_base')", "'_base' by name"),
    ],
)
def test_the_scan_finds_private_uses(code: str, what: str) -> None:
    found = private_torch_uses(code, "m.py")
    assert len(found) == 1 and what in found[0], found


def test_the_scan_leaves_public_and_own_names_alone() -> None:
    code = (
        "import torch\nfrom shardwise.ops import _flat as flat\nfrom shardwise import _torch\n"
        "torch.__version__\ntorch.ops.aten._scaled_dot_product_flash_attention_for_cpu\n"
        "self._plan._errors\nsys._getframe(2)\ntorch.nn.Module.register_buffer\n"
    )
    assert private_torch_uses(code, "m.py") == []


def test_a_guard_first_installed_inside_a_replaced_block_outlives_it() -> None:
    """A level-1 engine's clipping guards installed while a `total_norm_replaced` block runs
    (before any guard existed): the block's exit restored the unguarded steps and the guards,
    installed once, were never asked again. Run in a fresh interpreter (no guard yet)."""
    code = (
        "import torch\n"
        "from shardwise._torch.clip_grad import guard_clipping, total_norm_replaced\n"
        "asked = []\n"
        "t = torch.zeros(2, requires_grad=True); t.grad = torch.tensor([3.0, 4.0])\n"
        "with total_norm_replaced(lambda *a, **k: torch.tensor(1.0)):\n"
        "    guard_clipping(lambda step, args: asked.append(step))\n"
        "torch.nn.utils.clip_grad_norm_([t], 10.0)\n"
        "print(sorted(set(asked)))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip().splitlines()[-1] == "['group', 'scale', 'total_norm']", out.stdout
