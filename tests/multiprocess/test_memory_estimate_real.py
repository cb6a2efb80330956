"""The memory and traffic estimate (`report.estimate_memory`, `step_traffic`: what
``shardwise plan`` and ``sw.runtime.set_memory`` use) against 4 real gloo ranks: seed 003's
network, the GPT block (2 x 2 Megatron) and the GPT-2-style model (data parallel), each at hsdp
levels 1, 2 and 3 (``bench/memory.py``'s cases, one job for all nine). The peak is what torch's
CPU allocator holds at most during one training step (`report.MemoryMeter`), within 10 % of the
estimate; the bytes a rank sends are the `CommRecorder`'s, within 1 %; the bytes the pool of
message buffers keeps after the step are the model's (``report/_pool.py``), exactly."""

from __future__ import annotations

import pytest
from bench.harness import spawn
from bench.memory import LEVELS, NETWORKS


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_estimate_matches_four_real_ranks() -> None:
    rows = [r for per_rank in spawn("bench.memory:worker", 4, {}, 150) for r in per_rank]
    assert {(r["network"], r["level"]) for r in rows} == {
        (n, lv) for n in NETWORKS for lv in LEVELS
    }
    assert len(rows) == 4 * 9
    for r in rows:
        case = f"{r['network']} {r['level']} rank {r['rank']}: {r}"
        assert r["measured_peak"] == pytest.approx(r["estimate_peak"], rel=0.10), case
        assert r["sent_measured"] == pytest.approx(r["sent_estimate"], rel=0.01), case
        assert r["pool_measured"] == r["pool_estimate"], case
    assert any(r["pool_measured"] for r in rows)  # (some case packs messages: the pool is used)
    by_level = {
        lv: max(r["measured_peak"] for r in rows if r["network"] == "seed003" and r["level"] == lv)
        for lv in LEVELS
    }
    assert by_level["level3"] < 0.85 * by_level["level1"]  # level 3's saving shows in the peak
