"""The cost model the automatic planners price plans with: alpha-beta communication, compute.

A collective over a group of ``k`` ranks along mesh axis ``a`` that makes each rank send ``S``
bytes (`communication.recorder.bytes_bound`: AllReduce 2(k-1)/k·B, AllGather (k-1)·B,
AlltoAll / ReduceScatter (k-1)/k·B for a B-byte block) takes
``call_s + alpha[a] · steps + S · beta[a]`` seconds, where ``steps`` is the collective's rounds
in a ring (AllReduce 2(k-1), the others k-1) and ``call_s`` a fixed cost per collective call
(the backend's software path; 0 in the defaults). A Slice costs nothing. The search
(recursive_programming) also prices compute (FLOPs / `flops_per_s`) and memory (bytes held ·
`memory_s_per_byte`). A training step's estimate (`_plan_cost.step_cost`) adds what one op
costs beyond its FLOPs (`op_s`), the bytes an op reads and writes (`traffic_s_per_byte`) and
the optimizer's update (`optimizer_s_per_tensor`, `optimizer_s_per_element`).

- `CostModel`: per-axis alpha (s) and beta (s per byte), the fixed cost of a call, the compute
  constants; ``collective`` and ``move`` prices (an `EdgePlan`-like move: the AllReduce of
  partial sums, then the redistribution steps, AllGathers of one dim over several axes as one
  over their group (`redistribution.gather_runs`); a sum whose first steps cut a dim over
  reduced axes as one ReduceScatter over them, as the executor runs it where the edge allows).
- `load_cost_model`: the model of ``bench/results/loopback.json`` (measured on this machine by
  `python -m bench --only loopback`) or of the file ``SHARDWISE_COST_MODEL`` names when the file
  is there, else the documented defaults (``DEFAULT_*``). The file's keys: ``alpha_s`` and
  ``beta_s_per_byte`` (a point-to-point fit: per round and per byte), optionally
  ``collective`` (``call_s``, ``alpha_s``, ``beta_s_per_byte``: a fit on the collectives
  themselves, used instead when present) and ``compute`` (``flops_per_s``, ``op_s``,
  ``traffic_s_per_byte``, ``optimizer_s_per_tensor``, ``optimizer_s_per_element``); a field that
  is missing or not a usable number keeps its default.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from shardwise.communication.recorder import bytes_bound
from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.planner._scatter import scatter_cuts
from shardwise.redistribution import (
    Slice,
    apply_step,
    gather_runs,
    plan_redistribution,
    run_axes,
)

DEFAULT_ALPHA_S = 10e-6
"""Default latency of one collective round: 10 µs."""
DEFAULT_BETA_S_PER_BYTE = 1e-10
"""Default time per byte sent: 0.1 ns (10 GB/s)."""
DEFAULT_FLOPS_PER_S = 1e12
"""Default compute speed of one device for the search: 1 TFLOP/s."""
DEFAULT_MEMORY_S_PER_BYTE = 1e-12
"""Default price of holding one byte on a rank for the search: 1 ps (1 µs per MB)."""
DEFAULT_CALL_S = 0.0
"""Default fixed cost of one collective call beyond its rounds: none."""
DEFAULT_OP_S = 10e-6
"""Default time one op adds to a training step beyond its work (forward and backward launch
and dispatch): 10 µs."""
DEFAULT_TRAFFIC_S_PER_BYTE = 3e-11
"""Default time per byte an op reads or writes, its backward included: 30 ps (three passes at
100 GB/s)."""
DEFAULT_OPTIMIZER_S_PER_TENSOR = 20e-6
"""Default fixed cost of the optimizer's update of one parameter: 20 µs."""
DEFAULT_OPTIMIZER_S_PER_ELEMENT = 3.2e-10
"""Default cost of the optimizer's update per stored element (Adam: about 32 bytes read and
written at 100 GB/s): 0.32 ns."""
LOOPBACK_JSON = Path("bench") / "results" / "loopback.json"


@dataclass(frozen=True)
class CostModel:
    """Per mesh axis: `alpha` seconds per collective round, `beta` seconds per byte sent; the
    fixed cost of a collective call and the compute constants.

    Attributes:
        alpha: one value per axis of the device matrix (or one for all, as a 1-tuple).
        beta: likewise.
        source: where the numbers come from (printed in explanations).
        flops_per_s: one device's compute speed (the search's compute cost; a step estimate's
            matrix products).
        memory_s_per_byte: what holding a byte on a rank costs in the search's objective.
        call_s: the fixed cost of one collective call (every kind, every group size).
        op_s: what one op adds to a training step beyond its work (step estimates only).
        traffic_s_per_byte: seconds per byte an op reads or writes, its backward included
            (step estimates only).
        optimizer_s_per_tensor / optimizer_s_per_element: the optimizer's update of one
            parameter, and per element of its stored block (step estimates only).

    Example:
        >>> m = CostModel((1e-5,), (1e-10,))
        >>> round(m.collective("AllReduce", 4096, 4, axis=0) * 1e6, 2)  # 6 rounds + 6 KiB
        60.61
    """

    alpha: tuple[float, ...] = (DEFAULT_ALPHA_S,)
    beta: tuple[float, ...] = (DEFAULT_BETA_S_PER_BYTE,)
    source: str = "defaults"
    flops_per_s: float = DEFAULT_FLOPS_PER_S
    memory_s_per_byte: float = DEFAULT_MEMORY_S_PER_BYTE
    call_s: float = DEFAULT_CALL_S
    op_s: float = DEFAULT_OP_S
    traffic_s_per_byte: float = DEFAULT_TRAFFIC_S_PER_BYTE
    optimizer_s_per_tensor: float = DEFAULT_OPTIMIZER_S_PER_TENSOR
    optimizer_s_per_element: float = DEFAULT_OPTIMIZER_S_PER_ELEMENT

    def _of(self, values: tuple[float, ...], axis: int) -> float:
        return values[axis] if axis < len(values) else values[-1]

    def collective(self, kind: str, nbytes: int, group: int, axis: int) -> float:
        """Seconds of one collective of `kind` on `group` ranks along `axis`; `nbytes` as
        `bytes_bound` takes it (the input block on one rank)."""
        if group <= 1:
            return 0.0
        rounds = 2 * (group - 1) if kind == "AllReduce" else group - 1
        sent = bytes_bound(kind, nbytes, group)
        return self.call_s + rounds * self._of(self.alpha, axis) + sent * self._of(self.beta, axis)

    def all_reduce(self, nbytes: int, matrix: DeviceMatrix, axes: Sequence[int]) -> float:
        """An AllReduce of an `nbytes` block over `axes` (one ring over their ranks, priced on
        the slowest of them)."""
        group = math.prod(matrix.shape[a] for a in axes)
        if group <= 1:
            return 0.0
        worst = max(axes, key=lambda a: self._of(self.beta, a))
        return self.collective("AllReduce", nbytes, group, worst)

    def combine(self, kind: str, block: int, matrix: DeviceMatrix, axes: Sequence[int]) -> float:
        """An op's own collective over `axes` on its `block`-byte output block: a
        ReduceScatter (of the unscattered input) or an AllReduce."""
        if kind == "ReduceScatter":
            group = math.prod(matrix.shape[a] for a in axes)
            return self.collective("ReduceScatter", block * group, group, axes[0])
        return self.all_reduce(block, matrix, axes)

    def move(
        self,
        src: TensorLayout,
        dst: TensorLayout,
        shape: Sequence[int],
        itemsize: int,
        reduced: Sequence[int] = (),
        scatter: bool = True,
    ) -> float:
        """Seconds to move a tensor of global `shape` from `src` to `dst`: the AllReduce of
        its partial sums over `reduced` first, then the cheapest steps between the layouts.

        With `scatter` (a sum), a reduction whose first steps cut a dim over some of `reduced`
        is priced as the executor runs such an edge (`_scatter.scatters`): one ReduceScatter
        over those axes, the AllReduce over the others on the part, then the remaining steps.
        The planners price sum reductions so (the few edges the executor keeps whole, a
        weighted mean or an equal gradient, are not known yet); a plan's own estimate
        (`_plan_cost.edge_move`) passes False for an edge the plan keeps whole."""
        return _move(self, src, dst, tuple(shape), itemsize, tuple(reduced), scatter)


def _scattered(src: TensorLayout, dst: TensorLayout, shape: tuple[int, ...], itemsize: int,
               reduced: tuple[int, ...]) -> tuple[Slice, ...]:  # fmt: skip
    """The first steps of the move that the executor runs inside a ReduceScatter
    (`_scatter.scatter_cuts`; none: ``()``)."""
    if not reduced or (src.dims == dst.dims and src.groups == dst.groups):
        return ()
    steps = plan_redistribution(src, dst, shape, itemsize).steps
    return scatter_cuts(steps, reduced, src.matrix)


@lru_cache(maxsize=65536)
def _move(
    model: CostModel,
    src: TensorLayout,
    dst: TensorLayout,
    shape: tuple[int, ...],
    itemsize: int,
    reduced: tuple[int, ...],
    scatter: bool,
) -> float:
    total = 0.0
    m = src.matrix
    cuts = _scattered(src, dst, shape, itemsize, reduced) if scatter else ()
    if cuts:  # (the cuts run inside the ReduceScatter; the rest from its layout)
        block = math.prod(src.local_shape(shape)) * itemsize
        axes = tuple(c.axis for c in cuts)
        group = math.prod(m.shape[a] for a in axes)
        total = model.collective("ReduceScatter", block, group, axes[0])
        rest = tuple(a for a in reduced if a not in axes)
        after = src
        for cut in cuts:
            after = apply_step(after, cut)
        return total + _move(model, after, dst, shape, itemsize, rest, False)
    if reduced:
        block = math.prod(src.local_shape(shape)) * itemsize
        total += model.all_reduce(block, m, reduced)
    if src.dims != dst.dims or src.groups != dst.groups:
        plan = plan_redistribution(src, dst, shape, itemsize)
        at = 0
        for run in gather_runs(plan.steps, m.shape):  # (a dim gathered over axes: one call)
            step, sent = run[0], sum(plan.step_bytes[at : at + len(run)])
            at += len(run)
            if isinstance(step, Slice) or m.shape[step.axis] == 1:
                continue
            axes = run_axes(run)
            worst = max(axes, key=lambda a: model._of(model.beta, a))
            rounds = math.prod(m.shape[a] for a in axes) - 1
            total += model.call_s + rounds * model._of(model.alpha, worst)
            total += sent * model._of(model.beta, worst)
    return total


_COMPUTE_FIELDS = (
    "flops_per_s",
    "op_s",
    "traffic_s_per_byte",
    "optimizer_s_per_tensor",
    "optimizer_s_per_element",
)


def _number(section: object, key: str, positive: bool = False) -> float | None:
    """``section[key]`` as a finite float that is >= 0 (> 0 when `positive`), else None."""
    if not isinstance(section, dict) or key not in section:
        return None
    try:
        value = float(section[key])
    except (TypeError, ValueError):
        return None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        return None
    return value


def load_cost_model(path: str | os.PathLike[str] | None = None) -> CostModel:
    """The cost model: the fits in `path` (default: the file the ``SHARDWISE_COST_MODEL``
    environment variable names, else ``bench/results/loopback.json`` under the current
    directory) on every axis when the file exists, else the documented defaults
    (``SHARDWISE_COST_MODEL=defaults``: always the defaults). The file's ``collective`` fit
    replaces its point-to-point ``alpha_s`` / ``beta_s_per_byte`` when present; each
    ``compute`` field it has replaces that default (see the module docstring).

    Returns:
        A `CostModel` (``source`` names the file or ``"defaults"``).

    Example:
        >>> load_cost_model("no/such/file.json").source
        'defaults'
    """
    chosen = os.environ.get("SHARDWISE_COST_MODEL", "")
    if path is None and chosen == "defaults":
        return CostModel()
    target = Path(path) if path is not None else Path(chosen) if chosen else LOOPBACK_JSON
    try:
        data = json.loads(target.read_text())
    except (OSError, ValueError):
        return CostModel()
    alpha, beta = _number(data, "alpha_s"), _number(data, "beta_s_per_byte", positive=True)
    if alpha is None or beta is None:
        return CostModel()
    call = DEFAULT_CALL_S
    fitted = data.get("collective")
    c_alpha, c_beta = _number(fitted, "alpha_s"), _number(fitted, "beta_s_per_byte", True)
    c_call = _number(fitted, "call_s")
    if c_alpha is not None and c_beta is not None and c_call is not None:
        alpha, beta, call = c_alpha, c_beta, c_call
    compute = data.get("compute")
    fields: dict[str, float] = {}
    for key in _COMPUTE_FIELDS:
        value = _number(compute, key, positive=key == "flops_per_s")
        if value is not None:
            fields[key] = value
    return CostModel((alpha,), (beta,), str(target), call_s=call, **fields)
