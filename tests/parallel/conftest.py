"""Fixtures shared by the parallel tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import shardwise as sw


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread for the test (simulated worlds run every rank's ops in turn; more
    threads only contend on this host), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fast_paths() -> Iterator[None]:
    """The plan executor's opt-in fast paths (``watch_every_op=False``), the default after."""
    sw.set_auto_parallel_context(watch_every_op=False)
    yield
    sw.reset_auto_parallel_context()
