"""Errors of the parallel runtime, `Replan` (the executor's signal to plan a call again),
`plan_mismatch` (a call other than the plan's next node: another op, or its op on other
parameters), `replanned_call_differs` (why a call differs from the plan captured from it: a
primitive made inside ``forward``, a Python loop or branch on a split tensor's local shape, or
on a split dim's size read before the op the plan has next),
`note_blocks` (what torch's size mismatch with a parameter stored as a block means:
`frozen_note` when a frozen parameter met a trainable one of its shape stored otherwise, an EMA
teacher), `split_values_note` (the values held as blocks where a plan's first call raised in the
network's code: a size compared in Python sees the block's), `hidden_inputs_note` (an
argument whose tensors the plan does not see: a Hugging Face cache object) and `refuse_lazy` (a
lazy module whose parameters are not made yet)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise._torch import pytree
from shardwise.parallel._param_reads import Reads, node_reads, shown
from shardwise.planner._graph import Ref, SizeRead
from shardwise.planner._placed import Placed, Shape

if TYPE_CHECKING:
    from shardwise.planner import NodePlan, ParallelPlan


class UnsupportedParallelError(ValueError):
    """The network uses something the semi_auto runtime cannot run in parallel (yet): the
    message names the primitive or tensor and what is supported."""


class Replan(BaseException):
    """The network ran other ops than the plan's before any backward of this call (a branch
    on a Python flag): `GraphRun` plans it again and runs the call anew. A BaseException, so
    that user code's ``except Exception`` lets it pass.

    Attributes:
        cursor: how many of the plan's ops ran.
        op: the op the network called instead of the plan's next one (None: it stopped there).
        params: per tensor of that call, the parameter it is (its name) or None; None when not
            known (`_param_reads.call_reads`: a call of the next node's op on other parameters
            is another node).
        sizes: the call of the plan's op at `cursor` with other sizes than captured
            (`_sizes.Sizes.sizes`: ``table[n]`` with `n` passed per call): its sizes that came
            from no local shape, as (position in its flattened arguments, value).
    """

    def __init__(
        self,
        message: str,
        cursor: int,
        op: str | None,
        params: Reads | None = None,
        sizes: tuple[tuple[int, Any], ...] | None = None,
    ) -> None:
        super().__init__(message)
        self.cursor, self.op, self.params, self.sizes = cursor, op, params, sizes


def plan_mismatch(
    node: NodePlan, op: str, got: Reads, did: str, backward_seen: bool
) -> BaseException:
    """The error for a call of `op` on parameters `got` where the plan's next node is `node`
    (another op, or its op on other parameters stored or reduced otherwise: `_param_reads`):
    `Replan` before the call's first backward, else `UnsupportedParallelError` (`did`: what the
    network did, for its message: "called")."""
    want = node_reads(node)
    on = "" if op != node.op else f" on {shown(got)}"
    where = f"%{node.index} {node.name} ({node.op}){'' if not on else f' on {shown(want)}'}"
    if not backward_seen:
        return Replan(f"{op}{on} where the plan has {where}", node.index, op, got)
    same = "same torch ops" + (" on the same parameters" if on else "")
    return UnsupportedParallelError(
        f"AutoParallel: the network {did} {op}{on} where the plan has op {where}, after a "
        f"backward inside this call; every later pass of a call (a gradient-accumulation "
        f"micro-batch, an optimizer's closure) must run the {same} in the same order as its "
        "first pass (docs/parallel.md, 'Gradient accumulation inside a step'): run the "
        "differing ops in every pass, or call the wrapped step once per micro-batch"
    )


def replanned_call_differs(
    plan: ParallelPlan, e: Replan, size_reads: Sequence[SizeRead] = ()
) -> UnsupportedParallelError:
    """The error for a call that ran other ops than the plan captured from that very call
    (`e`): a shardwise primitive made inside ``forward`` (not a submodule, so the run never
    sees it as one: its torch op arrives instead), a Python loop or branch on the shape of a
    value the plan holds as blocks (`_split_read`: the next op reads it; `_size_branch`: the
    capture's `size_reads` read it before the next op), else ops depending on what capture
    does not see."""
    why = "its ops depend on something capture does not see"
    node = plan.nodes[e.cursor] if e.cursor < len(plan.nodes) else None
    primitive = node is not None and node.op.startswith("shardwise.ops.")
    if node is not None and primitive and e.op is not None and e.op != node.op:
        kind = node.op.removeprefix("shardwise.ops.")
        why = (
            f"%{node.index} {node.name} is a shardwise primitive that is not a submodule of the "
            f"network (made inside forward?): AutoParallel runs primitives that are submodules "
            f"only; create it in __init__ (self.op = sw.ops.{kind}(...)) and call self.op"
        )
    elif node is not None:
        why = _split_read(plan, node) or _size_branch(plan, node, size_reads) or why
    return UnsupportedParallelError(
        f"AutoParallel: the network called {e} right after being planned for this call; {why}"
    )


def _split_read(plan: ParallelPlan, node: NodePlan) -> str | None:
    """Why the call did not reach `node` when one of its inputs is held as this rank's block:
    a Python loop or branch on that block's shape (the capture saw the global one); None when
    every input is held whole."""
    edges = {e.slot: e for e in plan.edges_by_consumer().get(node.index, [])}
    for slot, (value, shape) in enumerate(zip(node.values, node.in_shapes, strict=False)):
        held = edges[slot].src if slot in edges else node.inputs[slot]
        local = held.layout.local_shape(shape)
        if tuple(local) == tuple(shape):
            continue
        whole = ", ".join("1" for _ in shape) + ("," if len(shape) == 1 else "")
        made = ""
        if value.startswith("%"):  # (``%2`` or ``%2.1``: the op making it, named)
            made = f"{plan.nodes[int(value[1:].split('.')[0])].name}, "
        return (
            f"%{node.index} {node.name} reads {value} ({made}global shape {list(shape)}), which "
            f"the plan holds as this rank's block {list(local)}: inside the network its shape is "
            f"the block's (shapes are local), but the plan was captured with the global one, "
            f"so a Python loop or branch on it (for i in range(t.shape[0]), if t.size(0) > n) "
            f"runs other ops than planned. Gather it whole before reading its shape "
            f"(t = sw.reshard(t, ({whole}))), or compute over the dim with tensor ops instead "
            f"of a Python loop (t.pow(2).sum(1) weighted by torch.arange(...))"
        )
    return None


def _size_branch(plan: ParallelPlan, node: NodePlan, reads: Sequence[SizeRead]) -> str | None:
    """Why the call did not reach `node` when the network's Python code read, before it, the
    shape of values the plan holds as this rank's block (`reads`: the capture's): a branch on
    a split dim's size (Hugging Face's ``if batch_size != position_ids.shape[0]``), which the
    capture took on the global size. None when it read no such value."""
    found: dict[str, str] = {}
    for read in reversed([r for r in reads if r.before <= node.index]):
        held = _held(plan, read.value)
        if held is None or str(read.value) in found or len(found) == 3:
            continue
        placed, shape = held
        local = placed.local_shape(shape)
        dims = [d for d, (a, b) in enumerate(zip(shape, local, strict=False)) if a != b]
        if dims:
            sizes = ", ".join(f"dim {d}: {shape[d]} in the capture, {local[d]} here" for d in dims)
            found[str(read.value)] = (
                f"{_value_name(plan, read.value)} at {read.source} (global shape "
                f"{list(shape)}, this rank's block {list(local)}: {sizes})"
            )
    if not found:
        return None
    return (
        f"before %{node.index} {node.name} the network's Python code read the shape of "
        f"{'; '.join(found.values())}. The capture saw the global sizes, this rank sees its "
        f"block's, so a Python branch on such a size (if x.shape[0] != pos.shape[0]: pos = "
        f"pos.expand(x.shape[0], -1)) went another way here. Do not branch on a split dim's "
        f"size (let broadcasting expand a size-1 dim), or give each rank at least 2 rows when "
        f"the branch compares the batch with a size of 1; a Hugging Face model compares the "
        f"batch with position_ids' rows: pass position_ids with the batch's rows "
        f"(torch.arange(t).expand(b, t), split into rows as input_ids is)"
    )


def _held(plan: ParallelPlan, value: Ref) -> tuple[Placed, Shape] | None:
    """How the plan holds `value` where the network's code reads it (an input as it arrives,
    a node's output as the node makes it) and its global shape; None for other values."""
    if value.kind == "input" and value.key in plan.inputs:
        key = str(value.key)
        return plan.inputs[key], tuple(plan.input_shapes.get(key, ()))
    if value.kind == "node" and int(value.key) < len(plan.nodes):
        made = plan.nodes[int(value.key)]
        if value.index < min(len(made.outputs), len(made.shapes)):
            return made.outputs[value.index], made.shapes[value.index]
    return None


def _value_name(plan: ParallelPlan, value: Ref) -> str:
    """A value as the error names it: ``input args[0]``, ``%3 (transformer/view)``."""
    if value.kind == "input":
        return f"input {value.key}"
    return f"{value} ({plan.nodes[int(value.key)].name})"


def split_values_note(error: BaseException, plan: ParallelPlan, cursor: int) -> None:
    """Add a note to `error`, raised by Python code (the user's, torch's: not shardwise's) while
    `plan` ran its first call, `cursor` of its ops done, naming the values the plan holds as
    blocks there that later ops read, whose local shape differs from the global one in a dim
    other than the inputs' rows: code reading such a value's size (``x.size(-1)``,
    ``x.shape``) and comparing it in Python (torch's ``nn.Transformer`` checks ``d_model``)
    sees the block's size, where capture saw the global one. No note when there is none."""
    if not isinstance(error, Exception) or _raised_by_shardwise(error):
        return
    later = {v for n in plan.nodes[cursor:] for v in n.values}
    held = []
    for node in plan.nodes[:cursor]:
        for i, (placed, shape) in enumerate(zip(node.outputs, node.shapes, strict=False)):
            value = f"%{node.index}" + (f".{i}" if i else "")
            local, dims = placed.local_shape(shape), placed.layout.dims
            split = [
                d
                for d, axes in enumerate(dims)
                if local[d] != shape[d] and not (d == 0 and _rows(plan, axes))
            ]
            if value in later and split:
                names = " and ".join(f"dim {d} over {_axes(plan, dims[d])}" for d in split)
                held.append(
                    f"{node.name}'s output ({value}): block {list(local)} of the global "
                    f"{list(shape)} ({names})"
                )
    if not held:
        return
    semi = "" if plan.mode == "semi_auto" else ", or parallel_mode='semi_auto'"
    error.add_note(
        f"shardwise: this is the plan's first call, stopped after {cursor} of its ops; the plan "
        f"holds these values as each rank's block, whose shape differs from the global one: "
        f"{'; '.join(held)}. Code that reads such a tensor's size (x.size(-1), x.shape) and "
        f"compares it in Python (torch's nn.Transformer checks src.size(-1) == d_model) sees "
        f"the block's size. Keep that dim whole: annotate the op that makes the value with a "
        f"strategy that leaves it unsplit (sw.shard(net.emb, in_strategy=((2, 1), (1, 1))) "
        f"for an embedding), or gather it whole before passing it on (sw.reshard){semi}"
    )


def _raised_by_shardwise(error: BaseException) -> bool:
    """Whether `error`'s innermost Python frame is shardwise's (its own checks, an op its
    executor ran), not the network's code or torch's Python code."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE)


def _rows(plan: ParallelPlan, axes: Sequence[int]) -> bool:
    """Whether a value's dim 0 split over `axes` is the batch the inputs' rows are split into
    (its axes among those of an input's dim 0; a 0-d input has none)."""
    return any(set(axes) <= set(p.layout.dims[0]) for p in plan.inputs.values() if p.layout.dims)


def _axes(plan: ParallelPlan, axes: Sequence[int]) -> str:
    names = [plan.matrix.names[a] for a in axes]
    return names[0] if len(names) == 1 else "(" + ", ".join(names) + ")"


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


_SIZES = re.compile(r"size[^()]*\((\d+)\) must match[^()]*\((\d+)\)")
_SHAPES = re.compile(r"\[(\d+(?:, \d+)*)\]")


def note_blocks(error: RuntimeError, plan: ParallelPlan | None, network: nn.Module) -> None:
    """Add `block_note`'s note to torch's `error` raised in a call of `network` run by `plan`,
    when it applies."""
    if plan is None:
        return
    params = [(n, p) for n, p in network.named_parameters() if n in plan.params]
    stored = {n: (plan.params[n].shape, p.shape) for n, p in params}
    blocks = {n: plan.params[n].layout.local_shape(plan.params[n].shape) for n, _ in params}
    frozen = [n for n, p in params if not p.requires_grad]  # (in the network's order)
    note = frozen_note(stored, blocks, frozen, str(error)) or block_note(stored, str(error))
    if note is not None:
        error.add_note(note)


def block_note(shapes: Mapping[str, tuple[Shape, Shape]], message: str) -> str | None:
    """A note for torch's size-mismatch error `message` when its two sizes are a parameter's
    global and stored size of one dim, or it names both shapes (`shapes`: name -> (global,
    stored on this rank)): a copy of the whole parameter, taken before the plan stored it as a
    block or shard, met the block (an EMA of the weights, fp32 master weights). None
    otherwise."""
    found = _SIZES.search(message)
    sizes = {int(found[1]), int(found[2])} if found else set()
    named = {tuple(int(v) for v in m.split(", ")) for m in _SHAPES.findall(message)}
    for name, (shape, local) in shapes.items():
        pair = tuple(shape) in named and tuple(local) in named  # ('[24, 16]' ... '[48, 16]')
        for dim, (whole, block) in enumerate(zip(shape, local, strict=False)):
            if whole != block and (pair or sizes == {whole, block}):
                return (
                    f"shardwise: each rank stores {name} as its block {list(local)} of the "
                    f"global {list(shape)} (dim {dim} split by the plan or optimizer "
                    "parallel). A tensor copied from the whole parameter before the first call "
                    "(an EMA of the weights, fp32 master weights) does not fit it: take such "
                    "copies after the first call, so that each rank keeps and updates its own "
                    "block"
                )
    return None


def frozen_note(
    shapes: Mapping[str, tuple[Shape, Shape]],
    blocks: Mapping[str, Shape],
    frozen: Sequence[str],
    message: str,
) -> str | None:
    """A note for torch's size-mismatch error `message` when its two sizes are one dim of a
    frozen parameter and of a trainable one of the same global shape that this rank stores
    otherwise (`shapes`: name -> (global, stored); `blocks`: name -> its op-level block): a
    frozen copy updated from the trainable one (an EMA teacher inside the network) met its
    hsdp shard (optimizer parallel shards only parameters that require grad) or a block its
    own strategy cut. None otherwise."""
    found = _SIZES.search(message)
    if found is None:
        return None
    sizes = {int(found[1]), int(found[2])}
    for f in frozen:
        shape, kept = shapes[f]
        for name, (other, local) in shapes.items():
            if name in frozen or tuple(other) != tuple(shape):
                continue
            if not any(a != b and sizes == {a, b} for a, b in zip(kept, local, strict=False)):
                continue
            fixes = []
            if tuple(blocks[f]) != tuple(blocks[name]):
                fixes.append(f"give {f}'s module the sharding strategy {name}'s carries")
            if tuple(local) != tuple(blocks[name]) and tuple(kept) == tuple(blocks[f]):
                fixes.append(
                    f"let the frozen copy's parameters ({f} ...) require grad, in no optimizer "
                    f"and run under torch.no_grad() (they get no gradient; hsdp shards them as "
                    f"it shards {name}, and the update runs shard by shard as one device's), "
                    f"or train without hsdp"
                )
            if not fixes:  # (stored alike after all: the mismatch is another one)
                continue
            return (
                f"shardwise: {f} needs no gradient and each rank stores it as {list(kept)} of "
                f"the global {list(shape)}, but {name}, of the same global shape, as "
                f"{list(local)} (optimizer parallel, hsdp, shards only parameters that require "
                f"grad; a sharding strategy splits only its own module's). Updating the frozen "
                f"one from the trainable one (an EMA teacher: tp.mul_(m).add_(sp, alpha=1 - m) "
                f"after opt.step()) meets this rank's part of it. Store them alike: "
                + "; and ".join(fixes)
            )
    return None


def refuse_lazy(modules: Sequence[nn.Module]) -> None:
    """Raise ValueError naming the first parameter or buffer of `modules` that a lazy module
    (``nn.LazyLinear``, ``nn.LazyBatchNorm1d``) has not made yet: its shape, which the plan
    needs, is known only after a forward on one device.

    Example:
        >>> refuse_lazy([net])  # doctest: +SKIP
    """
    for module in modules:
        for name, value in [*module.named_parameters(), *module.named_buffers()]:
            if nn.parameter.is_lazy(value):
                owner = module.get_submodule(name.rpartition(".")[0])
                raise ValueError(
                    f"{name!r} of {type(owner).__name__} is not made yet (a lazy module makes "
                    "its parameters at its first forward, so their shapes, which the parallel "
                    "plan needs, are unknown): run the network once before wrapping it "
                    "(net.eval()(x); net.train(): BatchNorm statistics stay as they were), or "
                    "give the module its sizes (nn.Linear, nn.BatchNorm1d)"
                )


def hidden_inputs_note(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
    """A note for torch's error raised while a call was captured, naming the call's arguments
    that hold tensors in an object that is no tuple, list, dict or dataclass (Hugging Face's
    ``DynamicCache`` as ``past_key_values``): the capture does not take those tensors as
    inputs (no global shape, not cut to this rank's rows). None when there is none."""
    named = [(f"positional argument {i}", a) for i, a in enumerate(args)]
    named += [(f"argument {k!r}", a) for k, a in kwargs.items()]
    hidden = [
        f"{name} (a {type(leaf).__name__})"
        for name, value in named
        for leaf in pytree.tree_leaves(value)
        if not isinstance(leaf, torch.Tensor) and _holds_tensor(leaf, 3)
    ]
    if not hidden:
        return None
    return (
        f"AutoParallel: {', '.join(hidden)} holds tensors inside an object: the plan finds "
        f"inputs in tuples, lists, dicts and dataclasses only, so those tensors are not inputs "
        f"of the call (they keep the shape this rank passed, and a cache returned by an "
        f"earlier call holds only this rank's rows). Pass use_cache=False in training; for "
        f"generation keep the cache in tuples of tensors, or run it on one device or in the "
        f"data-parallel mode with each rank's own rows (docs/parallel.md, caches)"
    )


def _holds_tensor(value: object, depth: int) -> bool:
    """Whether `value`'s attributes, or the lists, tuples and dicts among them, hold a tensor
    within `depth` levels (a cache's ``layers[i].keys``)."""
    if isinstance(value, torch.Tensor):
        return not isinstance(value, nn.Parameter)  # (an optimizer's, a module's: no input)
    skipped = (str, bytes, int, float, bool, type, nn.Module, torch.optim.Optimizer)
    if depth == 0 or isinstance(value, skipped):
        return False
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = list(getattr(value, "__dict__", {}).values())
    return any(_holds_tensor(v, depth - 1) for v in items[:64])
