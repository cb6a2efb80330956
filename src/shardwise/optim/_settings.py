"""The settings of optimizer parallel and communication fusion, checked: `HsdpConfig`
(`check_hsdp`: ``shard_size``, ``threshold`` in KB, ``optimizer_level``) and `FusionConfig`
(`check_fusion`: MindSpore's ``comm_fusion`` dict; `check_points`: index split points).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

LEVELS = ("level1", "level2", "level3")
FUSION_KINDS = ("allreduce", "allgather", "reducescatter")
ENTRY_KEYS = ("mode", "config")
AUTO_BUCKET_MB = 64


@dataclass(frozen=True)
class HsdpConfig:
    """Optimizer-parallel settings (see `check_hsdp`)."""

    shard_size: int = -1
    threshold: float = 64.0
    optimizer_level: str = "level1"

    def __str__(self) -> str:
        return (
            f"hsdp(shard_size={self.shard_size}, threshold={self.threshold:g} KB, "
            f"{self.optimizer_level})"
        )


def check_hsdp(
    shard_size: object, threshold: object, optimizer_level: object, mode: str = "semi_auto"
) -> HsdpConfig:
    """Validate `AutoParallel.hsdp`'s arguments (`mode`: the wrapper's parallel mode).

    Raises:
        ValueError: ``shard_size`` not -1 or > 1, ``threshold`` < 0, an unknown level; a level
            or shard size in the data_parallel mode (its owner update takes a threshold only).
        TypeError: a value of the wrong type.

    Example:
        >>> check_hsdp(-1, 64, "level2").optimizer_level
        'level2'
    """
    if isinstance(shard_size, bool) or not isinstance(shard_size, int):
        raise TypeError(f"hsdp: shard_size must be an int, got {shard_size!r}")
    if not (shard_size == -1 or shard_size > 1):
        raise ValueError(f"hsdp: shard_size={shard_size}; use -1 (the whole group) or an int > 1")
    if isinstance(threshold, bool) or not isinstance(threshold, int | float):
        raise TypeError(f"hsdp: threshold must be a number of KB, got {threshold!r}")
    if not threshold >= 0:  # (NaN too: no size compares with it)
        raise ValueError(f"hsdp: threshold={threshold} KB is not a size >= 0 (KB)")
    if optimizer_level not in LEVELS:
        valid = " | ".join(repr(v) for v in LEVELS)
        raise ValueError(f"hsdp: optimizer_level={optimizer_level!r}; valid: {valid}")
    if mode == "data_parallel" and (optimizer_level, shard_size) != ("level1", -1):
        given = [f"optimizer_level={optimizer_level!r}"] if optimizer_level != "level1" else []
        given += [f"shard_size={shard_size}"] if shard_size != -1 else []
        raise ValueError(
            f"hsdp: parallel_mode='data_parallel' runs its owner-update optimizer parallel "
            f"(each parameter updated by its owner rank, then broadcast), which takes threshold "
            f"only; {' and '.join(given)} {'is' if len(given) == 1 else 'are'} semi_auto's: "
            f"drop {'it' if len(given) == 1 else 'them'}, or use parallel_mode='semi_auto'"
        )
    return HsdpConfig(shard_size, float(threshold), str(optimizer_level))


@dataclass(frozen=True)
class FusionConfig:
    """Per collective kind: (mode, config) when bucketing by size / index, absent: by id;
    ``enabled`` False (``openstate: False``): no fusion, one collective per parameter."""

    modes: Mapping[str, tuple[str, Any]] = field(default_factory=dict)
    enabled: bool = True

    def bucket_bytes(self, kind: str) -> int | None:
        """The bucket cap of `kind` in bytes (``auto`` / ``size``), else None."""
        mode, config = self.modes.get(kind, ("", None))
        if mode == "auto":
            return AUTO_BUCKET_MB << 20
        if mode == "size":
            return int(float(config) * (1 << 20))
        return None

    def split_points(self, kind: str) -> tuple[int, ...] | None:
        """``index`` mode's split points (parameter indices), else None."""
        mode, config = self.modes.get(kind, ("", None))
        return tuple(int(i) for i in config) if mode == "index" else None


def check_fusion(config: object) -> FusionConfig:
    """Validate MindSpore's ``comm_fusion`` dict.

    Example:
        >>> check_fusion({"allreduce": {"mode": "size", "config": 32}}).bucket_bytes("allreduce")
        33554432

    Raises:
        ValueError / TypeError: unknown kinds, keys inside an entry (each takes ``mode`` and
            ``config``) or modes, an entry without a ``mode``, ``size`` without a positive
            number, ``index`` on a kind other than allreduce or without a list of increasing
            ints. ``auto``'s ``config`` is ignored (64 MB buckets), as MindSpore ignores it.
    """
    if not isinstance(config, Mapping):
        raise TypeError(
            f"comm_fusion: expected a dict such as {{'allreduce': ...}}, got {config!r}"
        )
    modes: dict[str, tuple[str, Any]] = {}
    enabled = config.get("openstate", True)
    if not isinstance(enabled, bool):
        raise TypeError(f"comm_fusion['openstate'] must be True or False, got {enabled!r}")
    for kind, sub in config.items():
        if kind == "openstate":
            continue
        if kind not in FUSION_KINDS:
            valid = ", ".join(repr(k) for k in (*FUSION_KINDS, "openstate"))
            raise ValueError(
                f"comm_fusion: unknown key {kind!r}; valid keys: {valid} (e.g. "
                "{'allreduce': {'mode': 'size', 'config': 32}} or {'openstate': False})"
            )
        modes[kind] = _check_entry(kind, sub)
    return FusionConfig(modes, enabled)


def _check_entry(kind: str, sub: object) -> tuple[str, Any]:
    """One kind's ``{'mode': ..., 'config': ...}`` checked, as (mode, config)."""
    if not isinstance(sub, Mapping):
        raise TypeError(f"comm_fusion[{kind!r}]: expected {{'mode': ..., 'config': ...}}")
    modes = "auto | size | index" if kind == "allreduce" else "auto | size"
    for key in sub:
        if key not in ENTRY_KEYS:
            raise ValueError(
                f"comm_fusion[{kind!r}]: unknown key {key!r}; valid keys: 'mode' ({modes}) "
                "and 'config' (e.g. {'mode': 'size', 'config': 32})"
            )
    if "mode" not in sub:
        raise ValueError(
            f"comm_fusion[{kind!r}]: no 'mode'; give one of {modes} (e.g. "
            "{'mode': 'size', 'config': 32}, or {'mode': 'auto'} for 64 MB buckets)"
        )
    mode, value = sub["mode"], sub.get("config")
    positive = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    if mode == "size" and not positive:
        raise ValueError(
            f"comm_fusion[{kind!r}]: mode 'size' needs config = MB > 0 (a bucket's size, "
            f"e.g. 32), got {value!r}"
        )
    if mode == "index":
        _check_index(kind, value)
    elif mode not in ("auto", "size"):
        raise ValueError(f"comm_fusion[{kind!r}]: mode {mode!r}; valid: auto | size | index")
    return str(mode), value


def check_points(points: Sequence[int] | None, count: int) -> None:
    """Refuse ``index`` split points past the network's `count` parameters (they would make
    no bucket).

    Raises:
        ValueError: naming the index and the valid range.
    """
    if points and max(points) >= count:
        raise ValueError(
            f"comm_fusion['allreduce']: index {max(points)} is past the network's last "
            f"parameter ({count} parameters, indices 0-{count - 1} in named_parameters() "
            "order)"
        )


def _check_index(kind: str, value: object) -> None:
    """``index`` mode's config: allreduce only, a list of increasing ints >= 0 (where a new
    bucket starts; whether they fit the network is checked when the buckets are made)."""
    if kind != "allreduce":
        raise ValueError(
            f"comm_fusion[{kind!r}]: mode 'index' is for 'allreduce' only (use 'size' or "
            "'auto' here)"
        )
    ints = list(value) if isinstance(value, list | tuple) else []
    if not ints or not all(isinstance(i, int) and not isinstance(i, bool) for i in ints):
        raise ValueError(
            f"comm_fusion['allreduce']: mode 'index' needs config = a list of parameter "
            f"indices where a new bucket starts, got {value!r}"
        )
    if min(ints) < 0:
        raise ValueError(
            f"comm_fusion['allreduce']: mode 'index' needs parameter indices >= 0 (counted from "
            f"0 in named_parameters() order; no negative ones), got {ints}: give the index of "
            f"each parameter where a new bucket starts"
        )
    if ints != sorted(set(ints)):
        raise ValueError(
            f"comm_fusion['allreduce']: mode 'index' needs increasing indices without repeats, "
            f"got {ints}; sort them: {sorted(set(ints))}"
        )
