"""The input convention on 2 real gloo processes (one job, every case of
tests/parallel/test_input_convention.py): each rank passes its rows under ``"data_parallel"``,
the whole batch under ``"full_batch"``, in both wrapper forms and both parallel modes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shardwise.testing import JobResult

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "parallel"))
from test_input_convention import CASES  # noqa: E402

pytestmark = pytest.mark.multiprocess


def test_every_case_matches_one_device_on_2_processes(two_rank_job: JobResult) -> None:
    two_rank_job.assert_checks(2, ["-".join([c.__name__, m, f, s]) for c, m, f, s in CASES])


def test_another_batch_under_full_batch_is_refused_on_both_ranks(two_rank_job: JobResult) -> None:
    """Rank 1 passing another batch than rank 0 under ``"full_batch"``, or one more tensor
    input: the same ValueError on both ranks (through the job's store), in both parallel
    modes; the job goes on."""
    two_rank_job.assert_checks(
        2, [f"full_batch-other-batches-{m}" for m in ("semi_auto", "data_parallel")]
    )


def test_unequal_rows_are_refused_naming_the_shapes(two_rank_job: JobResult) -> None:
    """semi_auto, rank 0 passing 2 rows and rank 1 one (or 1 and none): the same ValueError on
    both ranks naming each input's shape on each rank and the fix (as many rows per rank), not
    a plan difference asking for the same annotations; the job goes on."""
    two_rank_job.assert_checks(2, ["unequal-rows-2-1", "unequal-rows-1-0"])
