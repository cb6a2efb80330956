"""Communication: join the job, ranks and groups, the seven collectives, accounting.

This is the only package of shardwise that calls ``torch.distributed``'s collectives and
process-group functions directly.

- `_env.detect_job`: which job this process is in (shardwise run, torchrun, mpirun, rank table).
- `_init`: `init`, `get_rank`, `get_group_size`, `get_local_rank`, `create_group`,
  `destroy_group`, `release`; `_backend`: `default_backend`, and `check_backend`, which
  refuses a backend this torch/machine lacks (``"nccl"`` without CUDA) with what to do.
- `_ranks`: rank-dependent values and groups asked the same way in a job and in a simulated
  world (`process_ranks`, `holds_several_ranks`, `rank_value`, `own_group`, `rank_parts`,
  `file_rank`, `shared_value`).
- `_agreement`: checks that the ranks agree, once per plan through the job's store
  (`ranks_unlike_leader` and its answer `Unlike`; `agree_with_ranks` and its `Agreement`;
  `announce_planning` before a check that only some ranks may reach).
- `_collectives`: the plain collectives (recorded, no autograd); `_reduce_op`: their
  reductions (`ReduceOp`); `_exchange`: point-to-point `exchange`.
- `_buckets`: one AllGather / ReduceScatter over a fusion bucket's tensors (optimizer
  parallel's buckets), on gloo through `_pairwise`: one message per peer, shared by the
  buckets started together inside `_pairwise.coalesced()`; `release_buffers` frees its pool of
  message buffers, `pooled_bytes` says how much it holds.
- `primitives` / `neighbor`: the autograd-aware modules exported as ``sw.ops.AllReduce`` ...
- `_max_over_ranks`: `max_over_ranks`, the AllReduce(MAX) of partial maxima (ReduceMax with
  its reduced dim split), with its adjoint.
- `_sparse`: `all_reduce_sparse`, a sparse COO gradient summed over a group (sparse again).
- `recorder`: `CommRecorder`, bytes bounds.
- `_dry`: `dry_run`, this process as one rank of an N-rank world with no other process
  (``shardwise plan``).
"""

from shardwise.communication._agreement import (
    Agreement,
    Unlike,
    agree_with_ranks,
    announce_planning,
    arrival_timeout,
    ranks_unlike_leader,
)
from shardwise.communication._backend import default_backend
from shardwise.communication._collectives import ReduceOp
from shardwise.communication._dry import dry_run
from shardwise.communication._env import JobEnv, LaunchEnvError, detect_job
from shardwise.communication._init import (
    WORLD_COMM_GROUP,
    Group,
    create_group,
    destroy_group,
    ensure_group,
    get_group_size,
    get_local_rank,
    get_rank,
    init,
    is_initialized,
    release,
    scoped_group_name,
)
from shardwise.communication._max_over_ranks import max_over_ranks
from shardwise.communication._pairwise import pooled_bytes, release_buffers
from shardwise.communication._ranks import (
    file_rank,
    first_claim,
    holds_several_ranks,
    own_group,
    process_ranks,
    rank_parts,
    rank_value,
    shared_value,
)
from shardwise.communication._sim import (
    draw_state,
    every_rank,
    plain_tensors,
    process_rng_state,
    replicated_draw,
    set_draw_state,
    set_process_rng_state,
)
from shardwise.communication._store_sync import comm_timeout
from shardwise.communication.neighbor import NeighborExchange, NeighborExchangeV2
from shardwise.communication.primitives import (
    AllGather,
    AllReduce,
    AlltoAll,
    Broadcast,
    ReduceScatter,
)
from shardwise.communication.recorder import CommRecord, CommRecorder, bytes_bound

__all__ = [
    "WORLD_COMM_GROUP",
    "Agreement",
    "AllGather",
    "AllReduce",
    "AlltoAll",
    "Broadcast",
    "CommRecord",
    "CommRecorder",
    "Group",
    "JobEnv",
    "LaunchEnvError",
    "NeighborExchange",
    "NeighborExchangeV2",
    "ReduceOp",
    "ReduceScatter",
    "Unlike",
    "agree_with_ranks",
    "announce_planning",
    "arrival_timeout",
    "bytes_bound",
    "comm_timeout",
    "create_group",
    "default_backend",
    "destroy_group",
    "detect_job",
    "draw_state",
    "dry_run",
    "ensure_group",
    "every_rank",
    "file_rank",
    "first_claim",
    "get_group_size",
    "get_local_rank",
    "get_rank",
    "holds_several_ranks",
    "init",
    "is_initialized",
    "max_over_ranks",
    "own_group",
    "plain_tensors",
    "pooled_bytes",
    "process_ranks",
    "process_rng_state",
    "rank_parts",
    "rank_value",
    "ranks_unlike_leader",
    "release",
    "release_buffers",
    "replicated_draw",
    "scoped_group_name",
    "set_draw_state",
    "set_process_rng_state",
    "shared_value",
]
