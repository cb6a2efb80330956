"""Worker for test_input_convention_real.py: every parallel mode x wrapper form x dataset
strategy of tests/parallel/test_input_convention.py on real gloo processes. Under
``"data_parallel"`` this rank passes its own rows of each global batch, under ``"full_batch"``
all of it; the losses and the gradients the optimizer sees equal one device's. Prints
``CHECK <case> OK`` per case."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import shardwise as sw
from shardwise.communication import get_group_size, get_rank, init

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
from test_input_convention import CASES, run_case, single_device


def main() -> None:
    init()
    checks()
    sw.communication.release()


def checks() -> None:
    """Every check of this worker, in a job that has called ``init()`` (two_ranks_worker.py
    runs them in the tests' one 2-process job)."""
    n, rank = get_group_size(), get_rank()

    def rows(x: torch.Tensor) -> torch.Tensor:
        k = x.shape[0] // n
        return x[rank * k : (rank + 1) * k]

    for cls, mode, form, strategy in CASES:
        give = (lambda x: x) if strategy == "full_batch" else rows
        run_case(n, cls(), (mode, form, strategy), give, single_device(cls))
        print(f"CHECK {cls.__name__}-{mode}-{form}-{strategy} OK", flush=True)


if __name__ == "__main__":
    main()
