"""What a rank's checkpoint records about its cut, and how that is found for a network.

- `aliases`: state_dict names that are another name of a parameter (tied weights).
- `network_strategy`: the `CheckpointStrategy` a network's parameters are stored by on this
  rank (None: not cut: unplanned, or data parallel).
- `strategy_metadata`: the metadata strings of rank r's file under a strategy: rank, device
  count, the strategy (the parameter strategy file's JSON), and each non-whole entry's piece.
- `describe`: those strings for a network saved on this rank, each entry's piece taken from
  the plan and checked against the tensor actually saved; for a network whose parameters are
  not cut but whose optimizer state is kept by owner ranks (data_parallel with hsdp) and saved,
  the rank and the device count only (`_job_metadata`): the files are one checkpoint together.
- `check_rank_pieces`: a rank file loaded with the plain functions into a planned network
  holds the blocks this rank holds (not another rank's file).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from shardwise import communication as comm
from shardwise.checkpoint import _format as fmt
from shardwise.checkpoint._errors import CheckpointError
from shardwise.checkpoint._pieces import Piece, layout_piece, piece_of
from shardwise.checkpoint._strategy import STATE_PREFIX, CheckpointStrategy, owner_of
from shardwise.optim._data_parallel_hooks import state_on_owners
from shardwise.parameter import tied_names


def network_strategy(network: nn.Module) -> CheckpointStrategy | None:
    """The strategy `network`'s parameters are stored by, under its state_dict names (the
    planned network may be a submodule, as in an `AutoParallel` wrapper); None when nothing in
    it is cut."""
    from shardwise.parallel._ownership import stored_plan  # (parallel imports checkpoint users)

    found = [(p, m, plan) for p, m in network.named_modules() if (plan := stored_plan(m))]
    if not found:
        return None
    if len(found) > 1:
        raise CheckpointError(
            f"{type(network).__name__} holds {len(found)} planned networks "
            f"({', '.join(p or '(itself)' for p, _, _ in found)}); save each one on its own"
        )
    prefix, module, plan = found[0]
    strategy = CheckpointStrategy.from_plan(plan, tied_names(module))
    return strategy.renamed(f"{prefix}.") if prefix else strategy


def strategy_metadata(
    strategy: CheckpointStrategy, rank: int, pieces: Mapping[str, Piece]
) -> dict[str, str]:
    """Rank `rank`'s metadata strings for a file holding `pieces`."""
    return {
        fmt.KEY_RANK: str(rank),
        fmt.KEY_DEVICE_NUM: str(strategy.device_num),
        fmt.KEY_STRATEGY: json.dumps(strategy.to_json()),
        fmt.KEY_PIECES: json.dumps({k: p.to_json() for k, p in pieces.items() if not p.is_whole}),
    }


def _piece(strategy: CheckpointStrategy, key: str, t: torch.Tensor, rank: int) -> Piece:
    """The piece this rank's saved `t` of entry `key` holds under `strategy`."""
    piece = strategy.stored_piece(key, tuple(t.shape), rank)
    if piece is not None:
        return piece
    owner = owner_of(key)
    if key.startswith(STATE_PREFIX) and owner in strategy.shards:
        p = strategy.params[owner]
        block = layout_piece(p.layout, rank, p.shape).local_shape
        if tuple(t.shape) in (tuple(p.shape), block):  # (not yet cut by hsdp)
            shard = list(strategy.param_piece(owner, rank).local_shape)
            raise CheckpointError(
                f"optimizer state {key!r} has shape {list(t.shape)}, not this rank's hsdp "
                f"shard {shard} of {owner!r}: hsdp cuts optimizer state made before planning "
                "(loaded into the optimizer) at the first step; take one step before saving, "
                "or save before the network is planned"
            )
    if key.startswith(STATE_PREFIX):
        raise CheckpointError(
            f"optimizer state {key!r} has shape {list(t.shape)}, not its parameter's block's: "
            "state not cut like its parameter (Adafactor's row / column statistics, say) "
            "cannot be recorded; save without the optimizer, or use an optimizer whose state "
            "is shaped like the parameter"
        )
    raise CheckpointError(
        f"checkpoint entry {key!r} has shape {list(t.shape)}, not the block the plan stores "
        f"on rank {rank}; save after the first step, or before the network is planned"
    )


def describe(
    network: nn.Module, tensors: Mapping[str, torch.Tensor], with_optimizer: bool = False
) -> dict[str, str]:
    """The metadata recording how this rank's `tensors` (its state_dict and optimizer entries,
    `with_optimizer`: an optimizer was saved) are cut; empty when the network is not cut.

    Raises:
        CheckpointError: the job's size is not the plan's, or an entry's shape is not the
            piece the plan gives it.
    """
    strategy = network_strategy(network)
    if strategy is None:
        return _job_metadata(network, with_optimizer)
    rank, size = comm.file_rank()
    pieces = {key: _piece(strategy, key, t, rank) for key, t in tensors.items()}
    if size != strategy.device_num:
        if all(p.is_whole for p in pieces.values()):  # (every rank holds all of it)
            return _job_metadata(network, with_optimizer)
        cut = next(k for k, p in pieces.items() if not p.is_whole)
        raise CheckpointError(
            f"the network is planned for {strategy.device_num} devices and cuts {cut!r}, but "
            f"this process writes the files of a {size}-rank job (a simulated world runs every "
            "rank in one process and writes one file): save from a real job, one file per rank"
        )
    return strategy_metadata(strategy, rank, pieces)


def _job_metadata(network: nn.Module, with_optimizer: bool) -> dict[str, str]:
    """Rank and device count for the file of a network not cut whose optimizer, saved too,
    keeps state on owner ranks (`optim.state_on_owners`: data_parallel with hsdp): a missing
    rank's file would lose the state of the parameters it owned, so the reader must know how
    many files there are (every rank records them, also one that owns nothing). Empty
    otherwise: a whole network's file may be saved by one rank alone."""
    rank, size = comm.file_rank()
    if size == 1 or not with_optimizer:
        return {}
    if not any(state_on_owners(m) for m in network.modules()):
        return {}
    return {fmt.KEY_RANK: str(rank), fmt.KEY_DEVICE_NUM: str(size)}


def check_rank_pieces(
    network: nn.Module | None,
    metadata: Mapping[str, str],
    keys: Iterable[tuple[str, str]],
    where: str,
) -> None:
    """Refuse entries of a rank file (`metadata` records their pieces) that hold other blocks
    than the ones the ranks of this process hold of the planned `network`.

    Args:
        network: the network loaded into (None, or not planned: nothing to check).
        metadata: the file's metadata strings.
        keys: (the network's name, the file's key) of each entry loaded.
        where: the file, for the message.

    Raises:
        CheckpointError: naming the entry, both blocks, and the fix.

    Example:
        >>> check_rank_pieces(net, ckpt.metadata, [("w1", "w1")], "rank_0/x.safetensors")
    """
    recorded = json.loads(metadata.get(fmt.KEY_PIECES, "{}"))
    strategy = network_strategy(network) if recorded and network is not None else None
    if strategy is None:
        return
    for name, key in keys:
        data = recorded.get(key)
        if data is None:
            continue
        have = piece_of(data)
        for rank in comm.process_ranks():
            if rank >= strategy.device_num:
                break
            want = strategy.entry_piece(name, have.shape, rank)
            if want != have:
                raise CheckpointError(
                    f"{where}: {key!r} holds {have} (the file records rank "
                    f"{metadata.get(fmt.KEY_RANK, '?')} of {metadata.get(fmt.KEY_DEVICE_NUM, '?')})"
                    f", but rank {rank} of this job holds {want}: load rank {rank}'s own file, "
                    "or the checkpoint folder with sw.checkpoint.load_distributed(net, folder), "
                    "which gives every rank its blocks"
                )
