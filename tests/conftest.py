"""Shared fixtures: every test starts and ends without a process group."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from shardwise.communication import _init


@pytest.fixture(autouse=True)
def _no_leftover_process_group() -> Iterator[None]:
    yield
    _init.forget_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
