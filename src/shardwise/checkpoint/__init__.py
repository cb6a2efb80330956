"""Checkpoints: safetensors files (never pickle), written atomically, per rank.

- `_io`: `save_checkpoint`, `load_checkpoint`, `Checkpoint` (the loaded dict + metadata).
- `_load`: `load_param_into_net` (MindSpore's ``(param_not_load, ckpt_not_load)``).
- `_optimizer`: optimizer state by parameter name; `load_optimizer_state`.
- `_manager`: `checkpoint_dir_for_rank`, `CheckpointManager` (naming and
  ``keep_checkpoint_max`` rotation), `latest_checkpoint`, `list_checkpoints`.
- `_format`: the file layout (keys, metadata, checksums); see docs/checkpoint.md.

Checkpoints across plans and device counts (each rank's file records its cut):

- `_pieces`: which part of a global tensor an entry holds (`Piece`), copying overlaps.
- `_strategy`: `CheckpointStrategy`, a job's cut (from a plan, a strategy file, a count).
- `_describe`: what a rank's file records when saved from a planned network.
- `_stream`: safetensors read and written one tensor at a time.
- `_layouts`: where the rank files lie (``rank_<r>/`` or ``<r>/rank_<r>/``),
  `checkpoint_folder` (the folder of all ranks' files, from one rank's file).
- `_sources`: `SourceSet`, the rank files of one checkpoint, checked and assembled.
- `_publish`: a destination written in a hidden place and published whole.
- `_transform`: `transform`, `merge`; `_mindspore`: MindSpore's `transform_checkpoints` and
  `unified_safetensors`.
- `_distributed`: `load_distributed`, any checkpoint into a network's current plan.

torch.distributed.checkpoint (DCP) interop:

- `_dcp_boxes`: a stored block as DCP's rectangular chunks.
- `_dcp_optimizer`: optimizer state between shardwise's description and DCP's keys.
- `_dcp_export`: `export_dcp`, a shardwise checkpoint in DCP's format.
- `_dcp_import`: `import_dcp`, a DCP checkpoint (torch's FSDP2 / DTensor saves) as shardwise's.
"""

from shardwise.checkpoint._dcp_export import export_dcp
from shardwise.checkpoint._dcp_import import import_dcp
from shardwise.checkpoint._distributed import load_distributed
from shardwise.checkpoint._errors import CheckpointError
from shardwise.checkpoint._io import Checkpoint, load_checkpoint, save_checkpoint
from shardwise.checkpoint._layouts import checkpoint_folder
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
from shardwise.checkpoint._mindspore import transform_checkpoints, unified_safetensors
from shardwise.checkpoint._optimizer import OptimizerState, load_optimizer_state
from shardwise.checkpoint._strategy import CheckpointStrategy, ShardSpec
from shardwise.checkpoint._transform import merge, transform

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointStrategy",
    "OptimizerState",
    "ShardSpec",
    "checkpoint_dir_for_rank",
    "checkpoint_filename",
    "checkpoint_folder",
    "export_dcp",
    "import_dcp",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_distributed",
    "load_optimizer_state",
    "load_param_into_net",
    "merge",
    "parse_checkpoint_filename",
    "save_checkpoint",
    "transform",
    "transform_checkpoints",
    "unified_safetensors",
    "unused_prefix",
]
