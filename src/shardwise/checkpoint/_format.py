"""The on-disk format of shardwise checkpoints: safetensors plus string metadata.

A checkpoint is one ``.safetensors`` file (never a pickle). Tensor keys:

- model entries under their own names (``layer1.weight`` ...);
- optimizer tensors under ``optimizer.state.<param name>.<state key>`` and, for tensor-valued
  hyperparameters, ``optimizer.param_groups.<group index>.<key>``.

Metadata (all strings): ``format`` = ``pt``; ``shardwise.version``; ``shardwise.step`` and
``shardwise.epoch`` (decimal); ``shardwise.extra`` (JSON); ``shardwise.optimizer`` (JSON:
optimizer class, param groups with parameter *names*, non-tensor state, and which keys
hold its tensors); ``shardwise.checksums`` (JSON ``{key: crc32}`` of every tensor's bytes).
A rank's file of a parallel job also records how it was cut: ``shardwise.rank``,
``shardwise.device_num``, ``shardwise.strategy`` (JSON: the parameter strategy file of the
plan) and ``shardwise.pieces`` (JSON ``{key: piece}`` for every entry that is not whole).

- `saveable`: detach, move to CPU, make contiguous and unshared (safetensors' rules).
- `checksum`: CRC-32 of a tensor's bytes.
- `encode_value` / `decode_value`: JSON with tuples and tensors kept apart (markers,
  `tensor_ref`).
- `parse_int`, `parse_json`: read metadata back, naming the file on errors.
"""

from __future__ import annotations

import ctypes
import json
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from shardwise import communication as comm
from shardwise.checkpoint._errors import CheckpointError

FORMAT_VERSION = "1"
KEY_VERSION = "shardwise.version"
KEY_STEP = "shardwise.step"
KEY_EPOCH = "shardwise.epoch"
KEY_EXTRA = "shardwise.extra"
KEY_OPTIMIZER = "shardwise.optimizer"
KEY_CHECKSUMS = "shardwise.checksums"
KEY_RANK = "shardwise.rank"
KEY_DEVICE_NUM = "shardwise.device_num"
KEY_STRATEGY = "shardwise.strategy"
KEY_PIECES = "shardwise.pieces"
OPTIMIZER_PREFIX = "optimizer."

_TUPLE = "__tuple__"
_TENSOR = "__tensor__"


def saveable(name: str, tensor: object, seen: set[int]) -> torch.Tensor:
    """A CPU, contiguous tensor that shares memory with nothing already in ``seen``.

    Args:
        name: the key, for error messages.
        tensor: the value to store.
        seen: storage addresses already used by other entries (updated).

    Returns:
        The tensor to hand to safetensors (a copy only when needed).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"checkpoint entry {name!r} must be a tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(
            f"checkpoint entry {name!r} is a {tensor.layout} tensor, and safetensors stores "
            "dense tensors only: save its .to_dense() (a module's sparse buffer: save a dict of "
            "its state_dict with that entry made dense)"
        )
    if tensor.is_meta:
        raise CheckpointError(
            f"checkpoint entry {name!r} is a meta tensor (deferred, never materialized); "
            "call shardwise.parameter.materialize(net) or run a forward first"
        )
    shared = comm.shared_value(tensor.detach())
    if shared is None:
        raise CheckpointError(
            f"checkpoint entry {name!r} holds different values on the ranks this process runs "
            f"({len(comm.process_ranks())} ranks: a simulated world), and one file holds one "
            "value: save from a real job (one file per rank), or write each rank's file from "
            "its values, `{k: sw.communication.rank_parts(v)[r] for k, v in "
            "net.state_dict().items()}` to directory/rank_<r>"
        )
    value = shared.to("cpu").contiguous()
    if value.numel() == 0:
        return value
    storage = value.untyped_storage()
    whole = value.storage_offset() == 0 and storage.nbytes() == value.numel() * value.itemsize
    if storage.data_ptr() in seen or not whole:
        value = value.clone()
    seen.add(value.untyped_storage().data_ptr())
    return value


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes (row-major, CPU), read in place (no copy, no NumPy)."""
    flat = tensor.detach().to("cpu").contiguous()
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return zlib.crc32(b"")
    return zlib.crc32((ctypes.c_char * nbytes).from_address(flat.data_ptr()))


def encode_value(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """A JSON-ready form of ``value``; tensors go to ``tensors[key...]`` and leave a marker."""
    if isinstance(value, torch.Tensor):
        tensors[key] = value
        return {_TENSOR: key}
    if isinstance(value, tuple):
        return {_TUPLE: [encode_value(v, f"{key}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode_value(v, f"{key}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"cannot store {key!r}: dict keys must be strings")
        return {k: encode_value(v, f"{key}.{k}", tensors) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"cannot store {key!r} of type {type(value).__name__} in a checkpoint")


def tensor_ref(key: str) -> dict[str, str]:
    """The marker `encode_value` leaves for the tensor stored as entry `key`."""
    return {_TENSOR: key}


def decode_value(value: Any, tensors: Mapping[str, Any]) -> Any:
    """Inverse of `encode_value` (each marker replaced by ``tensors[key]``)."""
    if isinstance(value, list):
        return [decode_value(v, tensors) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            return tensors[value[_TENSOR]]
        if set(value) == {_TUPLE}:
            return tuple(decode_value(v, tensors) for v in value[_TUPLE])
        return {k: decode_value(v, tensors) for k, v in value.items()}
    return value


def check_count(name: str, value: int | None) -> None:
    """``step`` / ``epoch`` must be None or an int >= 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0 or None, got {value!r}")


def parse_int(path: Path, metadata: Mapping[str, str], key: str) -> int | None:
    """Read an integer metadata entry (None when absent)."""
    if key not in metadata:
        return None
    try:
        return int(metadata[key])
    except ValueError as exc:
        raise CheckpointError(f"{path}: metadata {key!r} is not an integer") from exc


def parse_json(path: Path, metadata: Mapping[str, str], key: str) -> Any:
    """Read a JSON metadata entry (None when absent)."""
    if key not in metadata:
        return None
    try:
        return json.loads(metadata[key])
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: metadata {key!r} is not valid JSON ({exc})") from exc
