"""MindSpore's names and arguments for `_transform.transform` and `_transform.merge`.

- `transform_checkpoints`: re-cut every rank's checkpoint for another strategy file.
- `unified_safetensors`: merge a distributed checkpoint into one file of whole tensors.

Both are file-to-file work (`_transform.file_work`): in a simulated world as outside it.
"""

from __future__ import annotations

from pathlib import Path

from shardwise.checkpoint._sources import SourceSet
from shardwise.checkpoint._strategy import CheckpointStrategy, as_strategy
from shardwise.checkpoint._transform import PathLike, _cut, file_work


@file_work
def transform_checkpoints(
    src_checkpoints_dir: PathLike,
    dst_checkpoints_dir: PathLike,
    ckpt_prefix: str,
    src_strategy_file: PathLike | None = None,
    dst_strategy_file: PathLike | None = None,
    *,
    overwrite: bool = False,
) -> None:
    """MindSpore's ``transform_checkpoints``: re-cut every rank's checkpoint for another
    strategy, as ``dst_checkpoints_dir/rank_<r>/<ckpt_prefix><r>.safetensors``.

    Args:
        src_checkpoints_dir: the source (``rank_<r>/`` folders, one checkpoint file each).
        dst_checkpoints_dir: the destination folder (created; must not exist).
        ckpt_prefix: the destination files' prefix.
        src_strategy_file: the source's strategy file; None: as the files record it (or
            whole tensors, MindSpore's "not sliced").
        dst_strategy_file: the destination's strategy file; None: one device, whole tensors.
            A parameter it leaves out is whole in every file (a `UserWarning` names those
            its plan cuts, left out by ``only_trainable_params=True``).
        overwrite: replace an existing destination.

    Example:
        >>> sw.transform_checkpoints("src", "dst", "ckpt_", "a.json", "b.json")  # doctest: +SKIP
    """
    source = SourceSet(Path(src_checkpoints_dir), strategy=src_strategy_file)

    def path_of(tmp: Path, rank: int) -> Path:
        return tmp / f"rank_{rank}" / f"{ckpt_prefix}{rank}.safetensors"

    dst = as_strategy(dst_strategy_file)
    _cut(source, dst, Path(dst_checkpoints_dir), path_of, overwrite=overwrite)


@file_work
def unified_safetensors(
    src_dir: PathLike,
    src_strategy_file: PathLike | None,
    dst_dir: PathLike,
    *,
    file_name: str = "unified.safetensors",
    overwrite: bool = False,
) -> Path:
    """MindSpore's ``unified_safetensors``: merge a distributed checkpoint's slices into whole
    tensors, written as ``dst_dir/<file_name>`` (model and optimizer entries).

    Args:
        src_dir: the distributed checkpoint (``rank_<r>/`` folders).
        src_strategy_file: its strategy file (None: as the files record it).
        dst_dir: the folder to create.
        file_name: the merged file's name.
        overwrite: replace an existing `dst_dir`.

    Returns:
        The merged file's path.
    """
    source = SourceSet(Path(src_dir), strategy=src_strategy_file)
    single = CheckpointStrategy.single()
    _cut(source, single, Path(dst_dir), lambda tmp, r: tmp / file_name, overwrite=overwrite)
    return Path(dst_dir) / file_name
