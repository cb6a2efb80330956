"""Where the rank files of a distributed checkpoint lie, and the folder that holds them all.

Two layouts are read: ``<folder>/rank_<r>/<file>``, what `CheckpointManager` and a
`ModelCheckpoint` of one directory for every rank write (MindSpore's layout), and
``<folder>/<r>/rank_<r>/<file>``, what a `ModelCheckpoint(directory=str(rank))` on each rank
writes (each rank's own directory, inside which the callback adds its ``rank_<r>`` folder).

- `rank_folders`: each rank's folder in a checkpoint folder of either layout.
- `checkpoint_folder`: the checkpoint folder of one rank's file (what `load_distributed` takes).
- `LAYOUTS`: the two layouts in words, for errors.
"""

from __future__ import annotations

import re
from pathlib import Path

RANK_DIR = re.compile(r"^rank_(\d+)$")
LAYOUTS = (
    "<folder>/rank_<r>/ (one checkpoint directory for all ranks) or <folder>/<r>/rank_<r>/ "
    "(ModelCheckpoint(directory=str(rank)) on each rank)"
)


def rank_folders(src: Path) -> dict[int, Path]:
    """Rank ``r``'s folder of the checkpoint folder `src`: ``src/rank_<r>`` when there are
    such folders, else ``src/<r>/rank_<r>``; empty when `src` holds neither."""
    found = {
        int(m.group(1)): p for p in src.iterdir() if p.is_dir() and (m := RANK_DIR.match(p.name))
    }
    if found:
        return found
    return {
        int(p.name): p / f"rank_{int(p.name)}"
        for p in src.iterdir()
        if p.name.isdigit() and p.is_dir() and (p / f"rank_{int(p.name)}").is_dir()
    }


def checkpoint_folder(rank_file: Path) -> Path | None:
    """The checkpoint folder holding `rank_file` and the other ranks' files of its save:
    ``X`` for ``X/rank_<r>/<file>``, or ``X``'s parent when ``X`` is named ``<r>`` and holds no
    other rank's folder (``<folder>/<r>/rank_<r>/<file>``); None for a file outside a
    ``rank_<r>`` folder.

    Args:
        rank_file: one rank's checkpoint file, as `ModelCheckpoint` saved it.

    Returns:
        The folder to give `load_distributed` (or `transform` / `merge`), or None.

    Example:
        >>> checkpoint_folder(Path("ckpt/rank_1/m-1_4.safetensors"))
        PosixPath('ckpt')
        >>> checkpoint_folder(Path("1/rank_1/m-1_4.safetensors"))  # (seed 002's layout)
        PosixPath('.')
    """
    m = RANK_DIR.match(rank_file.parent.name)
    if m is None:
        return None
    folder = rank_file.parent.parent
    own = folder.name.isdigit() and int(folder.name) == int(m.group(1))
    others = [p for p in folder.glob("rank_*") if p != rank_file.parent and p.is_dir()]
    return folder.parent if own and not others else folder
