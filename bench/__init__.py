"""shardwise benchmarks: side by side against what a user would write with plain torch.

Run everything with ``python -m bench`` (or ``make bench``) from the repository root; see
``bench/README.md``. Modules:

- `harness`: spawn real gloo workers, time candidates side by side, format tables.
- `_worker`: the entry point of one worker process (``python -m bench._worker SPEC``).
- `loopback`: the fitted latency / bandwidth of loopback gloo, `load_loopback_model()`, and
  the calibration of the planners' cost model (`calibration`: compute and collectives).
- `collective_cases`: both sides (shardwise primitive, torch call) of each collective.
- `collectives`: times, bytes and the table of the seven collectives vs the torch calls.
"""
