"""``shardwise plan``: a training script planned for N devices in this process (a dry run).

- The scripts users run, planned for 1,024 devices: seed 002's quick start, seed 003's
  operator-parallel example, the optimizer-parallel example (synthetic data, hsdp level 3) and
  GPT-2 small (12 layers, AdamW); and GPT-2 small Megatron-annotated by propagation at 64:
  plan.json, rank R's IR files, summary.txt and the pictures are written; the plan is for N
  devices, the IR is R's, the summary gives memory by kind, bytes by collective and axis, and
  the step estimate.
- The summary's figures: parameters, gradients and optimizer state of GPT-2 small match its
  parameter count (data parallel: whole on every rank; AdamW: two state elements).
- Errors: a script that never calls a wrapped network, one in data_parallel mode (no plan), a
  device count the strategies do not
  divide (exit 1, the reason on stderr), an out-of-range ``--rank`` (exit 2).
- rank R's IR files equal those ``save_graphs=1`` writes in the real job (a simulated world),
  ``execute.ir`` with its optimizer-parallel section.
- `communication.dry_run`: the size and rank the script sees, and nothing left behind.
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import communication
from shardwise.context import set_context
from shardwise.launch.cli import main
from shardwise.launch.dry_run import dry_plan
from shardwise.planner import PlanError
from shardwise.testing import simulated_world

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _plan(tmp_path: Path, *argv: str) -> tuple[int, Path]:
    out = tmp_path / "out"
    code = main(["plan", "--out", str(out), *argv])
    return code, out


def test_quick_start_at_1024_devices(tmp_path: Path) -> None:
    before = sw.get_auto_parallel_context("parallel_mode")
    code, out = _plan(
        tmp_path, "--device_num", "1024", "--rank", "5", str(EXAMPLES / "quick_start.py")
    )
    assert code == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["device_num"] == 1024
    execute = (out / "rank_5" / "execute.ir").read_text()
    assert "rank 5 of 1024" in execute
    assert "relu" in (out / "rank_5" / "step_parallel_begin.ir").read_text()
    summary = (out / "summary.txt").read_text()
    for part in ("parameters", "gradients", "optimizer state", "activations", "peak"):
        assert part in summary
    assert "optimizer: SGD (1 state elements" in summary  # (momentum 0.1)
    assert "step estimate (cost model, one training step)" in summary
    html = (out / "plan.html").read_text()
    assert "id='op-" in html or 'id="op-' in html
    assert (out / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # (the script's AUTO_PARALLEL context is put back: the process goes on as before)
    assert sw.get_auto_parallel_context("parallel_mode") == before


def test_operator_parallel_at_1024_devices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seed 003's tutorial strategies, repeated over the other devices (a 2 x 2 x 2 x 128
    matrix), reading a small MNIST stand-in (one row per rank of the global batch)."""
    from tests.test_docs import write_small_mnist

    write_small_mnist(tmp_path / "mnist", n_train=1024, n_test=16)
    monkeypatch.setenv("DATA_PATH", str(tmp_path / "mnist"))
    code, out = _plan(tmp_path, "--device_num", "1024", str(EXAMPLES / "operator_parallel.py"))
    assert code == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["device_num"] == 1024
    summary = (out / "summary.txt").read_text()
    assert "DeviceMatrix(g0=2, g1=2, g2=2, g3=128)" in summary
    assert "optimizer: SGD (0 state elements" in summary  # (built after the wrapper)


def test_optimizer_parallel_level3_at_1024_devices(tmp_path: Path) -> None:
    script = str(EXAMPLES / "optimizer_parallel.py")
    code, out = _plan(
        tmp_path, "--device_num", "1024", script, "--synthetic", "1024", "--level", "level3"
    )
    assert code == 0
    summary = (out / "summary.txt").read_text()
    assert "optimizer parallel: hsdp(shard_size=-1, threshold=64 KB, level3)" in summary


def test_gpt2_small_summary_counts_its_parameters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _plan(
        tmp_path, "--device_num", "1024", str(EXAMPLES / "gpt2.py"), "--size", "small"
    )
    assert code == 0
    assert "\r" not in capsys.readouterr().err  # (no progress bar when stderr is no terminal)
    summary = (out / "summary.txt").read_text()
    params = 124_475_904  # GPT-2 small with the 50,304-token vocabulary, head tied
    assert f"({params * 4} B)" in _line(summary, "parameters")
    assert "at the start of backward" in _line(summary, "peak")  # (no parameter gradient yet)
    assert f"({2 * 1024 * 50304 * 4} B)" in _line(summary, "gradients")  # the logits' gradient
    assert f"({params * 8} B)" in _line(summary, "optimizer state")  # AdamW: 2 per element
    assert "gradients  AllReduce      g0" in summary
    assert json.loads((out / "plan.json").read_text())["device_num"] == 1024


def _line(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.strip().startswith(start))


def test_gpt2_small_megatron_annotations_at_64_devices() -> None:
    planned = dry_plan(
        str(EXAMPLES / "gpt2.py"),
        ["--size", "small", "--mode", "sharding_propagation", "--mp", "8"],
        64,
    )
    assert planned.plan.device_num == 64 and planned.plan.mode == "sharding_propagation"
    c_attn = planned.plan.strategies()["transformer.h.0.attn.c_attn/linear"]
    assert c_attn == ((8, 1, 1), (8, 1), (8,))
    assert not dist.is_initialized()  # (the dry run's world is gone)


def test_a_script_that_never_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "nothing.py"
    script.write_text("import torch\nprint(torch.nn.Linear(4, 4).weight.shape)\n")
    code, _ = _plan(tmp_path, "--device_num", "8", str(script))
    assert code == 1
    assert "never called a wrapped network" in capsys.readouterr().err
    script.write_text("import torch\nprint(torch.nn.Linear(4, 4)(torch.zeros(1, 4)))\n")
    code, _ = _plan(tmp_path, "--device_num", "8", str(script))
    assert code == 1
    assert "failed before any wrapped network planned: RuntimeError" in capsys.readouterr().err


def test_a_data_parallel_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """data_parallel mode has no plan: the dry run says so and how to see one, before the
    wrapped train step touches its meta parameters."""
    script = tmp_path / "dp.py"
    script.write_text(
        "import torch\nimport shardwise as sw\n"
        "sw.set_auto_parallel_context(parallel_mode='data_parallel')\n"
        "net = torch.nn.Linear(8, 4)\n"
        "opt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
        "def step(x):\n"
        "    loss = net(x).square().mean()\n"
        "    loss.backward(); opt.step(); opt.zero_grad()\n"
        "    return loss\n"
        "sw.AutoParallel(step)(torch.zeros(2, 8))\n"
    )
    try:
        code, out = _plan(tmp_path, "--device_num", "4", str(script))
    finally:
        sw.reset_auto_parallel_context()
    assert code == 1
    err = capsys.readouterr().err
    assert "runs parallel_mode='data_parallel', which has no plan" in err
    assert "parallel_mode='semi_auto'" in err
    assert "meta" not in err
    assert not (out / "plan.json").exists()


def test_strategies_the_device_count_does_not_divide(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = _plan(tmp_path, "--device_num", "6", str(EXAMPLES / "quick_start.py"))
    assert code == 1
    err = capsys.readouterr().err
    assert "matmul" in err and "6" in err
    assert "its wrapped network failed to plan: ValueError" in err
    assert "meta tensors" not in err  # (the hint for a script's own failure before planning)


def test_a_set_memory_cap_the_plan_exceeds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The dry run stopped the script before `set_memory`'s check: files written, exit 0,
    where a real run of the script raises; it fails as the real run does."""
    script = tmp_path / "capped.py"
    script.write_text(
        "import torch\nimport shardwise as sw\n"
        "net = torch.nn.Linear(64, 64)\n"
        "sw.runtime.set_memory(max_size='10KB')\n"
        "step = sw.AutoParallel(net)\n"
        "step(torch.zeros(8, 64))\n"
    )
    try:
        code, out = _plan(tmp_path, "--device_num", "4", str(script))
    finally:
        sw.runtime.set_memory(None)
    assert code == 1
    err = capsys.readouterr().err
    assert "its wrapped network failed to plan: ValueError" in err
    assert "above the set_memory cap max_size=10.00 KB" in err
    assert not (out / "plan.json").exists()
    try:  # (the API raises the user error as one: a ValueError, a PlanError, named)
        with pytest.raises(PlanError, match=r"capped.py: its wrapped network failed to plan"):
            dry_plan(str(script), [], 4)
    finally:
        sw.runtime.set_memory(None)


def test_out_naming_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as e:
        _plan(tmp_path, "--out", str(tmp_path / "afile"), str(EXAMPLES / "quick_start.py"))
    assert e.value.code == 2
    assert "a file of that name exists; name a folder" in capsys.readouterr().err


_JOB_SCRIPT = """\
import sys
import torch
from torch import nn
import shardwise as sw

def build():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))

def wrap(net, hsdp):
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    def step(x, y):
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    step = sw.AutoParallel(step)
    return step.hsdp(threshold=0, optimizer_level="level3") if hsdp else step

if __name__ == "__main__":
    rows = 8 // sw.communication.get_group_size()
    wrap(build(), sys.argv[1] == "hsdp")(torch.zeros(rows, 16), torch.zeros(rows, 8))
"""


@pytest.mark.parametrize("hsdp", [True, False], ids=["hsdp", "plain"])
def test_the_ir_files_are_the_real_jobs(tmp_path: Path, hsdp: bool) -> None:
    """``shardwise plan``'s rank_3 files equal those the same job writes with
    ``save_graphs=1`` on 4 simulated ranks: execute.ir with its optimizer-parallel (or
    gradient-bucket) section (the dry run left it out)."""
    script = tmp_path / "job.py"
    script.write_text(_JOB_SCRIPT)
    argv = ("--device_num", "4", "--rank", "3", str(script), "hsdp" if hsdp else "plain")
    code, out = _plan(tmp_path, *argv)
    assert code == 0
    job = runpy.run_path(str(script), run_name="job")
    net, x, y = job["build"](), torch.randn(8, 16), torch.randn(8, 8)
    real = tmp_path / "real"
    try:
        set_context(save_graphs=1, save_graphs_path=str(real))
        with simulated_world(4) as world:
            world.replicate(net)
            job["wrap"](net, hsdp)(world.rows(x), world.rows(y))
    finally:
        set_context(save_graphs=0, save_graphs_path="./saved_graph")
    for name in ("step_parallel_begin.ir", "execute.ir"):
        said = (out / "rank_3" / name).read_text()
        assert said == (real / "rank_3" / name).read_text(), name
    section = "# optimizer parallel: hsdp(" if hsdp else "# gradient buckets (no optimizer"
    assert section in said and ("ReduceScatter(" if hsdp else "AllReduce(") in said


def test_an_out_of_range_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _plan(tmp_path, "--device_num", "8", "--rank", "8", str(EXAMPLES / "quick_start.py"))
    assert e.value.code == 2
    assert "--rank 8: must be from 0 to 7" in capsys.readouterr().err


def test_no_script(capsys: pytest.CaptureFixture[str]) -> None:
    """Only the script is required (its arguments are optional)."""
    with pytest.raises(SystemExit) as e:
        main(["plan", "--device_num", "4"])
    assert e.value.code == 2
    assert "the following arguments are required: script\n" in capsys.readouterr().err


def test_dry_run_world() -> None:
    with communication.dry_run(1024, rank=7):
        assert communication.get_group_size() == 1024
        assert communication.get_rank() == 7
        communication.init()  # (finds the world made: returns)
    assert not dist.is_initialized()
    with (
        pytest.raises(ValueError, match="rank=8 is outside the world of 8 ranks"),
        communication.dry_run(8, rank=8),
    ):
        pass
    assert torch.zeros(1).device.type == "cpu"
