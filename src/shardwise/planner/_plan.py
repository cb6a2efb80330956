"""`ParallelPlan`: every decision of a parallel job, as plain frozen data.

- `Placed`, `Collective`, `ParamPlan` and `BucketPlan` (from `_placed`): how a value is spread
  over the devices, one collective the plan runs, the layout a parameter is stored in, and a
  fused collective over gradients or weights.
- `NodePlan`: one op's strategy: the placements its inputs must have, those of its outputs,
  its local output shapes and the collectives the op itself runs (a primitive's AllReduce).
- `EdgePlan` (from `_edge_plan`): one input of one op (or a returned value) whose producer
  left it elsewhere: the AllReduce of partial sums, then the redistribution steps (Slice,
  AllGather, AlltoAll), or the two as one ReduceScatter.
- `ParallelPlan`: all of it on one device matrix; `str()` prints it, `diff` compares two,
  `to_dict` / `from_dict` / `save` / `load` keep it as JSON (a loaded plan is equal).

The JSON encoding is `_plan_json`'s (`to_dict` / `from_dict` call its `plan_d` / `plan_of`);
it builds these classes, so it is imported at the end of this module, which re-exports its
`FORMAT`, `matrix_d` / `matrix_of` and `params_d` / `params_of`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import Shard

from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.planner._edge_plan import EdgePlan
from shardwise.planner._frozen import FrozenMap
from shardwise.planner._graph import Ref
from shardwise.planner._placed import (
    BucketPlan,
    Collective,
    ParamPlan,
    Placed,
    Root,
    Shape,
    _axes_str,
    replicated,
)
from shardwise.planner._regions import Region


@dataclass(frozen=True)
class NodePlan:
    """One op's strategy.

    Attributes:
        index / name / op: as in the graph.
        rule: where the strategy came from: ``"user"`` (a ``shard()`` strategy), ``"default"``
            (a primitive's data-parallel default), ``"dtensor"``, ``"shardwise"`` (our aten
            rules), ``"factory"``, ``"replicate"`` (no rule: run whole).
        inputs: the placements its tensor inputs must have.
        outputs: its outputs' placements.
        shapes: its outputs' global shapes.
        comms: the collectives the op runs itself (a primitive's AllReduce / ReduceScatter).
        values: the values its tensor inputs are (``"%3"``, ``"param:fc.weight"``,
            ``"input:args[0]"``).
        local: a primitive's local compute when it is more than the op on its blocks
            (``"masked_lookup"``, ``"random"``: see `shardwise.ops.OpPlan.local`).
        in_shapes: its tensor inputs' global shapes.
        backward: AllReduce(avg)s of its outputs' gradients in backward (Megatron's ``f``,
            `_backward`): the gradient made the same on every rank of those axes.
        dtypes: its outputs' dtypes (``"float32"``; empty in a plan saved without them: read
            as float32).
        draws: for each random in-place fill inside the op, in order, the placement, global
            shape and memory order (dims from the largest stride) of the tensor it fills (each
            rank draws the whole as one device lays it out and keeps its block:
            `_draws.plan_draws`).
        returned: the tensor inputs (by position) the op returned as its output objects when
            captured (``w.float()`` on a float32 ``w``, ``w.flatten(1)`` on a 2-D one,
            dropout in eval): the capture made each output a value of its own
            (`_in_place.apart`), as the executor does for a parameter (`_param_reads.passing`).
    """

    index: int
    name: str
    op: str
    rule: str
    inputs: tuple[Placed, ...]
    outputs: tuple[Placed, ...]
    shapes: tuple[Shape, ...]
    comms: tuple[Collective, ...] = ()
    values: tuple[str, ...] = ()
    local: str = ""
    in_shapes: tuple[Shape, ...] = ()
    backward: tuple[Collective, ...] = ()
    dtypes: tuple[str, ...] = ()
    draws: tuple[tuple[Placed, Shape, tuple[int, ...]], ...] = ()
    returned: tuple[int, ...] = ()

    def dtype(self, output: int) -> str:
        """Output `output`'s dtype."""
        return self.dtypes[output] if output < len(self.dtypes) else "float32"

    @property
    def in_strategy(self) -> tuple[tuple[int, ...], ...]:
        """The strategy in MindSpore's notation: each tensor input's split count per dim
        (``((2, 4), (4, 1))`` for seed 003's first MatMul)."""
        return tuple(
            tuple(p.layout.split_count(d) for d in range(len(s)))
            for p, s in zip(self.inputs, self.in_shapes, strict=False)
        )

    @property
    def out_strategy(self) -> tuple[tuple[int, ...], ...]:
        """Each output's split count per dim, as the op leaves it (MindSpore's notation: a
        MatMul with a ReduceScatter ``out_strategy`` gives ``((4, 1),)``)."""
        return tuple(
            tuple(p.layout.split_count(d) for d in range(len(s)))
            for p, s in zip(self.outputs, self.shapes, strict=True)
        )

    @property
    def local_shapes(self) -> tuple[Shape, ...]:
        """Each output's block shape on a rank."""
        return tuple(p.local_shape(s) for p, s in zip(self.outputs, self.shapes, strict=True))

    def __str__(self) -> str:
        ins = ", ".join(str(p) for p in self.inputs)
        outs = ", ".join(f"{p} {list(s)}" for p, s in zip(self.outputs, self.shapes, strict=True))
        local = f"; local {self.local}" if self.local else ""
        return f"%{self.index} {self.name} [{self.op}; {self.rule}{local}]: {ins} -> {outs}"


_MAPPINGS = ("inputs", "params", "input_shapes", "equal_grads", "set_buffers", "explained")


@dataclass(frozen=True)
class ParallelPlan:
    """Every decision of one parallel network or train step.

    Attributes:
        device_num: the job's size.
        matrix: the one device matrix every layout lives on.
        mode: the parallel mode that made it (``"semi_auto"``).
        inputs: how each tensor input arrives on the ranks.
        nodes: every op's strategy, in execution order.
        edges: every redistribution between a producer and a consumer.
        params: every parameter's storage layout.
        buckets: fused gradient / weight collectives (optimizer parallel).
        input_shapes: each input's global shape.
        outputs: each returned tensor's placement (after its edges).
        equal_grads: parameter -> the axes over which its gradient is the same on every rank
            (no reduction over them: `_backward`).
        roots: the values the train step's backward starts from, with their placements
            (empty when capture saw none): `seed_scales`.
        regions: the activation-checkpointed regions, whose ops backward runs again with
            their moves and collectives (`_regions.Region`).
        frozen: the parameters that need no gradient (``requires_grad`` False when planned, or
            since: `gradient_values`), in parameter order.
        set_buffers: each buffer the call re-assigned to an op's output (``self.rm = 0.9 *
            self.rm + 0.1 * h.mean(0)``) -> that value (``"%7"``); it is stored whole on every
            rank, as buffers are (`parallel._leaving.buffer_edges`).
        explained: op name -> why an automatic planner chose its strategy
            (`_explain.Explanation`); not compared, not saved (a loaded plan has none).

    Frozen all the way: the mappings are read-only (`FrozenMap`); ``dataclasses.replace``
    makes a changed copy.
    """

    device_num: int
    matrix: DeviceMatrix
    mode: str
    inputs: Mapping[str, Placed]
    nodes: tuple[NodePlan, ...]
    edges: tuple[EdgePlan, ...]
    params: Mapping[str, ParamPlan]
    buckets: tuple[BucketPlan, ...] = ()
    input_shapes: Mapping[str, Shape] = field(default_factory=dict)
    outputs: tuple[Placed, ...] = ()
    equal_grads: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    roots: tuple[Root, ...] = ()
    regions: tuple[Region, ...] = ()
    frozen: tuple[str, ...] = ()
    set_buffers: Mapping[str, str] = field(default_factory=dict)
    explained: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in _MAPPINGS:  # (frozen all the way: read-only mappings)
            value = getattr(self, name)
            if not isinstance(value, FrozenMap):
                object.__setattr__(self, name, FrozenMap(value))

    def node(self, name: str) -> NodePlan:
        """The node called `name`.

        Raises:
            KeyError: no such node (the message lists a few names).
        """
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no op {name!r} in the plan; ops: {[n.name for n in self.nodes[:8]]}...")

    def strategies(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Each op's name (its module path and op) -> its in_strategy (`NodePlan.in_strategy`).

        Example:
            >>> plan.strategies()["relu/ReLU"]  # seed 002 by sharding propagation
            ((2, 4),)
        """
        return {n.name: n.in_strategy for n in self.nodes}

    def param_layouts(self) -> dict[str, tuple[TensorLayout, Shape]]:
        """Parameter name -> (storage layout, global shape), the form the runtime takes."""
        return {n: (p.layout, p.shape) for n, p in self.params.items()}

    def edges_by_consumer(self) -> dict[int, list[EdgePlan]]:
        """The edges by the node they feed, in plan order (-1: returned, -2: at entry)."""
        out: dict[int, list[EdgePlan]] = {}
        for e in self.edges:
            out.setdefault(e.consumer, []).append(e)
        return out

    def collectives(self) -> list[Collective]:
        """Every collective of one forward, in order: the ops' own and the edges'."""
        by_consumer = self.edges_by_consumer()
        out: list[Collective] = []
        for n in self.nodes:
            for e in by_consumer.get(n.index, []):
                out += e.collectives(f"{n.name} input {e.slot}")
            out += list(n.comms)
        for e in by_consumer.get(-1, []):
            out += e.collectives(f"return {e.slot}")
        return out

    def __str__(self) -> str:
        lines = [f"ParallelPlan ({self.mode}, {self.device_num} devices) on {self.matrix}"]
        lines += [f"  input {k}: {p}" for k, p in self.inputs.items()]
        by_consumer = self.edges_by_consumer()
        for n in self.nodes:
            lines += [f"    edge {e}" for e in by_consumer.get(n.index, [])]
            lines.append(f"  {n}")
            lines += [f"    comm {c}" for c in n.comms]
            lines += [f"    backward {c} output {c.output}" for c in n.backward]
            lines += [
                f"    draw {p} {list(s)}: this rank's block of one draw" for p, s, _ in n.draws
            ]
        lines += [f"    edge {e}" for e in by_consumer.get(-1, [])]
        for k, p in self.params.items():
            equal = self.equal_grads.get(k, ())
            note = f" (gradient equal on {_axes_str(self.matrix, equal)})" if equal else ""
            note += " (frozen: no gradient)" if k in self.frozen else ""
            lines.append(f"  param {k}: {p}{note}")
        lines += [f"  bucket {b}" for b in self.buckets]
        lines += [f"  backward from {r}" for r in self.roots]
        lines += [f"  {r}" for r in self.regions]
        return "\n".join(lines)

    def gradient_values(self) -> set[str]:
        """The values whose gradient a backward computes: the floating parameters that are not
        `frozen` and every floating output of an op with such an input (the network's inputs
        need none).

        Example:
            >>> "%0" in plan.gradient_values()  # (the first layer's output)
            True
        """
        need = {
            str(Ref("param", n))
            for n, p in self.params.items()
            if _floating(p.dtype) and n not in self.frozen
        }
        for n in self.nodes:
            if any(v in need for v in n.values):
                need.update(
                    str(Ref("node", n.index, i))
                    for i in range(len(n.outputs))
                    if _floating(n.dtype(i))
                )
        return need

    def seed_scales(self) -> tuple[int, ...]:
        """Per backward root, the factor its seed is multiplied by: its `Placed.spread` (a
        split root has fewer copies than a whole loss's N, which the buckets' division by N
        assumes: `parallel/_seeds.py`).

        Example:
            >>> plan.seed_scales()  # logits split over 2 data-parallel ranks
            (2,)
        """
        return tuple(r.placed.spread() for r in self.roots)

    def diff(self, other: ParallelPlan) -> list[str]:
        """What differs between this plan and `other`, one line per difference (empty: equal;
        `_plan_diff.plan_diff`).

        Example:
            >>> plan_a.diff(plan_b)
            ['node %6 transformer.h.0.attn.c_attn/linear: outputs (g0, None, None) -> ...']
        """
        from shardwise.planner._plan_diff import plan_diff  # (it reads this module's types)

        return plan_diff(self, other)

    # -- JSON (`_plan_json`) -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (`from_dict` reads it back into an equal plan)."""
        return plan_d(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParallelPlan:
        """The plan `to_dict` wrote.

        Raises:
            ValueError: not a shardwise plan, or a malformed one.
        """
        return plan_of(data, cls)

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON to `path`."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ParallelPlan:
        """Read a plan `save` wrote."""
        return cls.from_dict(json.loads(Path(path).read_text()))


# `_plan_json` imports the classes above, so its names are bound here, once they exist.
from shardwise.planner._plan_json import (  # noqa: E402
    FORMAT,
    device_num_of,
    matrix_d,
    matrix_of,
    params_d,
    params_of,
    plan_d,
    plan_of,
)

__all__ = [
    "FORMAT",
    "BucketPlan",
    "Collective",
    "EdgePlan",
    "NodePlan",
    "ParallelPlan",
    "ParamPlan",
    "Placed",
    "Root",
    "Shape",
    "Shard",
    "device_num_of",
    "matrix_d",
    "matrix_of",
    "params_d",
    "params_of",
    "replicated",
]


def _floating(dtype: str) -> bool:
    return bool(getattr(torch, dtype).is_floating_point)
