"""Global settings shared by every rank: `set_seed`, `set_context` / `get_context`.

`set_seed(seed)` seeds Python's `random`, NumPy (when installed) and torch (CPU and every CUDA
device) identically on every rank, and makes CPU runs bit-for-bit repeatable. `torch_seeded()`
says whether the script seeded torch: until then torch's seed is a random number of each
process, so a dataset takes MindSpore's constant default seed instead (`shardwise.dataset`).

`set_context(save_graphs=..., save_graphs_path=...)` holds the report settings (MindSpore's
``set_context`` keys of the same names): `shardwise.report.dump_parallel_plan` reads them when
`AutoParallel` plans and writes ``<save_graphs_path>/rank_<r>/{step_parallel_begin,execute}.ir``
(docs/report.md). `get_context(name)` reads one setting back.
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch

_seed: int | None = None

_AT_IMPORT = torch.initial_seed()  # (torch's seed when this module was first imported)
_RANDOM_SEEDS = 1 << 32
"""torch draws its own seed from 64 random bits: one below this was set by the script (but for
a chance of 1 in 2**32)."""

_SEED_BOUND = 1 << 64  # (torch.manual_seed takes seeds below it)

_CONTEXT: dict[str, Any] = {"save_graphs": 0, "save_graphs_path": "./saved_graph"}


def set_seed(seed: int) -> None:
    """Seed every random number generator shardwise and the user's script draw from.

    Every rank gets the same seed (as in MindSpore's ``set_seed``): identical initial weights
    and identical data order on every rank; per-rank randomness (dropout masks of sharded
    tensors) is derived from it by the parallel layers, never by re-seeding.

    Args:
        seed: a non-negative integer below 2**64 (torch's range).

    Raises:
        ValueError: `seed` is not a non-negative int below 2**64.

    Example:
        >>> sw.set_seed(1)
        >>> a = torch.rand(2); sw.set_seed(1); torch.equal(a, torch.rand(2))
        True
    """
    global _seed
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"set_seed: seed={seed!r} must be a non-negative int")
    if seed >= _SEED_BOUND:  # (checked before any generator is seeded)
        raise ValueError(
            f"set_seed: seed={seed} is too large: torch takes seeds below 2**64 (at most "
            f"{_SEED_BOUND - 1}); give a smaller seed, e.g. seed % 2**64"
        )
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    else:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    _seed = seed


def get_seed() -> int | None:
    """The seed given to the last `set_seed`, or None."""
    return _seed


def torch_seeded() -> bool:
    """Whether the script seeded torch (`set_seed`, or ``torch.manual_seed`` with a seed below
    2**32, before or after importing shardwise, or with any seed once this module was imported):
    else torch's seed is the random one it drew for this process, different on every rank.

    Example:
        >>> sw.set_seed(1); torch_seeded()
        True
    """
    seed = torch.initial_seed()
    return _seed is not None or seed < _RANDOM_SEEDS or seed != _AT_IMPORT


def random_start() -> tuple[torch.Tensor, int]:
    """This process's torch random state and its seed when shardwise was imported (what
    `take_random_start` gives another rank)."""
    return torch.get_rng_state(), _AT_IMPORT


def take_random_start(state: torch.Tensor, at_import: int) -> None:
    """Take another rank's `random_start` (rank 0's, at ``communication.init``): the same
    random stream, and the same answer from `torch_seeded`."""
    global _AT_IMPORT
    torch.set_rng_state(state)
    _AT_IMPORT = at_import


def set_context(
    *,
    save_graphs: int | bool | None = None,
    save_graphs_path: str | os.PathLike[str] | None = None,
) -> None:
    """Set global options (MindSpore's ``set_context``); an argument left None is unchanged.

    Args:
        save_graphs: report level. 0: no report; 1: per rank ``step_parallel_begin.ir`` (every
            primitive call with its global shapes and strategies) and ``execute.ir`` (local
            shapes and every inserted communication op with its rank group); 2: adds bytes per
            communication and this rank's block of every tensor; 3: adds every rank's block
            (the slice table). ``True`` / ``False`` mean 1 / 0, as in MindSpore.
        save_graphs_path: the directory the reports go under (``rank_<r>/`` per rank), created
            when written; default ``"./saved_graph"``.

    Raises:
        ValueError: `save_graphs` is not 0, 1, 2, 3 or a bool; `save_graphs_path` is empty.
        TypeError: `save_graphs_path` is not a str or os.PathLike.

    Example:
        >>> sw.set_context(save_graphs=2, save_graphs_path="./saved_graph")
        >>> sw.get_context("save_graphs")
        2
    """
    if save_graphs is not None:
        if isinstance(save_graphs, bool):
            save_graphs = int(save_graphs)
        if not isinstance(save_graphs, int) or save_graphs not in (0, 1, 2, 3):
            raise ValueError(
                f"set_context: save_graphs={save_graphs!r} must be 0, 1, 2, 3 (or a bool)"
            )
    if save_graphs_path is not None:
        if not isinstance(save_graphs_path, str | os.PathLike):
            raise TypeError(
                f"set_context: save_graphs_path={save_graphs_path!r} must be a str or "
                f"os.PathLike, not {type(save_graphs_path).__name__}"
            )
        if not os.fspath(save_graphs_path):
            raise ValueError("set_context: save_graphs_path must not be empty")
    if save_graphs is not None:
        _CONTEXT["save_graphs"] = save_graphs
    if save_graphs_path is not None:
        _CONTEXT["save_graphs_path"] = os.fspath(save_graphs_path)


def get_context(name: str) -> Any:
    """The value of one `set_context` option (``"save_graphs"``, ``"save_graphs_path"``).

    Raises:
        ValueError: unknown option (the message lists the known ones).
    """
    if name not in _CONTEXT:
        raise ValueError(f"get_context: unknown option {name!r}; known: {sorted(_CONTEXT)}")
    return _CONTEXT[name]
