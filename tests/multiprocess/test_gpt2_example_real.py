"""examples/gpt2.py on 2 real gloo processes, in semi_auto (no annotation) and in
sharding_propagation (c_attn / c_fc annotated), prints the losses of the same GPT-2 trained on
one device on the global batches (each rank's rows joined)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.testing import run_job
from shardwise.testing.nanogpt import GPT2

EXAMPLE = Path(__file__).parents[2] / "examples" / "gpt2.py"
RANKS, ROWS, STEPS = 2, 2, 2


def sizes() -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("gpt2_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.SIZES["tiny"])


def single_device() -> list[float]:
    cfg = sizes()
    sw.set_seed(1)
    net = GPT2(**cfg)
    optimizer = net.configure_optimizers(weight_decay=0.1, lr=6e-4)
    gens = [torch.Generator().manual_seed(1234 + r) for r in range(RANKS)]
    seq, vocab = cfg["block_size"], cfg["vocab_size"]
    losses = []
    for _ in range(STEPS):
        tokens = torch.cat([torch.randint(0, vocab, (ROWS, seq + 1), generator=g) for g in gens])
        _, loss = net(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        assert loss is not None
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["semi_auto", "sharding_propagation"])
def test_gpt2_example_two_processes(tmp_path: Path, mode: str) -> None:
    res = run_job(EXAMPLE, RANKS, tmp_path / "logs", "--steps", str(STEPS), "--batch",
                  str(ROWS), "--mode", mode, timeout=150)  # fmt: skip
    assert res.returncode == 0, res.output
    got = [float(v) for v in re.findall(r"^step \d+: loss (\S+)$", res.worker_log(0), re.M)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(single_device()), rtol=1e-5,
                               atol=1e-6)  # fmt: skip
