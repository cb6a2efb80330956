"""``comm_fusion`` entries: a key other than ``mode`` / ``config`` and an entry without a
``mode`` are refused naming the entry (they fell back silently to ``auto``); ``auto`` ignores
its ``config``, as MindSpore does."""

from __future__ import annotations

import pytest

from shardwise.optim import check_fusion


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (
            {"reducescatter": {"Mode": "size", "config": 1}},
            r"\['reducescatter'\]: unknown key 'Mode'",
        ),
        ({"allreduce": {"mode": "size", "config": 1, "extra": 3}}, r"unknown key 'extra'.*'mode'"),
        ({"allreduce": {"config": 1}}, r"\['allreduce'\]: no 'mode'"),
    ],
)
def test_unknown_or_missing_entry_keys_are_refused(config: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_fusion(config)


def test_auto_ignores_its_config() -> None:
    fusion = check_fusion({"allgather": {"mode": "auto", "config": 1}})
    assert fusion.bucket_bytes("allgather") == 64 << 20
