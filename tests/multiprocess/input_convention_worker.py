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
from test_input_convention import CASES, MLP, data, run_case, single_device


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
    for mode in ("semi_auto", "data_parallel"):
        _other_batches_refused(mode, rank, extra=False)
        print(f"CHECK full_batch-other-batches-{mode} OK", flush=True)
        _other_batches_refused(mode, rank, extra=True)
        print(f"CHECK full_batch-other-input-counts-{mode} OK", flush=True)
    for counts in ((2, 1), (1, 0)):
        _unequal_rows_refused(counts, rank)
        print(f"CHECK unequal-rows-{counts[0]}-{counts[1]} OK", flush=True)


def _other_batches_refused(mode: str, rank: int, extra: bool) -> None:
    """Under ``"full_batch"`` rank 1 passes another batch than rank 0 (`extra`: one more
    tensor input): both ranks raise the same ValueError (through the job's store), before any
    collective."""
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), 0.1)

    def step(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(net(x), y, weight=w)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    wrapper = sw.AutoParallel(step, parallel_mode=mode).dataset_strategy("full_batch")
    x, y = data()[0]
    kwargs = {"w": torch.ones(3)} if extra and rank == 1 else {}
    try:
        wrapper(x if extra else x.roll(rank, 0), y, **kwargs)
    except ValueError as e:
        what = "the number of inputs" if extra else "differs on rank 1 from rank 0's"
        assert what in str(e), e
    else:
        raise AssertionError("another batch on rank 1 was not refused")
    wrapper.remove()


def _unequal_rows_refused(counts: tuple[int, int], rank: int) -> None:
    """semi_auto under ``"data_parallel"``: rank 0 passes ``counts[0]`` rows, rank 1
    ``counts[1]`` (a last, partial batch): both ranks raise the same ValueError naming each
    input, its shape on each rank and the fix (before: "rank 1 planned this call unlike rank 0
    ... give every rank the same annotations", though the annotations were the same)."""
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), 0.1)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    wrapper = sw.AutoParallel(step, parallel_mode="semi_auto")
    x, y = data()[0]
    k = counts[rank]
    a, b = counts
    width = list(x.shape[1:])
    try:
        wrapper(x[:k], y[:k])
    except ValueError as e:
        for what in (
            f"args[0]: {[a, *width]} on rank 0, {[b, *width]} on rank 1",
            f"args[1]: [{a}] on rank 0, [{b}] on rank 1",
            "as many rows on each rank",
            "drop_remainder=True",
        ):
            assert what in str(e), e
        assert "annotations" not in str(e), e
    else:
        raise AssertionError(f"{a} and {b} rows on the two ranks were not refused")
    wrapper.remove()


if __name__ == "__main__":
    main()
