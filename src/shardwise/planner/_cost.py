"""The alpha-beta cost model the automatic planners price communication with.

A collective over a group of ``k`` ranks along mesh axis ``a`` that makes each rank send ``S``
bytes (`communication.recorder.bytes_bound`: AllReduce 2(k-1)/k·B, AllGather (k-1)·B,
AlltoAll / ReduceScatter (k-1)/k·B for a B-byte block) takes ``alpha[a] · steps + S · beta[a]``
seconds, where ``steps`` is the collective's rounds in a ring (AllReduce 2(k-1), the others
k-1). A Slice costs nothing. The search (recursive_programming) also prices compute (FLOPs /
`flops_per_s`) and memory (bytes held · `memory_s_per_byte`).

- `CostModel`: per-axis alpha (s) and beta (s per byte), ``collective`` and ``edge`` prices
  (an `EdgePlan`-like move: the AllReduce of partial sums, then the redistribution steps).
- `load_cost_model`: the model of ``bench/results/loopback.json`` (the measured gloo loopback
  fit, `python -m bench --only loopback`) or of the file ``SHARDWISE_COST_MODEL`` names when
  the file is there, else `DEFAULT_ALPHA_S` / `DEFAULT_BETA_S_PER_BYTE` on every axis.
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
from shardwise.redistribution import Slice, plan_redistribution

DEFAULT_ALPHA_S = 10e-6
"""Default latency of one collective round: 10 µs."""
DEFAULT_BETA_S_PER_BYTE = 1e-10
"""Default time per byte sent: 0.1 ns (10 GB/s)."""
DEFAULT_FLOPS_PER_S = 1e12
"""Default compute speed of one device for the search: 1 TFLOP/s."""
DEFAULT_MEMORY_S_PER_BYTE = 1e-12
"""Default price of holding one byte on a rank for the search: 1 ps (1 µs per MB)."""
LOOPBACK_JSON = Path("bench") / "results" / "loopback.json"


@dataclass(frozen=True)
class CostModel:
    """Per mesh axis: `alpha` seconds per collective round, `beta` seconds per byte sent.

    Attributes:
        alpha: one value per axis of the device matrix (or one for all, as a 1-tuple).
        beta: likewise.
        source: where the numbers come from (printed in explanations).
        flops_per_s: one device's compute speed (the search's compute cost).
        memory_s_per_byte: what holding a byte on a rank costs in the search's objective.

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

    def _of(self, values: tuple[float, ...], axis: int) -> float:
        return values[axis] if axis < len(values) else values[-1]

    def collective(self, kind: str, nbytes: int, group: int, axis: int) -> float:
        """Seconds of one collective of `kind` on `group` ranks along `axis`; `nbytes` as
        `bytes_bound` takes it (the input block on one rank)."""
        if group <= 1:
            return 0.0
        rounds = 2 * (group - 1) if kind == "AllReduce" else group - 1
        sent = bytes_bound(kind, nbytes, group)
        return rounds * self._of(self.alpha, axis) + sent * self._of(self.beta, axis)

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
    ) -> float:
        """Seconds to move a tensor of global `shape` from `src` to `dst`: the AllReduce of
        its partial sums over `reduced` first, then the cheapest steps between the layouts."""
        return _move(self, src, dst, tuple(shape), itemsize, tuple(reduced))


@lru_cache(maxsize=65536)
def _move(
    model: CostModel,
    src: TensorLayout,
    dst: TensorLayout,
    shape: tuple[int, ...],
    itemsize: int,
    reduced: tuple[int, ...],
) -> float:
    total = 0.0
    m = src.matrix
    if reduced:
        block = math.prod(src.local_shape(shape)) * itemsize
        total += model.all_reduce(block, m, reduced)
    if src.dims != dst.dims or src.groups != dst.groups:
        plan = plan_redistribution(src, dst, shape, itemsize)
        for step, sent in zip(plan.steps, plan.step_bytes, strict=True):
            if isinstance(step, Slice) or m.shape[step.axis] == 1:
                continue
            rounds = m.shape[step.axis] - 1
            total += rounds * model._of(model.alpha, step.axis)
            total += sent * model._of(model.beta, step.axis)
    return total


def load_cost_model(path: str | os.PathLike[str] | None = None) -> CostModel:
    """The cost model: the fit in `path` (default: the file the ``SHARDWISE_COST_MODEL``
    environment variable names, else ``bench/results/loopback.json`` under the current
    directory) on every axis when the file exists, else the documented defaults
    (``SHARDWISE_COST_MODEL=defaults``: always the defaults).

    Returns:
        A `CostModel` (``source`` names the file or ``"defaults"``).
    """
    chosen = os.environ.get("SHARDWISE_COST_MODEL", "")
    if path is None and chosen == "defaults":
        return CostModel()
    target = Path(path) if path is not None else Path(chosen) if chosen else LOOPBACK_JSON
    try:
        data = json.loads(target.read_text())
        alpha, beta = float(data["alpha_s"]), float(data["beta_s_per_byte"])
    except (OSError, ValueError, KeyError, TypeError):
        return CostModel()
    if alpha < 0 or beta <= 0:
        return CostModel()
    return CostModel((alpha,), (beta,), str(target))
