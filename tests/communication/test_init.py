"""init() in a plain single process: a 1-rank job whose collectives are identities."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.communication import get_group_size, get_local_rank, get_rank, init, release


def test_init_plain_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "RANK_TABLE_FILE"):
        monkeypatch.delenv(name, raising=False)
    init()
    init()  # idempotent
    try:
        assert (get_rank(), get_group_size(), get_local_rank()) == (0, 1, 0)
        x = torch.arange(4.0, requires_grad=True)
        with sw.CommRecorder() as rec:
            y = sw.ops.AllReduce()(x)
            assert torch.equal(sw.ops.AllGather()(x), x)
            assert torch.equal(sw.ops.ReduceScatter()(x), x)
            (b,) = sw.ops.Broadcast(0)(x)
            y.sum().backward()
        assert torch.equal(y, x) and torch.equal(b, x)
        assert torch.equal(x.grad, torch.ones(4))
        assert rec.total_bytes() == 0
        sw.communication.create_group("solo", [0])
        assert get_rank("solo") == 0
    finally:
        release()
    assert not sw.communication.is_initialized()


def test_calls_before_init_explain() -> None:
    with pytest.raises(RuntimeError, match=r"call shardwise.communication.init\(\) first"):
        get_rank()


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="backend='tpu'"):
        init("tpu")
