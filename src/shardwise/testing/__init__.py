"""Testing helpers: simulated worlds, parity assertions, real-process jobs.

- `simulated_world(n)` (`_world`): every rank of an n-rank job in one process; holds the
  simulation's private torch imports (shardwise's others are in `shardwise._torch`).
- `tiles` (`_tiles`): the copies of a sub-group that a simulated world runs at once.
- `assert_matches_single_device` (`_compare`): parity with the single-device run, rank by rank.
- `run_job`, `free_port` (`_procs`): the few real multi-process tests, through `shardwise run`;
  `JobResult.assert_checks`: the job passed and every rank logged its ``CHECK <name> OK`` lines.
- `CommRecorder` (re-exported): which collectives ran, with bytes and times.
"""

from shardwise.communication.recorder import CommRecord, CommRecorder
from shardwise.testing._compare import assert_matches_single_device
from shardwise.testing._procs import JobResult, clean_env, free_port, run_job
from shardwise.testing._tiles import tiles
from shardwise.testing._world import SimulatedWorld, current_world, simulated_world

__all__ = [
    "CommRecord",
    "CommRecorder",
    "JobResult",
    "SimulatedWorld",
    "assert_matches_single_device",
    "clean_env",
    "current_world",
    "free_port",
    "run_job",
    "simulated_world",
    "tiles",
]
