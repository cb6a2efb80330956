"""Following an op's aten program on placements: the strategy of an op with no rule of its own.

`_Follow` is `_planner.Planner`'s half that asks the sharding rules (`ops.aten_rules.decide`:
DTensor's, or shardwise's own) about every aten op a torch-level node ran:

- `_Follow._follow`: an op with a rule of its own as a whole (`ops.torch_rules.NODE_RULES`: a
  recurrent layer) takes it; any other runs the node's aten program on placements, from the
  ones its inputs have: each aten op's rule says which placements its arguments need and
  which its outputs get; an input not yet used takes what its first use needs, while an
  intermediate value (or an input already used) that would have to move makes the op run
  replicated (`_replicated`); an input one aten op reads in two slots wanted placed
  differently (``h * h`` of a partial sum) is placed as the later slot wants and the program
  followed again (`_place`: a value has one placement per op). An input an aten op changes
  in place keeps its placements, unless the op changes its metadata (``squeeze_``: `_values`).
  Returns the inputs' placements, the outputs' and the rule that decided (the highest in
  `_ORDER` of those that took part); placements that are no layout of their tensor's shape
  raise `NoLayout`.
- `_Follow._cheaper`: an unannotated op's strategy: the one `_follow` gives, unless it moves
  the inputs (or runs replicated) and the data-parallel one (`_data_parallel_inputs`) moves
  fewer bytes (`_cost`), or no rule fills its random tensor as the inputs are placed
  (`RandomFillError`: a dropout of a partial sum), where the data-parallel one is taken, or
  the rule's placements have no layout (`NoLayout`), where a split is made whole first.
- `_Follow.pin`: an op annotated with ``sw.shard``'s op form: `_follow` from the annotated
  input layouts, strictly (a rule that would move them, or an intermediate, is a `PlanError`);
  the result is kept in `pinned` for `Planner.torch_node`, and the layouts its parameters are
  read in are returned (their storage layouts).
- errors (`_follow_errors.FollowErrors`, its base): placements no layout holds (`NoLayout`), the
  `PlanError` for an aten op no rule can run on the inputs as placed (`_error`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

import torch
from torch.distributed.tensor import Replicate, Shard

from shardwise.layout import DeviceMatrix, TensorLayout, refine
from shardwise.ops import _flat as flat
from shardwise.ops._dtensor import Spec
from shardwise.ops.aten_rules import Decision
from shardwise.ops.torch_rules import NODE_RULES
from shardwise.planner._even import even_decision, out_meta
from shardwise.planner._follow_errors import (
    FollowErrors,
    NeedsWholeDim,
    NoLayout,
    RandomFillError,
)
from shardwise.planner._graph import AtenArg, AtenCall, Graph, Node, Ref
from shardwise.planner._in_place import activation
from shardwise.planner._placement import (
    Placements,
    PlanError,
    _itemsize,
    data_parallel,
    placements_of,
    to_placed,
)
from shardwise.planner._plan import Placed, replicated
from shardwise.planner._strided_reads import own_strided_call
from shardwise.planner._values import Values, copied, lookup, now
from shardwise.redistribution import plan_redistribution

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_ORDER = {"identity": 0, "factory": 1, "dtensor": 2, "shardwise": 3, "replicate": 4}


class _Follow(FollowErrors):
    """The aten-program half of `_planner.Planner` (which sets the attributes below)."""

    graph: Graph
    device_num: int
    matrix: DeviceMatrix
    ndim: int
    mesh: DeviceMesh
    state: dict[Ref, Placed]
    # op-form annotated nodes: index -> (input placements, output placements)
    pinned: dict[int, tuple[list[Placements], list[Placements]]]
    given_blocks: set[Ref]  # the call inputs each rank passes its own block of (not cut at entry)

    def rep(self) -> Placements:
        return tuple(Replicate() for _ in range(self.ndim))

    def pin(self, node: Node, layouts: Mapping[int, TensorLayout]) -> dict[str, TensorLayout]:
        """Plan an op-form annotated node from its inputs' `layouts` (slot -> layout); returns
        the storage layout of each parameter it reads (the partial axes left out)."""
        have = [
            placements_of(Placed(refine(layouts[i], self.matrix)))
            if i in layouts
            else placements_of(replicated(self.matrix, len(self.graph.info(r).shape)))
            for i, r in enumerate(node.inputs)
        ]
        need, outs, _ = self._follow(node, have, strict=True)
        for i in layouts:
            if need[i] != have[i]:
                self._whole_op(node, have)  # (the op's own rule may say why: it raises then)
                raise PlanError(
                    f"sw.shard on {node.module} ({node.op} at {node.source}): the sharding rule "
                    f"of {node.op} cannot take input {i} as annotated ({have[i]}; it wants "
                    f"{need[i]}); change the strategy"
                )
        self.pinned[node.index] = (need, outs)
        out: dict[str, TensorLayout] = {}
        for i, ref in enumerate(node.inputs):
            if ref.kind == "param":
                placed = to_placed(self.matrix, need[i], len(self.graph.info(ref).shape))
                out.setdefault(str(ref.key), placed.layout)
        return out

    def _follow(
        self,
        node: Node,
        have: list[Placements],
        strict: bool = False,
        seen: list[tuple[AtenCall, Placements]] | None = None,
        retried: frozenset[int] = frozenset(),
    ) -> tuple[list[Placements], list[Placements], str]:
        """Run the node's aten program on placements: (its inputs' placements, its outputs',
        the rule source). Falls back to replicated when an intermediate must move (`strict`:
        an annotated op, which raises instead), except an intermediate that is a same-shaped
        copy of an input (``_to_copy``: a linear's bias cast under autocast): the program runs
        again with that input placed as wanted (once per input, `retried`); likewise one made
        of an input and 0-d scalars alone (SDPA's boolean mask made additive, which attention
        wants split like q's batch: `copied`), and an input one aten op reads in two slots
        that want it placed differently (``h * h`` of a partial sum: `_place`). With `seen`,
        each aten call is appended there with its first output's placements. Raises
        `NoLayout` when an input's or output's placements are no layout of its global shape
        (`_check_layouts`)."""
        decided = None if strict else self._whole_op(node, have)
        if decided is not None:
            return decided
        need = list(have)
        used: set[int] = set()
        tmp: Values = {}  # (intermediates; inputs changed in place)
        copies: dict[int, int] = {}  # intermediate -> the input it copies, placed alike
        mark = len(seen) if seen is not None else 0
        sources = {"identity" if node.inputs else "factory"}
        for call in node.aten:
            args = [
                x for x in flat.leaves((call.args, dict(call.kwargs))) if isinstance(x, AtenArg)
            ]
            dec = self._decide(node, call, args, need, tmp)
            sources.add(dec.source)
            moved = self._place(node, call, args, dec, need, tmp, used, copies, retried, strict)
            if moved == "whole":  # (an intermediate, or an input already used, would move)
                return self._replicated(node)
            if moved is not None:  # (an input placed otherwise: the program followed again)
                if seen is not None:
                    del seen[mark:]
                again = [
                    moved[1] if node.inputs[j] == node.inputs[moved[0]] else h
                    for j, h in enumerate(have)
                ]
                return self._follow(node, again, strict, seen, retried | {moved[0]})
            used |= {arg.index for arg in args if arg.kind == "in"}
            for j, out in enumerate(call.outputs):
                got = dec.outputs[j] if j < len(dec.outputs) else None
                changed = got is not None and got != now(out, need, tmp, self.rep())
                if out.kind == "tmp" or changed:  # (an input: its metadata changed in place)
                    tmp[out.kind, out.index] = got if got is not None else self.rep()
            source = copied(args, call, dec.inputs, dec.outputs)
            if source is not None and call.outputs[0].kind == "tmp":
                copies[call.outputs[0].index] = (
                    source.index if source.kind == "in" else copies.get(source.index, -1)
                )
            if seen is not None:
                first = dec.outputs[0] if dec.outputs else None
                seen.append((call, first if first is not None else self.rep()))
        for j, ref in enumerate(node.inputs):  # a tensor passed twice: its first slot decides
            need[j] = need[node.inputs.index(ref)]
        outs = []
        for om in node.out_map:
            if om is None:
                outs.append(self.rep())
            else:
                outs.append(now(om, need, tmp, self.rep()))
        while len(outs) < len(node.outputs):
            outs.append(self.rep())
        self._check_layouts(node, need, outs)
        return need, outs, max(sources, key=_ORDER.__getitem__)

    def _place(
        self,
        node: Node,
        call: AtenCall,
        args: list[AtenArg],
        dec: Decision,
        need: list[Placements],
        tmp: Values,
        used: set[int],
        copies: dict[int, int],
        retried: frozenset[int],
        strict: bool,
    ) -> tuple[int, Placements] | Literal["whole"] | None:
        """Give aten `call`'s arguments the placements `dec` wants: an input not used yet takes
        them (in `need`). Returns None when that is all, ``(i, want)`` when input i must be
        placed `want` and the program followed again (a copy of it wants `want`: `copied`; or
        the call reads it in two slots that want it placed differently, ``h * h`` of a partial
        sum, which DTensor runs as (partial, whole): each slot gets one placement, the one
        the later slot wants), ``"whole"`` when the op must run replicated (an intermediate
        or an input already used would move; a `PlanError` when `strict`)."""
        here: set[int] = set()  # (the inputs this call's earlier slots read)
        for arg, want in zip(args, dec.inputs, strict=False):
            cur = now(arg, need, tmp, self.rep())
            first = arg.kind == "in" and arg.index not in here
            here |= {arg.index} if arg.kind == "in" else set()
            if want == cur:
                continue
            if arg.kind == "in" and arg.index not in used and first:
                need[arg.index] = want
            elif arg.kind == "in" and arg.index not in (*used, *retried):
                return arg.index, want  # (read twice here, wanted two ways)
            elif arg.kind != "in" and copies.get(arg.index, -1) not in (-1, *retried):
                return copies[arg.index], want  # (its copy wants another placement)
            elif strict:
                raise PlanError(
                    f"sw.shard on {node.module} ({node.op} at {node.source}): with the "
                    f"annotated layouts, {call.op} inside it would have to move an "
                    f"intermediate value; change the strategy"
                )
            else:
                return "whole"
        return None

    def _whole_op(
        self, node: Node, have: list[Placements]
    ) -> tuple[list[Placements], list[Placements], str] | None:
        """The strategy of an op parallel as a whole (`ops.torch_rules.NODE_RULES`: a recurrent
        layer) from its inputs' placements, or None (no such rule, or it follows the aten
        program)."""
        whole_op = NODE_RULES.get(node.op)
        if whole_op is None:
            return None
        shapes = [self.graph.info(r).shape for r in node.inputs]
        given = [r in self.given_blocks for r in node.inputs]
        try:
            decided = whole_op(have, shapes, node.args, dict(node.kwargs), self.ndim, given)
        except ValueError as e:
            raise PlanError(f"{node.op} at {node.source} ({node.module}): {e}") from None
        return None if decided is None else (decided[0], decided[1], "shardwise")

    def _decide(
        self,
        node: Node,
        call: AtenCall,
        args: list[AtenArg],
        need: list[Placements],
        tmp: Values,
    ) -> Decision:
        """The rule's `Decision` for aten `call` of `node`, its inputs placed as `need` (the
        node's inputs) and `tmp` (intermediates; whole when not yet made); the op's PlanError
        when no rule runs it so (`RandomFillError` for a random fill)."""
        if own_strided_call(node, call):  # (a user's own as_strided: its sizes may be global)
            whole = tuple(self.rep() for _ in args)
            return Decision(whole, tuple(self.rep() for _ in call.outputs), "replicate")
        specs = {
            id(x): Spec(
                now(x, need, tmp, self.rep()),
                x.info.shape,
                x.stride,
                x.info.dtype,
            )
            for x in args
        }
        a, k = flat.map_only(AtenArg, lookup(specs), (call.args, dict(call.kwargs)))
        try:
            shapes = [o.info.shape for o in call.outputs]
            dec = even_decision(call.op, a, k, self.mesh, self.ndim, shapes, out_meta(call, args))
        except (RuntimeError, ValueError, AssertionError, KeyError, IndexError) as e:
            error = self._error(node, call.op, e)
            if torch.Tag.nondeterministic_seeded in call.op.tags:  # (`_cheaper`)
                raise RandomFillError(str(error)) from None
            raise error from None
        return dec

    def _cheaper(
        self, node: Node, have: list[Placements]
    ) -> tuple[list[Placements], list[Placements], str]:
        """An unannotated op's strategy: it follows its inputs' placements, unless that moves
        them (or cannot run) and the data-parallel strategy (semi_auto's default) moves less.
        When no rule runs it as its inputs are placed: with a dim split over several axes (a
        head-merging view of a batch over (dp, mp)), its inputs with each dim split over its
        outer axis only (`_outer_axes`); a rule that keeps a split no layout holds (`NoLayout`:
        a reshape merging dims split on different axes) or needs a split dim whole
        (`NeedsWholeDim`), each split made whole in turn, then the data-parallel strategy; a
        random fill (a dropout's in-place fill of a partial sum: `RandomFillError`), the
        data-parallel strategy; else the error (an uneven view of a split dim, an in-place op on
        a partial sum: not run another way silently)."""
        try:
            need, outs, rule = self._follow(node, have)
        except PlanError as error:  # (no rule runs it as its inputs are placed)
            if not node.inputs:
                raise
            outer = self._outer_axes(node, have)
            fallbacks = [outer] if outer != have else []  # (a dim split over several axes)
            if isinstance(error, NeedsWholeDim | NoLayout):  # (each split made whole, then DP)
                fallbacks += _one_axis_whole(have)
            if isinstance(error, RandomFillError | NeedsWholeDim | NoLayout):
                fallbacks.append(self._data_parallel_inputs(node))
            for fallback in fallbacks:
                try:
                    return self._follow(node, fallback)
                except PlanError:
                    pass
            raise error from None
        if not node.inputs:
            return need, outs, rule
        cost = self._cost(node, need)
        if rule != "replicate" and cost == 0:
            return need, outs, rule
        try:
            alt = self._follow(node, self._data_parallel_inputs(node))
        except PlanError:  # (no data-parallel strategy: ``embedding_bag``'s offsets)
            return need, outs, rule
        if alt[2] != "replicate" and (rule == "replicate" or self._cost(node, alt[0]) < cost):
            return alt
        return need, outs, rule

    def _cost(self, node: Node, need: list[Placements]) -> int:
        """Bytes a rank sends to move the node's inputs to `need` (partial sums reduced)."""
        total = 0
        for ref, want in zip(node.inputs, need, strict=True):
            src = self.state[ref]
            info = self.graph.info(ref)
            dst = to_placed(self.matrix, want, len(info.shape))
            if src == dst:
                continue
            size = _itemsize(info.dtype)
            if any(a not in dst.partial for a in src.partial):
                n = 1
                for s in src.layout.local_shape(info.shape):
                    n *= s
                total += 2 * n * size
            moved = plan_redistribution(src.layout, dst.layout, info.shape, size)
            total += moved.total_bytes
        return total

    def _outer_axes(self, node: Node, have: list[Placements]) -> list[Placements]:
        """`have` with each dim split over several axes split over its outer one only, and no
        strided groups (a batch over (dp, mp) after a row-parallel layer: back to dp)."""
        out = []
        for ref, placements in zip(node.inputs, have, strict=True):
            ndim = len(self.graph.info(ref).shape)
            placed = to_placed(self.matrix, placements, ndim)
            dims = tuple(axes[:1] for axes in placed.layout.dims)
            layout = TensorLayout(self.matrix, dims)
            out.append(placements_of(Placed(layout, placed.partial, placed.reduce)))
        return out

    def _data_parallel_inputs(self, node: Node) -> list[Placements]:
        """The node's activations split on dim 0 over every axis (when it divides), the rest
        whole (a buffer, a parameter, an in-place op's output or view of one: `activation`):
        the data-parallel strategy semi_auto gives an op whose inputs' layouts it can't follow."""
        out = []
        for ref in node.inputs:
            shape = self.graph.info(ref).shape
            active = activation(self.graph, ref) and shape and shape[0] % self.device_num == 0
            placed = data_parallel(self.matrix, len(shape)) if active else None
            out.append(placements_of(placed or replicated(self.matrix, len(shape))))
        return out

    def _replicated(self, node: Node) -> tuple[list[Placements], list[Placements], str]:
        return [self.rep() for _ in node.inputs], [self.rep() for _ in node.outputs], "replicate"


def _one_axis_whole(have: list[Placements]) -> list[list[Placements]]:
    """`have` with one axis's split of one input made whole, for each such (input, axis), the
    innermost axis first (``unbind`` of the dim a column-parallel layer split: only mp's
    split gathered, the batch kept on its rows)."""
    out = []
    for i, placements in enumerate(have):
        for axis in reversed(range(len(placements))):
            if isinstance(placements[axis], Shard):
                whole = (*placements[:axis], Replicate(), *placements[axis + 1 :])
                out.append([whole if j == i else p for j, p in enumerate(have)])
    return out
