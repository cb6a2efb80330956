"""`plan_diff`: what differs between two `ParallelPlan`s, one line per difference, for
`ParallelPlan.diff` (a loaded strategy file against the plan this job makes, two modes' plans).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from itertools import zip_longest
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardwise.planner._plan import NodePlan, ParallelPlan


def node_field(node: NodePlan, field: str) -> str:
    """Field `field` of `node`, readable (collectives and placements by their ``str``)."""
    value = getattr(node, field)
    if isinstance(value, tuple):
        return "(" + ", ".join(str(v) if not isinstance(v, tuple) else repr(v) for v in value) + ")"
    return repr(value)


def plan_diff(a: ParallelPlan, b: ParallelPlan) -> list[str]:
    """What differs between plans `a` and `b`, one line per difference; empty only when they
    are equal (a field not named below is named by its name)."""
    out = []
    if (a.device_num, a.matrix) != (b.device_num, b.matrix):
        out.append(
            f"matrix: {a.matrix} ({a.device_num}) -> {b.matrix} (placements below name each "
            f"plan's own axes: (g0, g1) of one and g0 of the other may split a dim alike)"
        )
    if a.mode != b.mode:
        out.append(f"mode: {a.mode} -> {b.mode}")
    for n, m in zip(a.nodes, b.nodes, strict=False):
        if n != m and str(n) != str(m):
            out.append(f"node %{n.index} {n.name}: {n} -> {m}")
        elif n != m:  # (what the printed line does not show: its collectives, dtypes ...)
            fields = [
                f.name for f in dataclasses.fields(n) if getattr(n, f.name) != getattr(m, f.name)
            ]
            out += [
                f"node %{n.index} {n.name} {f}: {node_field(n, f)} -> {node_field(m, f)}"
                for f in fields
            ]
    if len(a.nodes) != len(b.nodes):
        out.append(f"ops: {len(a.nodes)} -> {len(b.nodes)}")
    mine, theirs = set(map(str, a.edges)), set(map(str, b.edges))
    out += [f"edge only in first: {e}" for e in sorted(mine - theirs)]
    out += [f"edge only in second: {e}" for e in sorted(theirs - mine)]
    for k in sorted(set(a.params) | set(b.params)):
        if a.params.get(k) != b.params.get(k):
            out.append(f"param {k}: {a.params.get(k)} -> {b.params.get(k)}")
    for i, (p, q) in enumerate(zip_longest(a.buckets, b.buckets)):
        if p != q:
            out.append(f"bucket {i}: {p or '(none)'} -> {q or '(none)'}")
    if a.roots != b.roots:
        roots = [str(r) for r in a.roots], [str(r) for r in b.roots]
        out.append(f"backward roots: {roots[0]} -> {roots[1]}")
    if a.equal_grads != b.equal_grads:
        out.append(f"equal gradients: {dict(a.equal_grads)} -> {dict(b.equal_grads)}")
    if a.frozen != b.frozen:
        out.append(f"frozen parameters: {list(a.frozen)} -> {list(b.frozen)}")
    out += _io_diff(a, b)
    if a.regions != b.regions:
        out.append(f"regions: {_readable(a.regions)} -> {_readable(b.regions)}")
    named = {"device_num", "matrix", "mode", "nodes", "params", "buckets", "roots", "regions"}
    named |= {"equal_grads", "frozen", "inputs", "input_shapes", "outputs"}
    named |= {"edges"} if mine != theirs else set()
    for f in dataclasses.fields(a):
        if f.compare and f.name not in named and getattr(a, f.name) != getattr(b, f.name):
            out.append(
                f"{f.name}: {_readable(getattr(a, f.name))} -> {_readable(getattr(b, f.name))}"
            )
    return out


def _io_diff(a: ParallelPlan, b: ParallelPlan) -> list[str]:
    """The inputs' placements and global shapes and the outputs' placements that differ, in
    the plan's notation (``(g0, None) -> ((g0, g1), None)``)."""
    out = []
    for k in sorted(set(a.inputs) | set(b.inputs)):
        if a.inputs.get(k) != b.inputs.get(k):
            out.append(f"input {k}: {a.inputs.get(k, '(none)')} -> {b.inputs.get(k, '(none)')}")
    for k in sorted(set(a.input_shapes) | set(b.input_shapes)):
        was, now = a.input_shapes.get(k), b.input_shapes.get(k)
        if was != now:
            out.append(f"input {k} shape: {_shape(was)} -> {_shape(now)}")
    if a.outputs != b.outputs:
        out.append(f"outputs: {_readable(a.outputs)} -> {_readable(b.outputs)}")
    return out


def _shape(shape: tuple[int, ...] | None) -> str:
    return "(none)" if shape is None else str(list(shape))


def _readable(value: object) -> str:
    """A plan field by its parts' ``str`` (a tuple's joined by ``, ``; empty: ``(none)``)."""
    if isinstance(value, tuple):
        return ", ".join(str(v) for v in value) or "(none)"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_readable(v)}" for k, v in value.items()) + "}"
    return str(value)
