"""``export_dcp``: a shardwise checkpoint written in torch.distributed.checkpoint (DCP)'s format.

One process acts for every source rank: each distinct stored block of an entry becomes DCP
chunks at its global offsets (`boxes`: one per range combination of a strided block, padding
cut off; a zero-element entry: one empty chunk, as torch's ``dcp.save`` writes it), so torch's
own ``dcp.load`` reads it into DTensors of any mesh and placement, or into plain tensors.
Everything goes through DCP's public extension points:

- `_ExportPlanner`: a ``DefaultSavePlanner`` whose local plan is a write item per chunk and per
  non-tensor optimizer value (`_write_items`), and whose `resolve_data` reads a block only when
  DCP writes it (the last block read is kept for its other chunks), so memory stays bounded.
- `_model_leaves` / `_optimizer_leaves` (`torch_leaves`): which DCP key (and nested path,
  DCP's ``planner_data``) each model entry and optimizer value gets.
- `export_dcp`: the public function; ``FileSystemWriter`` writes one data file per chunk (it
  holds a file's tensors until the file is done) into a hidden folder, renamed into place at
  the end.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.state_dict_saver import save

from shardwise.checkpoint import _format as fmt
from shardwise.checkpoint._dcp_boxes import Box, boxes
from shardwise.checkpoint._dcp_optimizer import KeyPath, Ref, torch_leaves
from shardwise.checkpoint._errors import CheckpointError
from shardwise.checkpoint._publish import publish
from shardwise.checkpoint._sources import SourceSet
from shardwise.checkpoint._transform import file_work

PathLike = str | os.PathLike[str]


def _model_leaves(source: SourceSet, model_key: str | None) -> list[tuple[KeyPath, Any]]:
    keys = source.model_names
    return [((k,) if model_key is None else (model_key, k), Ref(k)) for k in keys]


def _optimizer_leaves(source: SourceSet, key: str, flatten: bool) -> list[tuple[KeyPath, Any]]:
    """The optimizer's leaves; without a description (a dict saved with ``optimizer.*``
    entries), its tensors under their own names."""
    where = source.files[0].index.path
    description = fmt.parse_json(where, source.metadata, fmt.KEY_OPTIMIZER)
    if description is not None:
        return torch_leaves(description, key, flatten)
    keys = [k for k in source.names if source.is_optimizer(k)]
    return [((key, k[len(fmt.OPTIMIZER_PREFIX) :]), Ref(k)) for k in keys]


class _ExportPlanner(DefaultSavePlanner):
    """Write items for every chunk of every source block and every non-tensor value."""

    def __init__(self, source: SourceSet, leaves: Sequence[tuple[KeyPath, Any]]) -> None:
        super().__init__(flatten_state_dict=True)
        self.source = source
        self.chunks: dict[MetadataIndex, tuple[str, int, Box]] = {}
        self.empty: dict[MetadataIndex, torch.Tensor] = {}  # (zero-element entries)
        self.values: dict[str, Any] = {}
        self.items: list[WriteItem] = []
        self.paths = {".".join(map(str, path)): path for path, _ in leaves}
        for path, value in leaves:
            self._add(".".join(map(str, path)), value)
        self.cached: tuple[str, int, torch.Tensor] | None = None

    def _add(self, fqn: str, value: Any) -> None:
        if not isinstance(value, Ref):
            if isinstance(value, tuple | list) and any(isinstance(v, Ref) for v in value):
                raise CheckpointError(f"{fqn!r}: tensors inside a {type(value).__name__}")
            self.values[fqn] = value
            self.items.append(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO))
            return
        key = value.key
        shape, dtype = torch.Size(self.source.shape(key)), self.source.dtype(key)
        if shape.numel() == 0:  # (no elements, so no block has any: one empty chunk, as torch)
            origin = torch.Size([0] * len(shape))
            index = MetadataIndex(fqn, origin)
            data = TensorWriteData(
                ChunkStorageMetadata(origin, shape), TensorProperties(dtype=dtype), shape
            )
            self.empty[index] = torch.empty(shape, dtype=dtype)
            self.items.append(WriteItem(index, WriteItemType.SHARD, tensor_data=data))
            return
        for piece, rank in self.source.holders(key).items():
            for box in boxes(piece):
                index = MetadataIndex(fqn, torch.Size(box.offsets))
                chunk = ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.lengths))
                data = TensorWriteData(chunk, TensorProperties(dtype=dtype), shape)
                self.chunks[index] = (key, rank, box)
                self.items.append(WriteItem(index, WriteItemType.SHARD, tensor_data=data))

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self.items, planner_data=self.paths)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(self.values[write_item.index.fqn], buffer)
            buffer.seek(0)
            return buffer
        if write_item.index in self.empty:
            return self.empty[write_item.index]
        key, rank, box = self.chunks[write_item.index]
        if self.cached is None or self.cached[:2] != (key, rank):
            self.cached = None  # (drop the last block before reading the next)
            self.cached = (key, rank, self.source.read(key, rank))
        return box.view(self.cached[2]).clone()


@file_work
def export_dcp(
    src_dir: PathLike,
    dcp_dir: PathLike,
    *,
    optimizer: bool = True,
    model_key: str | None = None,
    optimizer_key: str = "optimizer",
    flatten_optimizer: bool = False,
    src_strategy: object = None,
    name: str | None = None,
    prefix: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a shardwise checkpoint (any cut, any rank count) in torch DCP's format.

    Each stored block becomes DCP chunks at its global offsets, so torch's
    ``torch.distributed.checkpoint.load`` reads it into DTensors of any mesh and placement
    (FSDP2's ``Shard(0)``, tensor parallel) or, with ``no_dist=True``, into plain tensors.

    Args:
        src_dir: the shardwise checkpoint (``rank_<r>/`` folders, or one rank's file(s)).
        dcp_dir: the DCP folder to create (``.metadata`` plus ``.distcp`` data files).
        optimizer: also write the optimizer state, as DCP saves ``get_optimizer_state_dict``:
            ``optimizer.state.<fqn>.<key>`` tensors and ``optimizer.param_groups.<i>.<key>``.
        model_key: None: model entries at the top level (torchtitan's layout); a key (e.g.
            ``"model"``): under it, as ``dcp.save({"model": ..., "optimizer": ...})`` saves.
        optimizer_key: the optimizer's top-level key.
        flatten_optimizer: torch's ``flatten_optimizer_state_dict=True`` layout (torchtitan):
            ``optimizer.param_groups.<fqn>.<key>``.
        src_strategy, name, prefix: as for `transform`.
        overwrite: replace an existing `dcp_dir` (only once the new one is complete).

    Returns:
        `dcp_dir`.

    Example:
        >>> sw.checkpoint.export_dcp("ckpt_8", "ckpt_dcp")  # doctest: +SKIP
        >>> dcp.load({"model": model_sd}, checkpoint_id="ckpt_dcp")  # in torch  # doctest: +SKIP
    """
    source = SourceSet(Path(src_dir), name, prefix, src_strategy)
    leaves = _model_leaves(source, model_key)
    if optimizer:
        leaves += _optimizer_leaves(source, optimizer_key, flatten_optimizer)
    planner = _ExportPlanner(source, leaves)
    out = Path(dcp_dir)
    with publish(out, overwrite) as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        writer = FileSystemWriter(tmp, single_file_per_rank=False, thread_count=1)
        try:
            save({}, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as e:  # (not an Exception: torch wraps what a read raised)
            raise _cause(e) from e
    return out


def _cause(e: CheckpointException) -> Exception:
    """The error a source read raised inside torch's save (a corrupt block's CheckpointError,
    an OSError), else a CheckpointError with torch's report."""
    for failure, _ in e.failures.values():
        if isinstance(failure, Exception):
            return failure
    return CheckpointError(f"torch's DCP save failed: {e}")
