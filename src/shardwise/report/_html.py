"""``plan.html``: a `planner.ParallelPlan` as one self-contained web page (inline CSS, SVG and a
little script; no external file, no server, no network).

- `format_plan_html` builds the page from its sections, `write_plan_html` writes it:
- `_matrix_section`: the device matrix: its named axes (size, stride) and every rank at its
  coordinate (the last axis across; not drawn past `MAX_DRAWN_RANKS` devices).
- `_memory_section`: per-rank memory as stacked bars (SVG), with the numbers in a table.
- `_comm_section`: one forward's collectives by kind and axes, with the bytes a rank sends.
- `_ops_section` / `_op`: every op as a collapsible block with a stable id (``op-<index>``):
  its strategy, the layouts of its inputs and outputs, the collectives into it and its own
  (group, bytes), and the slice table: which block of each tensor every shown rank holds (as
  seed 003's table; past `_plan_data.ALL_RANKS_UP_TO` devices, the first ranks and the chosen
  one, and the page says so). A filter box and a "with collectives" switch find ops in large
  plans.
- `_params_section`: every parameter's stored layout and block.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from html import escape
from pathlib import Path

from shardwise._atomic import write_text_atomically
from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.planner import EdgePlan, NodePlan, ParallelPlan, Placed
from shardwise.report._plan_data import (
    ENTRY,
    FIRST_RANKS,
    RETURN,
    Memory,
    Sent,
    chosen_rank,
    comm_totals,
    edges_by_consumer,
    fmt_bytes,
    matrix_rows,
    memory_groups,
    memory_kinds,
    plan_memory,
    plan_sends,
    shown_ranks,
)
from shardwise.report._sends import fmt_slice

MAX_DRAWN_RANKS = 4096
OPEN_UP_TO = 12  # ops: a plan this small opens every op's block
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f")

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;background:#fff}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;margin:.4em 0}td,th{border:1px solid #ddd;padding:2px 6px;
text-align:left;vertical-align:top}th{background:#f4f4f4}code,.mono{font-family:monospace}
.grid td{text-align:center;font:11px monospace;min-width:2.2em;color:#111}
.grid td.me{outline:2px solid #d00;font-weight:bold}
.slices tr.me td{background:#fdd;font-weight:bold}
details.op{border:1px solid #ddd;margin:2px 0;padding:2px 6px}details.op[open]{background:#fafafa}
summary{cursor:pointer}.name{font-weight:bold;font-family:monospace}.tag{font-size:.85em;
padding:0 4px;border-radius:3px;background:#e8e8e8}.bytes{color:#a33}.note{color:#666}
#filter{width:24em}.legend span{display:inline-block;width:1em;height:1em;margin:0 4px 0 12px;
vertical-align:middle}
"""

_SCRIPT = """
(function(){
  var box=document.getElementById('filter'),only=document.getElementById('only-comm'),
      count=document.getElementById('shown'),ops=document.querySelectorAll('details.op');
  function apply(){
    var q=box.value.toLowerCase(),n=0;
    ops.forEach(function(d){
      var ok=d.dataset.name.indexOf(q)>=0&&(!only.checked||d.dataset.comm==='1');
      d.style.display=ok?'':'none';if(ok){n++;}
    });
    count.textContent=n;
  }
  box.addEventListener('input',apply);only.addEventListener('change',apply);
  document.getElementById('open-all').onclick=function(){
    ops.forEach(function(d){if(d.style.display!=='none'){d.open=true;}});};
  document.getElementById('close-all').onclick=function(){
    ops.forEach(function(d){d.open=false;});};
  if(location.hash){var t=document.getElementById(location.hash.slice(1));if(t){t.open=true;}}
  document.body.dataset.ops=String(ops.length);
})();
"""


def _coord(matrix: DeviceMatrix, rank: int) -> str:
    c = matrix.coord(rank)
    return ", ".join(f"{n}={v}" for n, v in zip(matrix.names, c, strict=True))


def _matrix_section(matrix: DeviceMatrix, rank: int) -> str:
    rows = ["<section id='device-matrix'><h2>Device matrix</h2>"]
    rows.append(f"<p><code>{escape(str(matrix))}</code>: {matrix.size} devices, ranks row-major")
    rows.append(" (the first axis slowest, the last fastest).</p>")
    rows.append("<table class='axes'><tr><th>axis</th><th>size</th><th>stride (ranks)</th></tr>")
    for a, (name, size) in enumerate(zip(matrix.names, matrix.shape, strict=True)):
        stride = math.prod(matrix.shape[a + 1 :])
        rows.append(f"<tr><td class='axis'>{escape(name)}</td><td>{size}</td><td>{stride}</td>")
    rows.append("</table>")
    if matrix.size > MAX_DRAWN_RANKS:
        rows.append(f"<p class='note'>Ranks not drawn past {MAX_DRAWN_RANKS} devices.</p>")
        return "".join(rows) + "</section>"
    last = escape(matrix.names[-1])
    rows.append(f"<table class='grid'><caption>{last} across; colour: {escape(matrix.names[0])}")
    rows.append("</caption>")
    for label, ranks in matrix_rows(matrix):
        rows.append(f"<tr><th>{escape(label)}</th>")
        for r in ranks:
            hue = 360 * matrix.coord(r)[0] // matrix.shape[0]
            me = " class='me'" if r == rank else ""
            rows.append(
                f"<td{me} style='background:hsl({hue},60%,85%)' "
                f"title='rank {r}: {escape(_coord(matrix, r))}'>{r}</td>"
            )
        rows.append("</tr>")
    return "".join(rows) + "</table></section>"


def _memory_section(memory: Memory) -> str:
    kinds = memory_kinds(memory)
    bars, left_out = memory_groups(memory, kinds)
    out = ["<section id='memory'><h2>Memory per rank</h2>"]
    if not bars:
        return out[0] + "<p>No memory breakdown.</p></section>"
    top = max(max(b.total for b in bars), 1)
    width, height, step = 60 + 44 * len(bars), 240, 44
    out.append(f"<svg class='memory' width='{width}' height='{height + 60}' role='img'>")
    out.append(f"<text x='0' y='12' font-size='11'>{escape(fmt_bytes(top))}</text>")
    out.append(f"<line x1='56' y1='10' x2='56' y2='{height + 10}' stroke='#999'/>")
    for i, bar in enumerate(bars):
        x, y = 64 + i * step, float(height + 10)
        for k, (kind, part) in enumerate(zip(kinds, bar.parts, strict=True)):
            h = part / top * height
            y -= h
            colour = PALETTE[k % len(PALETTE)]
            out.append(
                f"<rect class='mem' data-kind='{escape(kind)}' data-bytes='{part}' x='{x}' "
                f"y='{y:.1f}' width='32' height='{h:.1f}' fill='{colour}'><title>ranks "
                f"{bar.label}: {escape(kind)} {part} bytes ({fmt_bytes(part)})</title></rect>"
            )
        out.append(
            f"<text x='{x + 16}' y='{height + 24}' font-size='10' text-anchor='end' "
            f"transform='rotate(-45 {x + 16} {height + 24})'>{bar.label}</text>"
        )
    out.append("</svg><div class='legend'>")
    for k, kind in enumerate(kinds):
        out.append(f"<span style='background:{PALETTE[k % len(PALETTE)]}'></span>{escape(kind)}")
    out.append("</div><table><tr><th>ranks</th>")
    out += [f"<th>{escape(k)}</th>" for k in kinds]
    out.append("<th>total</th></tr>")
    for bar in bars:
        cells = "".join(f"<td title='{p} bytes'>{fmt_bytes(p)}</td>" for p in bar.parts)
        out.append(f"<tr><td>{bar.label}</td>{cells}<td>{fmt_bytes(bar.total)}</td></tr>")
    out.append("</table>")
    if left_out:
        out.append(f"<p class='note'>{left_out} more groups of ranks with smaller totals are ")
        out.append("not drawn.</p>")
    return "".join(out) + "</section>"


def _comm_section(sends: dict[int, list[Sent]], rank: int) -> str:
    totals = comm_totals(sends)
    out = ["<section id='collectives'><h2>Collectives of one forward</h2>"]
    if not totals:
        return out[0] + "<p>No collective: every op runs on its own blocks.</p></section>"
    whole = sum(t.send_bytes for t in totals)
    out.append(f"<p>Rank {rank} sends {whole} bytes ({fmt_bytes(whole)}) in one forward.</p>")
    out.append("<table><tr><th>collective</th><th>count</th><th>bytes rank sends</th></tr>")
    for t in totals:
        out.append(
            f"<tr class='comm-total'><td>{escape(t.label)}</td><td>{t.count}</td>"
            f"<td title='{fmt_bytes(t.send_bytes)}'>{t.send_bytes}</td></tr>"
        )
    return "".join(out) + "</table></section>"


def _value(value: str) -> str:
    if value.startswith("%") and value[1:].isdigit():
        return f"<a href='#op-{value[1:]}'>{escape(value)}</a>"
    return escape(value)


def _slice(layout: TensorLayout, rank: int, shape: Sequence[int]) -> str:
    return fmt_slice(layout, rank, shape)  # (a strided dim: its range in every group)


def _group(ranks: Sequence[int]) -> str:
    """A collective's group: every rank up to 8; past that its first ranks and its size."""
    if len(ranks) <= 8:
        return str(list(ranks))
    steps = {b - a for a, b in itertools.pairwise(ranks)}
    shown = ranks[:2] if len(steps) == 1 else ranks[:8]
    return f"[{', '.join(map(str, shown))}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


def _sends_table(sends: Sequence[Sent]) -> str:
    out = ["<table class='sends'><tr><th>where</th><th>step</th><th>group</th><th>bytes</th></tr>"]
    for s in sends:
        group = _group(s.group) if s.group else ""
        out.append(
            f"<tr class='send'><td>{escape(s.where)}</td><td class='mono'>{escape(s.what)}</td>"
            f"<td>{group}</td><td>{s.send_bytes}</td></tr>"
        )
    return "".join(out) + "</table>"


def _slice_table(n: NodePlan, matrix: DeviceMatrix, ranks: Sequence[int], rank: int) -> str:
    ins = list(zip(n.inputs, n.in_shapes, strict=False))
    outs = list(zip(n.outputs, n.shapes, strict=True))
    head = [
        f"<th>in {k} {_value(n.values[k]) if k < len(n.values) else ''}</th>"
        for k in range(len(ins))
    ]
    head += [f"<th>out {k}</th>" for k in range(len(outs))]
    names = escape(", ".join(matrix.names))
    out = [f"<table class='slices'><tr><th>rank</th><th>({names})</th>{''.join(head)}</tr>"]
    for r in ranks:
        coord = ", ".join(map(str, matrix.coord(r)))
        cells = "".join(f"<td>{_slice(p.layout, r, s)}</td>" for p, s in [*ins, *outs])
        me = " class='me'" if r == rank else ""
        out.append(f"<tr{me}><td>{r}</td><td>({coord})</td>{cells}</tr>")
    return "".join(out) + "</table>"


def _layouts_table(n: NodePlan) -> str:
    out = ["<table class='layouts'><tr><th></th><th>value</th><th>global shape</th>"]
    out.append("<th>layout</th><th>local shape</th></tr>")
    rows = [
        (f"in {k}", _value(n.values[k]) if k < len(n.values) else "", p, s)
        for k, (p, s) in enumerate(zip(n.inputs, n.in_shapes, strict=False))
    ]
    rows += [
        (f"out {k}", "", p, s) for k, (p, s) in enumerate(zip(n.outputs, n.shapes, strict=True))
    ]
    for label, value, p, s in rows:
        out.append(
            f"<tr><td>{label}</td><td>{value}</td><td>{list(s)}</td>"
            f"<td class='mono'>{escape(str(p))}</td><td>{list(p.local_shape(s))}</td></tr>"
        )
    return "".join(out) + "</table>"


def _op(
    plan: ParallelPlan,
    n: NodePlan,
    sends: Sequence[Sent],
    ranks: Sequence[int],
    rank: int,
    edges: Sequence[EdgePlan],
    opened: bool,
) -> str:
    sent = sum(s.send_bytes for s in sends)
    comm = any(s.kind != "StridedSlice" for s in sends)
    kinds = ", ".join(dict.fromkeys(s.kind for s in sends if s.kind != "StridedSlice"))
    strategy = escape(str(n.in_strategy)) if n.in_shapes else ""
    out = [
        f"<details class='op' id='op-{n.index}' data-name='{escape(n.name.lower())} "
        f"{escape(n.op.lower())}' data-comm='{int(comm)}'{' open' if opened else ''}>"
        f"<summary>%{n.index} "
        f"<span class='name'>{escape(n.name)}</span> <span class='tag'>{escape(n.rule)}</span> "
        f"<code>{strategy}</code>"
    ]
    if comm:
        out.append(f" <span class='bytes'>{escape(kinds)}: {fmt_bytes(sent)}</span>")
    out.append(f"</summary><p>op <code>{escape(n.op)}</code>; strategy from {escape(n.rule)}")
    if n.in_shapes:
        out.append(f"; in_strategy <code>{strategy}</code>")
    if n.local:
        out.append(f"; local compute {escape(n.local)}")
    out.append("</p>" + _layouts_table(n))
    if edges:
        items = "".join(f"<li><code>input {e.slot}: {escape(str(e))}</code></li>" for e in edges)
        out.append(f"<p>Edges into it (producer's layout -> this op's):</p><ul>{items}</ul>")
    if sends:
        out.append(f"<p>Collectives and local slices on rank {rank}:</p>{_sends_table(sends)}")
    for c in n.backward:
        out.append(f"<p class='note'>backward {escape(str(c))} (output {c.output})</p>")
    out.append(f"<p>Blocks each rank holds:</p>{_slice_table(n, plan.matrix, ranks, rank)}")
    why = plan.explained.get(n.name)
    if why is not None:
        out.append(f"<pre class='why'>{escape(str(why))}</pre>")
    return "".join(out) + "</details>"


def _ops_section(plan: ParallelPlan, sends: dict[int, list[Sent]], rank: int) -> str:
    ranks = shown_ranks(plan.matrix, rank)
    total = len(plan.nodes)
    out = [
        f"<section id='ops'><h2>Ops ({total})</h2><p><input id='filter' type='search' "
        "placeholder='filter by name or op'> <label><input id='only-comm' type='checkbox'> "
        "with collectives</label> <button id='open-all'>open all</button> "
        f"<button id='close-all'>close all</button> <span id='shown'>{total}</span> shown</p>"
    ]
    if len(ranks) < plan.matrix.size:
        out.append(
            f"<p class='note'>Slice tables list ranks {', '.join(map(str, ranks))} of "
            f"{plan.matrix.size} (the first {FIRST_RANKS} and the chosen rank, {rank}); every "
            "rank's blocks: <code>save_graphs=3</code>'s "
            "<code>step_parallel_begin.ir</code>.</p>"
        )
    edges = edges_by_consumer(plan)
    for where, label in ((ENTRY, "inputs"), (RETURN, "returned values")):
        if sends.get(where):
            text = "; ".join(str(e) for e in edges.get(where, []))
            out.append(f"<p>Edges of the {label}: <code>{escape(text)}</code></p>")
            out.append(_sends_table(sends[where]))
    opened = total <= OPEN_UP_TO
    out += [
        _op(plan, n, sends.get(n.index, []), ranks, rank, edges.get(n.index, []), opened)
        for n in plan.nodes
    ]
    return "".join(out) + "</section>"


def _params_section(plan: ParallelPlan) -> str:
    out = ["<section id='params'><h2>Parameters</h2><table><tr><th>name</th><th>dtype</th>"]
    out.append("<th>global shape</th><th>stored layout</th><th>block</th></tr>")
    for name, p in plan.params.items():
        dims = escape(str(Placed(p.layout)))
        out.append(
            f"<tr><td class='mono'>{escape(name)}</td><td>{escape(p.dtype)}</td>"
            f"<td>{list(p.shape)}</td><td class='mono'>{dims}</td>"
            f"<td>{list(p.layout.local_shape(p.shape))}</td></tr>"
        )
    return "".join(out) + "</table></section>"


def format_plan_html(
    plan: ParallelPlan, memory: Memory | None = None, rank: int | None = None
) -> str:
    """The text of ``plan.html`` (see `write_plan_html`).

    Raises:
        ValueError: `rank` is not a rank of the plan's matrix.
    """
    m = plan.matrix
    rank = chosen_rank(m, rank)
    memory = plan_memory(plan) if memory is None else memory
    sends = plan_sends(plan, rank)
    title = f"ParallelPlan ({plan.mode}, {plan.device_num} devices, {len(plan.nodes)} ops)"
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1><p>Rank {rank} is the chosen rank (its groups and bytes ",
        "below; marked in red). Sections: <a href='#device-matrix'>device matrix</a>, ",
        "<a href='#memory'>memory</a>, <a href='#collectives'>collectives</a>, ",
        "<a href='#ops'>ops</a>, <a href='#params'>parameters</a>.</p>",
        _matrix_section(m, rank),
        _memory_section(memory),
        _comm_section(sends, rank),
        _ops_section(plan, sends, rank),
        _params_section(plan),
        f"<script>{_SCRIPT}</script></body></html>\n",
    ]
    return "".join(parts)


def write_plan_html(
    plan: ParallelPlan,
    path: str | os.PathLike[str],
    memory: Memory | None = None,
    rank: int | None = None,
) -> Path:
    """Write `plan` as one self-contained web page (no external file, no server, no network):
    the device matrix with its named axes; per-rank memory as stacked bars; one forward's
    collectives with the bytes a rank sends; every op (element id ``op-<index>``, collapsible,
    with a filter box) with its strategy, layouts, collectives and the table of which block of
    each tensor every rank holds (past 16 devices: the first 8 ranks and `rank`); every
    parameter's stored layout.

    Args:
        plan: the plan (`AutoParallel.parallel_plan`, `planner.plan_semi_auto`, ...).
        path: the file to write (folders created; written atomically).
        memory: rank -> {kind: bytes}, stacked in the order given (any kinds: "parameters",
            "gradients", "optimizer state", "activations", "communication buffers", ...);
            None: `plan_memory(plan)` (parameters, gradients, activations of the blocks).
        rank: the rank whose groups and bytes are listed and whose row is marked (default:
            the plan's first rank).

    Returns:
        The path written.

    Raises:
        ValueError: `rank` is not a rank of the plan's matrix.

    Example:
        >>> write_plan_html(parallel_net.parallel_plan, "saved_graph/plan.html", rank=5)
        PosixPath('saved_graph/plan.html')
    """
    return write_text_atomically(path, format_plan_html(plan, memory, rank))
