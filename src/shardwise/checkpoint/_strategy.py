"""How a job cuts its checkpoint: `CheckpointStrategy`, from a plan, a strategy file or a count.

A checkpoint strategy says, for every rank, which piece of every entry that rank's file holds:
a parameter's storage layout (the plan's ``params``), then optimizer parallel's dim-0 shard of
it (the plan's ``"shard"`` buckets), and, for optimizer state shaped like its parameter, the
same piece; anything else (buffers, Adam's ``step``) is whole on every rank.

- `ShardSpec`: one parameter's optimizer-parallel cut (axes, shard size, padding).
- `CheckpointStrategy`: `param_piece`, `entry_piece`; built by `from_plan`, `single`,
  `replicated`, `from_json`; `to_json` (the parameter strategy file's content); `aligned` to
  a checkpoint's names (a wrapper's prefix, tied names).
- `as_strategy`: what users pass as a destination (a plan, a strategy file, a device count,
  None for one device).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.checkpoint._errors import CheckpointError
from shardwise.checkpoint._format import OPTIMIZER_PREFIX
from shardwise.checkpoint._pieces import Piece, cut_rows, layout_piece, whole
from shardwise.layout import DeviceMatrix
from shardwise.planner import ParallelPlan, ParamPlan
from shardwise.planner._files import PARAM_FORMAT, shards_d
from shardwise.planner._plan_json import matrix_d, matrix_of, params_d, params_of

STATE_PREFIX = f"{OPTIMIZER_PREFIX}state."


def owner_of(key: str) -> str:
    """The parameter an entry belongs to: itself, or ``<param>`` of an optimizer state entry
    ``optimizer.state.<param>.<key>``."""
    return key[len(STATE_PREFIX) :].rpartition(".")[0] if key.startswith(STATE_PREFIX) else key


def wrapper_prefix(inner: Collection[str], outer: Collection[str]) -> str | None:
    """The prefix (a wrapper's ``network.``) under which every name of `inner` is in `outer`,
    or None.

    Example:
        >>> wrapper_prefix(["0.weight"], ["network.0.weight", "network.0.bias"])
        'network.'
    """
    held = set(outer)
    first = next(iter(inner), None)
    if first is None:
        return None
    for key in sorted(k for k in held if k.endswith("." + first)):
        prefix = key[: -len(first)]
        if all(prefix + n in held for n in inner):
            return prefix
    return None


@dataclass(frozen=True)
class ShardSpec:
    """A parameter cut by optimizer parallel: its block's dim 0 over a shard group of `shard`
    ranks along the data-parallel `axes` (names); `pad`: equal parts, the last padded."""

    axes: tuple[str, ...]
    shard: int
    pad: bool = False


@dataclass(frozen=True)
class CheckpointStrategy:
    """Which piece of every checkpoint entry each of `device_num` ranks holds.

    Attributes:
        device_num: the job's size.
        matrix: the device matrix the layouts live on.
        params: each parameter's storage layout and global shape (by state_dict name).
        shards: the parameters optimizer parallel cuts further.
        aliases: extra state_dict names of tied parameters -> their first name (cut alike).
        prefix: what the network's names carry in the checkpoint (``network.`` when it was
            saved through its `AutoParallel` wrapper).
        left_out: parameters the job's plan cuts that its strategy file leaves out
            (``only_trainable_params=True``: those that need no gradient); a checkpoint cut
            by this strategy holds them whole.

    Example:
        >>> s = CheckpointStrategy.from_plan(parallel_net.parallel_plan)  # doctest: +SKIP
        >>> s.param_piece("fc.weight", rank=1)  # doctest: +SKIP
    """

    device_num: int
    matrix: DeviceMatrix
    params: Mapping[str, ParamPlan] = field(default_factory=dict)
    shards: Mapping[str, ShardSpec] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    prefix: str = ""
    left_out: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n, size = self.device_num, math.prod(self.matrix.shape)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"CheckpointStrategy: device_num {n!r} must be an int >= 1")
        if n != size:  # (fewer: the last ranks' blocks were never written; more: no block)
            raise ValueError(
                f"CheckpointStrategy: device_num {n} is not the size of its device matrix "
                f"{self.matrix} ({size} devices); give device_num={size}, or a matrix of {n}"
            )

    @classmethod
    def single(cls) -> CheckpointStrategy:
        """One device: every entry whole."""
        return cls.replicated(1)

    @classmethod
    def replicated(cls, device_num: int) -> CheckpointStrategy:
        """`device_num` ranks each holding every entry whole (data parallel, no hsdp)."""
        if isinstance(device_num, bool) or not isinstance(device_num, int) or device_num < 1:
            raise ValueError(f"device count {device_num!r} must be an int >= 1")
        return cls(device_num, DeviceMatrix((device_num,), ("dp",)))

    @classmethod
    def from_plan(
        cls, plan: ParallelPlan, aliases: Mapping[str, str] | None = None
    ) -> CheckpointStrategy:
        """The cut a plan's job makes (`aliases`: extra state_dict name -> the planned name of
        the same tensor, as tied weights)."""
        shards = {
            name: ShardSpec(tuple(b.axes), b.shard)
            for b in plan.buckets
            if b.kind == "shard" and b.shard > 1
            for name in b.params
        }
        made = cls(plan.device_num, plan.matrix, dict(plan.params), shards)
        return made.with_aliases(aliases or {})

    def with_aliases(self, aliases: Mapping[str, str]) -> CheckpointStrategy:
        """The same cut, with tied names (alias -> a parameter's name) cut as their parameter."""
        params, shards, kept = dict(self.params), dict(self.shards), dict(self.aliases)
        for alias, name in aliases.items():
            if name not in self.params:
                continue
            kept[alias] = name
            if alias not in self.params:
                params[alias] = self.params[name]
                if name in self.shards:
                    shards[alias] = self.shards[name]
        return dataclasses.replace(self, params=params, shards=shards, aliases=kept)

    def renamed(self, prefix: str) -> CheckpointStrategy:
        """The same cut with every parameter name prefixed (a network inside a wrapper)."""
        return dataclasses.replace(
            self,
            params={prefix + k: v for k, v in self.params.items()},
            shards={prefix + k: v for k, v in self.shards.items()},
            aliases={prefix + k: prefix + v for k, v in self.aliases.items()},
            prefix=prefix + self.prefix,
            left_out=tuple(prefix + k for k in self.left_out),
        )

    def aligned(
        self, names: Collection[str], recorded: CheckpointStrategy | None
    ) -> CheckpointStrategy:
        """This strategy for a checkpoint of entries `names` that recorded `recorded`: names
        prefixed as the checkpoint's (a wrapper's ``network.``) and its tied names added."""
        out, present = self, set(names)
        if out.params and not all(n in present for n in out.params):
            prefix = wrapper_prefix(out.params, present)
            if prefix is not None:
                out = out.renamed(prefix)
        if recorded is not None:
            out = out.with_aliases({a: n for a, n in recorded.aliases.items() if a in present})
        return out

    def param_piece(self, name: str, rank: int) -> Piece:
        """Rank `rank`'s piece of parameter `name` (its layout's block, then its shard)."""
        p = self.params[name]
        piece = layout_piece(p.layout, rank, p.shape)
        spec = self.shards.get(name)
        if spec is None:
            return piece
        axes = tuple(self.matrix.names.index(a) for a in spec.axes)
        members = self.matrix.group_along(rank, axes)
        pos = members.index(rank)
        rows = piece.local_shape[0]
        if not spec.pad and rows % spec.shard:
            raise CheckpointError(
                f"parameter {name!r} {list(p.shape)}: dim 0 of its block on rank {rank} "
                f"({rows} rows) cannot be cut into {spec.shard} optimizer-parallel shards "
                f"(ShardSpec axes {', '.join(spec.axes)}); use a shard count that divides "
                f"{rows}, or ShardSpec({spec.axes!r}, {spec.shard}, pad=True) for equal parts, "
                "the last padded"
            )
        return cut_rows(piece, pos % spec.shard, spec.shard, spec.pad)

    def entry_piece(self, name: str, shape: tuple[int, ...], rank: int) -> Piece:
        """Rank `rank`'s piece of checkpoint entry `name` of global `shape`: a parameter's, an
        optimizer state tensor shaped like its parameter (``optimizer.state.<param>.<key>``)
        as the parameter, anything else whole."""
        if not 0 <= rank < self.device_num:
            raise ValueError(f"rank {rank} is not in a job of {self.device_num} devices")
        owner = owner_of(name)
        p = self.params.get(owner)
        if p is None or tuple(p.shape) != tuple(shape):
            return whole(shape)
        return self.param_piece(owner, rank)

    def stored_piece(self, key: str, local: tuple[int, ...], rank: int) -> Piece | None:
        """The piece a rank's stored block of entry `key`, of `local` shape, holds: its
        parameter's block when it has that block's shape (a parameter, or optimizer state cut
        like it), whole for an entry of no planned parameter or a 0-d one; None when the shape
        fits neither (the entry is not stored as this strategy cuts it)."""
        owner = owner_of(key)
        if owner not in self.params or len(local) == 0:
            return whole(local)
        piece = self.param_piece(owner, rank)
        return piece if piece.local_shape == tuple(local) else None

    def to_json(self) -> dict[str, Any]:
        """The parameter strategy file's content (``shards``: the optimizer-parallel cuts)."""
        return {
            "format": PARAM_FORMAT,
            "device_num": self.device_num,
            "matrix": matrix_d(self.matrix),
            "params": params_d(self.params),
            "shards": shards_d(self.shards),
            "aliases": dict(self.aliases),
            "prefix": self.prefix,
        } | ({"left_out": list(self.left_out)} if self.left_out else {})

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "strategy") -> CheckpointStrategy:
        """Read `to_json`'s data, a parameter strategy file's or an operator strategy file's."""
        try:
            if data.get("format") != PARAM_FORMAT:  # (an operator strategy file: a whole plan)
                return cls.from_plan(ParallelPlan.from_dict(data))
            m = matrix_of(data["matrix"])
            shards = {
                n: ShardSpec(tuple(v["axes"]), int(v["shard"]), bool(v.get("pad", False)))
                for n, v in data.get("shards", {}).items()
            }
            made = cls(int(data["device_num"]), m, params_of(m, data["params"]), shards)
            left_out = tuple(str(n) for n in data.get("left_out", ()))
            made = dataclasses.replace(made, prefix=str(data.get("prefix", "")), left_out=left_out)
            return made.with_aliases(dict(data.get("aliases", {})))
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{where}: not a shardwise strategy ({e})") from None

    @classmethod
    def load(cls, path: str | Path) -> CheckpointStrategy:
        """Read a parameter or operator strategy file."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: cannot read the strategy file ({e})") from None
        return cls.from_json(data, str(path))


def as_strategy(value: object) -> CheckpointStrategy:
    """A destination strategy from what a user passes.

    Args:
        value: a `CheckpointStrategy`; a `ParallelPlan` (``parallel_net.parallel_plan``); the
            path of a parameter or operator strategy file; an int N (N ranks each holding
            everything: data parallel); None (one device).

    Returns:
        The `CheckpointStrategy`.
    """
    if value is None:
        return CheckpointStrategy.single()
    if isinstance(value, CheckpointStrategy):
        return value
    if isinstance(value, ParallelPlan):
        return CheckpointStrategy.from_plan(value)
    if isinstance(value, str | Path):
        return CheckpointStrategy.load(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return CheckpointStrategy.replicated(value)
    raise TypeError(
        "a checkpoint strategy is a ParallelPlan, a strategy file path, a device count or None "
        f"(one device), got {type(value).__name__}"
    )
