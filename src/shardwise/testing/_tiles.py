"""Which sub-groups a simulated world can run, and on which ranks.

LocalTensorMode runs a collective on a sub-group on every translate of it at once, like a mesh
axis: a group's ranks shifted by a constant, the copies partitioning the world (``[0, 2]`` of 4
ranks runs on ``[0, 2]`` and ``[1, 3]``). `tiles` gives those copies; `check_tiles` is the
ValueError `create_group` raises for a rank set that is not one of them.
"""

from __future__ import annotations

from collections.abc import Sequence


def _partition(ranks: Sequence[int], world_size: int) -> list[list[int]] | None:
    """The translates of `ranks` that partition ``range(world_size)``, or None if none do
    (each uncovered rank, lowest first, must start a copy: the partition is unique)."""
    base = sorted(ranks)
    shifted = [r - base[0] for r in base]
    covered: set[int] = set()
    out: list[list[int]] = []
    for start in range(world_size):
        if start in covered:
            continue
        tile = [start + s for s in shifted]
        if tile[-1] >= world_size or covered.intersection(tile):
            return None
        covered.update(tile)
        out.append(tile)
    return out


def tiles(ranks: Sequence[int], world_size: int) -> list[list[int]] | None:
    """The copies of the group `ranks` that a simulated world runs at once: its translates
    that partition ``range(world_size)``, `ranks` among them; None if there are none (the
    translates overlap or leave ranks out, or they skip `ranks` itself, as ``[1, 2]`` of 4,
    whose translates ``[0, 1]`` and ``[2, 3]`` tile the world).

    Example:
        >>> tiles([0, 2], 4)
        [[0, 2], [1, 3]]
        >>> tiles([3, 1], 4)
        [[0, 2], [1, 3]]
        >>> tiles([1, 2], 4) is None
        True
    """
    found = _partition(ranks, world_size)
    return found if found is not None and sorted(ranks) in found else None


def check_tiles(name: str, ranks: Sequence[int], world_size: int) -> None:
    """Raise a ValueError naming the group, its ranks and the fix unless `ranks` is one of the
    copies `tiles` gives."""
    if tiles(ranks, world_size) is not None:
        return
    ranks = sorted(ranks)
    found = _partition(ranks, world_size)
    if found is None:
        why = f"no translates of {ranks} tile the {world_size} ranks"
    else:
        copies = ", ".join(str(t) for t in found)
        why = (
            f"the translates of {ranks} that tile the {world_size} ranks are {copies}, and "
            f"{ranks} is not one of them (it would run as {found[0]}); name one of those"
        )
    raise ValueError(
        f"create_group({name!r}): ranks {ranks} cannot be simulated: in simulated_world("
        f"{world_size}) a group runs on all its translates at once, so they must tile the world "
        f"like a mesh axis ([0, 2] of 4 ranks runs on [0, 2] and [1, 3]); {why}, or give each "
        "rank its group with communication.own_group(lambda r: ...), or test this group in a "
        "real job (shardwise.testing.run_job)"
    )
