"""``import_dcp``: a torch.distributed.checkpoint (DCP) checkpoint as a shardwise checkpoint.

A DCP folder (saved by torch's own DTensor / FSDP2 code on any number of ranks, or by
`export_dcp`) is read through DCP's public reader: ``FileSystemReader.read_metadata`` (torch's
``.metadata`` file, a pickle torch writes; shardwise's own files never are) for every tensor's
global shape, dtype and stored chunks, and ``read_data`` with a small ``LoadPlanner`` for the
values. It is then cut like any shardwise checkpoint (`_cut`, as `transform` does):

- `_open`: the reader and metadata, with clear errors for a missing or corrupt folder.
- `_Reader`: the ``LoadPlanner`` DCP's reader fills: tensors into a view of the block being
  built, other values unpickled with ``torch.load(weights_only=True)``.
- `DcpBlocks`: the checkpoint as `_cut` reads it: entry names (model entries under their
  FQNs, optimizer tensors as ``optimizer.state.<fqn>.<key>``), shapes, dtypes, the optimizer
  description (`description_from_dcp`), and `assemble`: any block of an entry, read chunk
  overlap by chunk overlap, so one block (and one stored chunk) is in memory at a time.
- `import_dcp`: the public function.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)

from shardwise.checkpoint import _format as fmt
from shardwise.checkpoint._dcp_boxes import Box, boxes
from shardwise.checkpoint._dcp_optimizer import description_from_dcp
from shardwise.checkpoint._errors import CheckpointError
from shardwise.checkpoint._manager import checkpoint_dir_for_rank
from shardwise.checkpoint._pieces import Piece
from shardwise.checkpoint._strategy import as_strategy
from shardwise.checkpoint._stream import NAMES
from shardwise.checkpoint._transform import _cut, file_work

PathLike = str | os.PathLike[str]


def _open(path: Path) -> tuple[FileSystemReader, Metadata]:
    if not path.is_dir():
        raise FileNotFoundError(f"DCP checkpoint not found: {path} is not a folder")
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path}: not a torch DCP checkpoint (no .metadata file)")
    reader = FileSystemReader(path)
    try:
        metadata = reader.read_metadata()
        entries = metadata.state_dict_metadata
        if not isinstance(entries, dict):
            raise TypeError(f"state_dict_metadata is {type(entries).__name__}")
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}/.metadata: not readable DCP metadata ({e})") from None
    reader.set_up_storage_reader(metadata, is_coordinator=True)
    return reader, metadata


class _Reader(LoadPlanner):
    """What DCP's ``read_data`` fills: `target`'s regions, and `values` for other items."""

    def __init__(self) -> None:
        self.target = torch.zeros(0)
        self.values: dict[str, Any] = {}

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        """Not used: items are planned by `DcpBlocks`."""

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan([])

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"DCP value {read_item.dest_index.fqn!r} is not plain data ({e})"
            ) from None

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        offsets = tuple(read_item.dest_offsets)
        box = Box(offsets, tuple(read_item.lengths), offsets)
        return box.view(self.target)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Nothing to do: `resolve_tensor` gave a view of the target."""


class DcpBlocks:
    """A DCP checkpoint as shardwise entries, read block by block.

    Args:
        path: the DCP folder.
        model_key: None: model entries are the top-level tensors; else those under this key.
        optimizer_key: the optimizer's top-level key (None: no optimizer state).
        class_name: the optimizer's class name (needed when the checkpoint holds its state).
    """

    def __init__(
        self,
        path: Path,
        model_key: str | None,
        optimizer_key: str | None,
        class_name: str | None,
    ) -> None:
        self.reader, self.md = _open(path)
        self.paths = [Path(path)]  # (a destination may not hold it)
        self.loader = _Reader()
        entries = self.md.state_dict_metadata
        opt = None if optimizer_key is None else f"{optimizer_key}."
        model = None if model_key is None else f"{model_key}."
        self.dcp_key: dict[str, str] = {}
        for key, value in entries.items():
            tensor = isinstance(value, TensorStorageMetadata)
            if tensor and not (opt and key.startswith(opt)) and key.startswith(model or ""):
                self.dcp_key[key[len(model or "") :]] = key
        if not self.dcp_key:
            raise CheckpointError(
                f"{path}: no model tensors" + (f" under {model_key!r}" if model else "")
                + f" (its keys: {list(entries)[:4]}); pass model_key= the top-level key "
                "the model was saved under"
            )  # fmt: skip
        self.metadata = {fmt.KEY_VERSION: fmt.FORMAT_VERSION}
        opt_keys = {k: isinstance(v, TensorStorageMetadata) for k, v in entries.items()
                    if opt and k.startswith(opt)}  # fmt: skip
        if opt_keys:
            self._add_optimizer(path, opt_keys, opt or "", class_name)
        self.names = list(self.dcp_key)
        for key in self.names:
            if self._meta(key).properties.dtype not in NAMES:
                raise CheckpointError(f"DCP tensor {self.dcp_key[key]!r}: dtype not supported")

    def _add_optimizer(
        self, path: Path, keys: dict[str, bool], prefix: str, class_name: str | None
    ) -> None:
        if class_name is None:
            raise CheckpointError(
                f"{path} holds optimizer state, which DCP saves without the optimizer's class; "
                "pass optimizer_class= (e.g. torch.optim.AdamW), or optimizer=False"
            )
        fqns = list(self.dcp_key)
        description, tensors = description_from_dcp(keys, self._values, prefix, fqns, class_name)
        self.dcp_key |= tensors
        self.metadata[fmt.KEY_OPTIMIZER] = json.dumps(description)

    def _values(self, keys: list[str]) -> dict[str, Any]:
        items = [
            ReadItem(LoadItemType.BYTE_IO, MetadataIndex(k), torch.Size(), MetadataIndex(k),
                     torch.Size(), torch.Size())
            for k in keys
        ]  # fmt: skip
        self.loader.values = {}
        self.reader.read_data(LoadPlan(items), self.loader).wait()
        return self.loader.values

    def _meta(self, key: str) -> TensorStorageMetadata:
        meta = self.md.state_dict_metadata[self.dcp_key[key]]
        assert isinstance(meta, TensorStorageMetadata)
        return meta

    def shape(self, key: str) -> tuple[int, ...]:
        """Entry `key`'s global shape."""
        return tuple(self._meta(key).size)

    def dtype(self, key: str) -> torch.dtype:
        """Entry `key`'s dtype."""
        return self._meta(key).properties.dtype

    def assemble(self, key: str, target: Piece, buffers: object = None) -> torch.Tensor:
        """The block `target` of entry `key`, read from the DCP chunks overlapping it (a new
        tensor; `buffers` is not used)."""
        fqn = self.dcp_key[key]
        items = _read_items(fqn, self._meta(key), target)
        got = sum(math.prod(i.lengths) for i in items)
        if got != target.size:
            raise CheckpointError(
                f"DCP tensor {fqn!r}: its chunks hold {got} of the {target.size} elements of "
                f"{target}; the checkpoint's metadata is inconsistent"
            )
        self.loader.target = torch.zeros(target.local_shape, dtype=self.dtype(key))
        self.reader.read_data(LoadPlan(items), self.loader).wait()
        out, self.loader.target = self.loader.target, torch.zeros(0)
        return out


def _read_items(fqn: str, meta: TensorStorageMetadata, target: Piece) -> list[ReadItem]:
    """A read item for each part of a stored chunk inside a rectangle of `target`."""
    items = []
    for box in boxes(target):
        for chunk in meta.chunks:
            part = box.overlap(chunk.offsets, chunk.sizes)
            if part is None:
                continue
            start = [a - b for a, b in zip(part.offsets, chunk.offsets, strict=True)]
            items.append(
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(fqn, torch.Size(part.offsets)),
                    dest_offsets=torch.Size(part.local),
                    storage_index=MetadataIndex(fqn, chunk.offsets),
                    storage_offsets=torch.Size(start),
                    lengths=torch.Size(part.lengths),
                )
            )
    return items


@file_work
def import_dcp(
    dcp_dir: PathLike,
    dst_dir: PathLike,
    dst_strategy: object = None,
    *,
    name: str = "checkpoint.safetensors",
    optimizer: bool = True,
    optimizer_class: type[torch.optim.Optimizer] | str | None = None,
    model_key: str | None = None,
    optimizer_key: str = "optimizer",
    overwrite: bool = False,
    progress: bool | None = None,
) -> Path:
    """Write a torch DCP checkpoint as a shardwise checkpoint cut by `dst_strategy`.

    Reads what torch's DTensor / FSDP2 code saved with ``dcp.save`` (on any number of ranks)
    or what `export_dcp` wrote: model tensors under their FQNs, and the optimizer state of
    ``get_optimizer_state_dict`` (either layout) as shardwise's, for `load_optimizer_state`
    and `load_distributed`. DCP's ``.metadata`` is a pickle (torch's format, read by torch's
    own reader): import only checkpoints you trust, as with ``dcp.load``.

    Args:
        dcp_dir: the DCP folder (``.metadata`` plus data files).
        dst_dir: where to write (``dst_dir/rank_<r>/<name>``, or ``dst_dir/<name>`` for one
            device). Must not exist unless `overwrite`.
        dst_strategy: the destination's cut, as for `transform` (None: one device).
        name: the destination files' name.
        optimizer: also import the optimizer state (when the checkpoint holds one).
        optimizer_class: the optimizer's class (or its name), which DCP does not record;
            required when importing optimizer state.
        model_key: None: the model's tensors are the top-level ones (torchtitan); else the
            top-level key they were saved under (``dcp.save({"model": ...})``: ``"model"``).
        optimizer_key: the optimizer's top-level key.
        overwrite: replace an existing `dst_dir` (only once the new one is complete).
        progress: show a progress bar (default: for checkpoints of 64 MB or more).

    Returns:
        `dst_dir`.

    Example:
        >>> sw.checkpoint.import_dcp("step-100", "ckpt", 4, model_key="model",
        ...                          optimizer_class=torch.optim.AdamW)  # doctest: +SKIP
    """
    if isinstance(optimizer_class, type):
        optimizer_class = optimizer_class.__qualname__
    source = DcpBlocks(Path(dcp_dir), model_key, optimizer_key if optimizer else None,
                       optimizer_class)  # fmt: skip
    dst = as_strategy(dst_strategy)

    def path_of(tmp: Path, rank: int) -> Path:
        return checkpoint_dir_for_rank(tmp, rank, dst.device_num) / name

    _cut(source, dst, Path(dst_dir), path_of, overwrite=overwrite, progress=progress)
    return Path(dst_dir)
