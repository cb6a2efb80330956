"""`ParallelPlan` as JSON: every part of a plan as plain data and back, on the plan's matrix.

- `plan_d` / `plan_of`: a whole plan (what `ParallelPlan.to_dict` / `from_dict` return; the
  data carries `FORMAT`, and `plan_of` refuses any other).
- `matrix_d` / `matrix_of`: the device matrix; `params_d` / `params_of`: the parameters'
  storage layouts (also the parameter strategy file's content, `_files`).
- `_placed_d` / `_placed`, `_comm_d` / `_comm`, `_node_d` / `_node`, `_step_d` / `_step`,
  `_edge_d` / `_edge`: one `Placed`, `Collective`, `NodePlan`, redistribution step and
  `EdgePlan`; a layout is stored as its dims (the axes splitting each; a strided one also
  its ``groups``), read back on the plan's matrix. The backward's parts (`equal_grad`,
  `seeded`, `NodePlan.backward`, `ParallelPlan.equal_grads`, `ParallelPlan.roots`,
  `ParallelPlan.frozen`), the re-assigned buffers (`ParallelPlan.set_buffers`) a node's
  random draws (`NodePlan.draws`) and the inputs it returned (`NodePlan.returned`) are written
  only when present (a plan without them reads
  back with none).

Each ``*_d`` writes JSON-ready data, and its ``*_of`` (or unsuffixed) partner reads it back
into an equal value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.planner._plan import (
    BucketPlan,
    Collective,
    EdgePlan,
    NodePlan,
    ParallelPlan,
    ParamPlan,
    Placed,
    Root,
)
from shardwise.planner._regions import Region
from shardwise.redistribution import AllGather, AlltoAll, Slice, Step

FORMAT = "shardwise.ParallelPlan/1"


def plan_d(plan: ParallelPlan) -> dict[str, Any]:
    """`plan` as JSON-ready data (`plan_of` reads it back into an equal plan)."""
    out = {
        "format": FORMAT,
        "device_num": plan.device_num,
        "matrix": matrix_d(plan.matrix),
        "mode": plan.mode,
        "inputs": {k: _placed_d(p) for k, p in plan.inputs.items()},
        "input_shapes": {k: list(s) for k, s in plan.input_shapes.items()},
        "outputs": [_placed_d(p) for p in plan.outputs],
        "nodes": [_node_d(n) for n in plan.nodes],
        "edges": [_edge_d(e) for e in plan.edges],
        "params": params_d(plan.params),
        "buckets": [
            {
                "kind": b.kind,
                "axes": list(b.axes),
                "params": list(b.params),
                "shard": b.shard,
                "fusion": b.fusion,
            }
            | ({"level": b.level} if b.level else {})
            for b in plan.buckets
        ],
    }
    if plan.equal_grads:
        out["equal_grads"] = {k: list(v) for k, v in plan.equal_grads.items()}
    if plan.roots:
        out["roots"] = [{"value": r.value, "placed": _placed_d(r.placed)} for r in plan.roots]
    if plan.regions:
        out["regions"] = [dataclasses.asdict(r) for r in plan.regions]
    if plan.frozen:
        out["frozen"] = list(plan.frozen)
    if plan.set_buffers:
        out["set_buffers"] = dict(plan.set_buffers)
    return out


def plan_of(data: Mapping[str, Any], cls: type[ParallelPlan] = ParallelPlan) -> ParallelPlan:
    """The plan `plan_d` wrote (made by `cls`).

    Raises:
        ValueError: not a shardwise plan, or a malformed one.
    """
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, Mapping) else type(data).__name__
        raise ValueError(f"not a shardwise plan (format {got!r}, want {FORMAT})")
    try:
        return _plan_of(data, cls)
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        what = f"no field {e.args[0]!r}" if isinstance(e, KeyError) else f"{e}"
        raise ValueError(
            f"a malformed shardwise plan ({what}): save the plan again with "
            "ParallelPlan.save / to_dict rather than editing it"
        ) from e


def _plan_of(data: Mapping[str, Any], cls: type[ParallelPlan]) -> ParallelPlan:
    m = matrix_of(data["matrix"])
    return cls(
        device_num=device_num_of(data),
        matrix=m,
        mode=str(data["mode"]),
        inputs={k: _placed(m, v) for k, v in data["inputs"].items()},
        nodes=tuple(_node(m, n) for n in data["nodes"]),
        edges=tuple(_edge(m, e) for e in data["edges"]),
        params=params_of(m, data["params"]),
        buckets=tuple(
            BucketPlan(
                b["kind"],
                tuple(b["axes"]),
                tuple(b["params"]),
                int(b.get("shard", 1)),
                int(b.get("fusion", -1)),
                str(b.get("level", "")),
            )
            for b in data["buckets"]
        ),
        input_shapes={k: tuple(v) for k, v in data.get("input_shapes", {}).items()},
        outputs=tuple(_placed(m, p) for p in data.get("outputs", [])),
        equal_grads={k: tuple(v) for k, v in data.get("equal_grads", {}).items()},
        roots=tuple(Root(r["value"], _placed(m, r["placed"])) for r in data.get("roots", [])),
        regions=tuple(_region(r, len(data["nodes"])) for r in data.get("regions", [])),
        frozen=_frozen(data.get("frozen", []), data["params"]),
        set_buffers={str(k): str(v) for k, v in data.get("set_buffers", {}).items()},
    )


def _frozen(names: Sequence[Any], params: Mapping[str, Any]) -> tuple[str, ...]:
    if isinstance(names, str) or any(not isinstance(n, str) or n not in params for n in names):
        raise TypeError(f"frozen {names!r}: not a list of the plan's parameters")
    return tuple(names)


def _region(r: Mapping[str, Any], nodes: int) -> Region:
    first, last, until = int(r["first"]), int(r["last"]), int(r["until"])
    full, reentrant = r["full"], r["reentrant"]
    if not (0 <= first <= last < nodes and -1 <= until <= last) or not isinstance(full, bool):
        raise TypeError(f"region {dict(r)}: not a region of the plan's nodes")
    if not isinstance(reentrant, bool):
        raise TypeError(f"region {dict(r)}: reentrant is not a bool")
    return Region(first, last, until, full, reentrant)


def matrix_d(m: DeviceMatrix) -> dict[str, list[Any]]:
    """A device matrix as JSON-ready data (`matrix_of` reads it back)."""
    return {"shape": list(m.shape), "names": list(m.names), "rank_list": list(m.rank_list)}


def matrix_of(d: Mapping[str, Any]) -> DeviceMatrix:
    """The device matrix `matrix_d` wrote."""
    return DeviceMatrix(tuple(d["shape"]), tuple(d["names"]), tuple(d["rank_list"]))


def params_d(params: Mapping[str, ParamPlan]) -> dict[str, dict[str, Any]]:
    """Parameter layouts as JSON-ready data (`params_of` reads them back)."""
    return {
        k: {"dims": _dims_d(p.layout), "shape": list(p.shape), "dtype": p.dtype}
        | _groups_d(p.layout)
        for k, p in params.items()
    }


def params_of(m: DeviceMatrix, d: Mapping[str, Any]) -> dict[str, ParamPlan]:
    """The parameter layouts `params_d` wrote, on matrix `m`.

    Raises:
        ValueError: a parameter whose layout has another number of dims than its shape, or a
            dtype torch does not have (the entry named).
    """
    out = {}
    for k, v in d.items():
        layout = _layout(m, v["dims"], v.get("groups", ()), f"parameter {k!r}: ")
        shape = tuple(int(s) for s in v["shape"])
        if len(layout.dims) != len(shape):
            raise ValueError(
                f"parameter {k!r}: layout {layout} has {len(layout.dims)} dims, its shape "
                f"{list(shape)} {len(shape)}"
            )
        if not isinstance(getattr(torch, str(v["dtype"]), None), torch.dtype):
            raise ValueError(f"parameter {k!r}: dtype {v['dtype']!r} is not a torch dtype")
        out[k] = ParamPlan(layout, shape, v["dtype"])
    return out


def device_num_of(data: Mapping[str, Any]) -> int:
    """The file's ``device_num``: a positive int (ValueError otherwise)."""
    n = data["device_num"]
    if type(n) is not int or n < 1:
        raise ValueError(f"device_num {n!r} is not a positive int")
    return n


def _dims_d(layout: TensorLayout) -> list[list[int]]:
    return [list(a) for a in layout.dims]


def _groups_d(layout: TensorLayout) -> dict[str, list[int]]:
    return {"groups": list(layout.groups)} if layout.groups else {}


def _layout(
    m: DeviceMatrix, dims: Sequence[Sequence[int]], groups: Sequence[int] = (), where: str = ""
) -> TensorLayout:
    """The layout a file's ``dims`` / ``groups`` give (ints only: ``2.5`` is refused, not cut);
    `where` prefixes the error."""
    if not _ints(dims, nested=True):
        raise ValueError(
            f"{where}dims {dims!r}: give one list of axis indices per tensor dim ([] when not "
            f"split)"
        )
    if not _ints(groups or [], nested=False):
        raise ValueError(f"{where}groups {groups!r}: give one int >= 1 per tensor dim")
    return TensorLayout(m, tuple(tuple(d) for d in dims), tuple(groups or ()))


def _ints(value: object, nested: bool) -> bool:
    """Whether `value` is a list of ints (`nested`: a list of lists of ints); bools are not."""
    if not isinstance(value, list | tuple):
        return False
    if nested:
        return all(_ints(v, nested=False) for v in value)
    return all(type(v) is int for v in value)


def _placed_d(p: Placed) -> dict[str, Any]:
    out: dict[str, Any] = {"dims": _dims_d(p.layout)} | _groups_d(p.layout)
    if p.partial:
        out |= {"partial": list(p.partial), "reduce": p.reduce}
    return out


def _placed(m: DeviceMatrix, d: Mapping[str, Any]) -> Placed:
    layout = _layout(m, d["dims"], d.get("groups", ()))
    return Placed(layout, tuple(d.get("partial", ())), d.get("reduce", "sum"))


def _comm_d(c: Collective) -> dict[str, Any]:
    out = {"kind": c.kind, "axes": list(c.axes), "where": c.where, "detail": c.detail}
    return (
        out
        | ({"output": c.output} if c.output else {})
        | ({"dim": c.dim} if c.dim is not None else {})
        | ({"equal_grad": list(c.equal_grad)} if c.equal_grad else {})
        | ({"block": c.block} if c.block else {})
    )


def _comm(c: Mapping[str, Any]) -> Collective:
    dim = c.get("dim")
    return Collective(
        c["kind"],
        tuple(c["axes"]),
        c["where"],
        c["detail"],
        int(c.get("output", 0)),
        None if dim is None else int(dim),
        tuple(c.get("equal_grad", ())),
        int(c.get("block", 0)),
    )


def _node_d(n: NodePlan) -> dict[str, Any]:
    out: dict[str, Any] = {
        "index": n.index,
        "name": n.name,
        "op": n.op,
        "rule": n.rule,
        "inputs": [_placed_d(p) for p in n.inputs],
        "outputs": [_placed_d(p) for p in n.outputs],
        "shapes": [list(s) for s in n.shapes],
        "comms": [_comm_d(c) for c in n.comms],
        "values": list(n.values),
        "local": n.local,
        "in_shapes": [list(s) for s in n.in_shapes],
        "dtypes": list(n.dtypes),
    }
    if n.backward:
        out["backward"] = [_comm_d(c) for c in n.backward]
    if n.draws:
        out["draws"] = [
            {"placed": _placed_d(p), "shape": list(s), "order": list(o)} for p, s, o in n.draws
        ]
    if n.returned:
        out["returned"] = list(n.returned)
    return out


def _node(m: DeviceMatrix, d: Mapping[str, Any]) -> NodePlan:
    return NodePlan(
        index=int(d["index"]),
        name=d["name"],
        op=d["op"],
        rule=d["rule"],
        inputs=tuple(_placed(m, p) for p in d["inputs"]),
        outputs=tuple(_placed(m, p) for p in d["outputs"]),
        shapes=tuple(tuple(s) for s in d["shapes"]),
        comms=tuple(_comm(c) for c in d["comms"]),
        values=tuple(d.get("values", ())),
        local=d.get("local", ""),
        in_shapes=tuple(tuple(s) for s in d.get("in_shapes", ())),
        backward=tuple(_comm(c) for c in d.get("backward", ())),
        dtypes=tuple(d.get("dtypes", ())),
        draws=tuple(
            (_placed(m, x["placed"]), tuple(x["shape"]), tuple(x["order"]))
            for x in d.get("draws", ())
        ),
        returned=tuple(int(i) for i in d.get("returned", ())),
    )


def _step_d(s: Step) -> dict[str, Any]:
    if isinstance(s, AlltoAll):
        out = {"kind": "AlltoAll", "axis": s.axis, "src_dim": s.src_dim, "dst_dim": s.dst_dim}
        if (s.src_groups, s.dst_groups) != (1, 1):
            out |= {"src_groups": s.src_groups, "dst_groups": s.dst_groups}
        return out
    return {"kind": type(s).__name__, "dim": s.dim, "axis": s.axis} | (
        {"groups": s.groups} if s.groups > 1 else {}
    )


def _step(d: Mapping[str, Any]) -> Step:
    if d["kind"] == "AlltoAll":
        return AlltoAll(
            int(d["axis"]),
            int(d["src_dim"]),
            int(d["dst_dim"]),
            int(d.get("src_groups", 1)),
            int(d.get("dst_groups", 1)),
        )
    if d["kind"] == "Slice":
        return Slice(int(d["dim"]), int(d["axis"]), int(d.get("groups", 1)))
    return AllGather(int(d["dim"]), int(d["axis"]), int(d.get("groups", 1)))


def _edge_d(e: EdgePlan) -> dict[str, Any]:
    return (
        {
            "consumer": e.consumer,
            "slot": e.slot,
            "value": e.value,
            "shape": list(e.shape),
            "src": _placed_d(e.src),
            "dst": _placed_d(e.dst),
            "steps": [_step_d(s) for s in e.steps],
            "shared": e.shared,
            "dtype": e.dtype,
        }
        | ({"equal_grad": list(e.equal_grad)} if e.equal_grad else {})
        | ({"seeded": True} if e.seeded else {})
        | ({"deferred": True} if e.deferred else {})
        | ({"written_back": True} if e.written_back else {})
        | ({"weighted": True} if e.weighted else {})
        | ({"scatter": True} if e.scatter else {})
    )


def _edge(m: DeviceMatrix, d: Mapping[str, Any]) -> EdgePlan:
    return EdgePlan(
        consumer=int(d["consumer"]),
        slot=int(d["slot"]),
        value=d["value"],
        shape=tuple(d["shape"]),
        src=_placed(m, d["src"]),
        dst=_placed(m, d["dst"]),
        steps=tuple(_step(s) for s in d["steps"]),
        shared=bool(d.get("shared", False)),
        dtype=d.get("dtype", "float32"),
        equal_grad=tuple(int(a) for a in d.get("equal_grad", ())),
        seeded=bool(d.get("seeded", False)),
        deferred=bool(d.get("deferred", False)),
        written_back=bool(d.get("written_back", False)),
        weighted=bool(d.get("weighted", False)),
        scatter=bool(d.get("scatter", False)),
    )


__all__ = [
    "FORMAT",
    "matrix_d",
    "matrix_of",
    "params_d",
    "params_of",
    "plan_d",
    "plan_of",
]
