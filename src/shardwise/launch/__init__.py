"""``shardwise run`` (also ``swrun``): an msrun-compatible launcher built on torch's TCPStore.

Modules, in the order a launch uses them:

- `cli`: options -> `config.LaunchConfig` (`cli.main`, `cli.swrun_main` are the commands);
- `detach`: ``--join False`` returns once the workers run, a background process supervises;
- `job`: one launcher's job from rendezvous to exit code (`job.run_job`);
- `rendezvous`: the launchers meet in a ``TCPStore`` hosted by node 0 and get their ranks
  (`store` hosts or reaches that store);
- `env`: each worker's environment (`env.worker_env`) and CPU cores (`env.split_cores`);
- `supervisor`: start, watch and stop the worker processes;
- `liveness`: heartbeats between the launchers of several nodes, the "node N lost" root cause;
- `report`: the root cause of a failure, from the worker logs;
- `schedlog`: ``LOG_DIR/scheduler.log``.

Importing this package does not import torch (only `rendezvous` does, when a job starts).
"""

from shardwise.launch.cli import main, parse_run_args, swrun_main
from shardwise.launch.config import LaunchConfig, NodeAssignment
from shardwise.launch.env import split_cores, worker_env

__all__ = [
    "LaunchConfig",
    "NodeAssignment",
    "main",
    "parse_run_args",
    "split_cores",
    "swrun_main",
    "worker_env",
]
