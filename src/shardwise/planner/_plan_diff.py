"""`plan_diff`: what differs between two `ParallelPlan`s, one line per difference, for
`ParallelPlan.diff` (a loaded strategy file against the plan this job makes, two modes' plans).
"""

from __future__ import annotations

import dataclasses
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
        out.append(f"matrix: {a.matrix} ({a.device_num}) -> {b.matrix}")
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
    named = {"device_num", "matrix", "mode", "nodes", "params", "buckets", "roots"}
    named |= {"equal_grads", "frozen"} | ({"edges"} if mine != theirs else set())
    for f in dataclasses.fields(a):
        if f.compare and f.name not in named and getattr(a, f.name) != getattr(b, f.name):
            out.append(f"{f.name}: {getattr(a, f.name)} -> {getattr(b, f.name)}")
    return out
