"""`JobResult.assert_checks`: a job passes only when it exited 0 and every rank logged every
``CHECK <name> OK`` line."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.testing import JobResult


def job(tmp_path: Path, returncode: int, logs: list[str]) -> JobResult:
    for rank, text in enumerate(logs):
        (tmp_path / f"worker_{rank}.log").write_text(text)
    return JobResult(returncode, "launcher output", tmp_path)


def test_every_rank_logged_every_check(tmp_path: Path) -> None:
    job(tmp_path, 0, ["CHECK a OK\nCHECK b OK\n"] * 2).assert_checks(2, ["a", "b"])


def test_a_missing_check_names_the_rank_and_check(tmp_path: Path) -> None:
    res = job(tmp_path, 0, ["CHECK a OK\nCHECK b OK\n", "CHECK a OK\n"])
    with pytest.raises(AssertionError, match="rank 1 did not pass b"):
        res.assert_checks(2, ["a", "b"])


def test_a_failed_job_shows_its_output_and_logs(tmp_path: Path) -> None:
    res = job(tmp_path, 1, ["CHECK a OK\n", "Traceback: boom\n"])
    with pytest.raises(AssertionError, match=r"(?s)launcher output.*boom"):
        res.assert_checks(2, ["a"])
