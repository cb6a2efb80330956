"""Rank files holding the same piece of an entry with different values (`_sources.SourceSet`'s
check): which entries may differ, and what to do about those that may not.

- `per_rank_buffer`: a buffer of files that each hold the whole network (a data_parallel job,
  whose BatchNorm keeps per-rank running statistics, as DDP without SyncBatchNorm), told from
  the parameters by the optimizer description saved with them; rank 0's is read.
- `replicas_fix`: the fix named when the values of an entry that may not differ do.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from shardwise.checkpoint._strategy import CheckpointStrategy, owner_of


def per_rank_buffer(
    key: str, description: Mapping[str, Any] | None, optimizer_keys: Collection[str]
) -> bool:
    """Whether entry `key` of whole-network rank files (no cut recorded or given) is a buffer:
    the files' optimizer `description` lists the parameters, `key` is neither one of them nor
    optimizer state (False without a description: parameters and buffers are not told apart)."""
    if description is None or key in optimizer_keys:
        return False
    groups = description.get("param_groups", ())
    return not any(key in g.get("params", ()) for g in groups)


def replicas_fix(key: str, given: CheckpointStrategy | None, recorded: bool) -> str:
    """What to do about blocks of `key` read as one piece that hold different values (`given`:
    the src_strategy passed; `recorded`: the files record their cut)."""
    if given is None:
        fix = (
            "rank files that do not record their cut (saved from a dict or state_dict, or by "
            "another tool) need src_strategy= (the job's parameter strategy file)"
        )
        if recorded:
            return fix
        return fix + (
            "; a buffer each rank keeps its own of (BatchNorm's running statistics under "
            "parallel_mode='data_parallel') is told from the parameters by the optimizer saved "
            "with the files (save_checkpoint(..., optimizer=opt)), and rank 0's is then read; "
            "or load rank 0's file alone (sw.load_param_into_net(net, sw.load_checkpoint(path"
            "/rank_0/...)): each file holds the whole network)"
        )
    owner = owner_of(key)
    if owner not in given.params:
        return (
            f"the given src_strategy has no parameter {owner!r}, so each file's block was "
            "read as the whole tensor: save the strategy file again from the job's "
            "AutoParallel (save_param_strategy_file lists a tied parameter's other names "
            'under "aliases", and with only_trainable_params=False the frozen ones too)'
        )
    return "the given src_strategy is not the one these files were cut by"
