"""Shared fixtures: every test starts and ends without a process group. The automatic
planners price with the documented default cost model (``SHARDWISE_COST_MODEL=defaults``), not
with a ``bench/results/loopback.json`` a benchmark run may have left. `eight_rank_job`,
`four_rank_job`, `two_rank_job`: the one 8-, 4- and 2-process jobs real tests read their checks
from (each start of a job costs ~4 s of imports per process on 2 cores)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from shardwise.communication import _init
from shardwise.testing import JobResult, run_job

os.environ["SHARDWISE_COST_MODEL"] = "defaults"  # (also for the workers tests start)


@pytest.fixture(autouse=True)
def _no_leftover_process_group() -> Iterator[None]:
    yield
    _init.forget_groups()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def eight_rank_job(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    """One job of 8 real gloo processes (tests/parallel/train_step_worker.py) for every test
    that needs 8 ranks: API.md's train step, seed 003's Layout version, delayed init,
    ``to_placements`` and ``redistribute`` each print their ``CHECK ... OK`` lines in it (a
    start of 8 processes costs ~14 s on 2 cores)."""
    worker = Path(__file__).parent / "parallel" / "train_step_worker.py"
    return run_job(worker, 8, tmp_path_factory.mktemp("eight_ranks") / "logs", timeout=300)


@pytest.fixture(scope="session")
def two_rank_job(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    """One job of 2 real gloo processes (tests/multiprocess/two_ranks_worker.py): the checks
    of gradients, the input convention, the loss overlap, recomputation, hsdp's pairwise
    collectives and data-parallel mode's per-rank branches, each printing its ``CHECK ... OK``
    lines."""
    worker = Path(__file__).parent / "multiprocess" / "two_ranks_worker.py"
    return run_job(worker, 2, tmp_path_factory.mktemp("two_ranks") / "logs", timeout=280)


@pytest.fixture(scope="session")
def four_rank_job(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    """One job of 4 real gloo processes (tests/multiprocess/four_ranks_worker.py): the
    collectives, manual data parallel (its ``rank_<r>.json`` next to the ``logs`` folder) and
    the GPT-2-style model in semi_auto, each printing its ``CHECK ... OK`` lines."""
    worker = Path(__file__).parent / "multiprocess" / "four_ranks_worker.py"
    root = tmp_path_factory.mktemp("four_ranks")
    return run_job(worker, 4, root / "logs", str(root), timeout=280)
