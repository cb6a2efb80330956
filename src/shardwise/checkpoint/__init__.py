"""Checkpoints: safetensors files (never pickle), written atomically, per rank.

- `_io`: `save_checkpoint`, `load_checkpoint`, `Checkpoint` (the loaded dict + metadata).
- `_load`: `load_param_into_net` (MindSpore's ``(param_not_load, ckpt_not_load)``).
- `_optimizer`: optimizer state by parameter name; `load_optimizer_state`.
- `_manager`: `checkpoint_dir_for_rank`, `CheckpointManager` (naming and
  ``keep_checkpoint_max`` rotation), `latest_checkpoint`, `list_checkpoints`.
- `_format`: the file layout (keys, metadata, checksums); see docs/checkpoint.md.
"""

from shardwise.checkpoint._errors import CheckpointError
from shardwise.checkpoint._io import Checkpoint, load_checkpoint, save_checkpoint
from shardwise.checkpoint._load import load_param_into_net
from shardwise.checkpoint._manager import (
    CheckpointManager,
    checkpoint_dir_for_rank,
    checkpoint_filename,
    latest_checkpoint,
    list_checkpoints,
    parse_checkpoint_filename,
    unused_prefix,
)
from shardwise.checkpoint._optimizer import OptimizerState, load_optimizer_state

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "OptimizerState",
    "checkpoint_dir_for_rank",
    "checkpoint_filename",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_optimizer_state",
    "load_param_into_net",
    "parse_checkpoint_filename",
    "save_checkpoint",
    "unused_prefix",
]
