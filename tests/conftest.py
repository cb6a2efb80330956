"""Shared fixtures: every test starts and ends without a process group. The automatic
planners price with the documented default cost model (``SHARDWISE_COST_MODEL=defaults``), not
with a ``bench/results/loopback.json`` a benchmark run may have left."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from shardwise.communication import _init

os.environ["SHARDWISE_COST_MODEL"] = "defaults"  # (also for the workers tests start)


@pytest.fixture(autouse=True)
def _no_leftover_process_group() -> Iterator[None]:
    yield
    _init.forget_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
