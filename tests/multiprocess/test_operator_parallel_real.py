"""examples/operator_parallel.py on 4 real processes (strategies scaled to 4 devices) gives the
same losses as the same network trained on one device on the same global batches."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import shardwise as sw
from shardwise.dataset import transforms, vision
from shardwise.dataset.idx import write_idx
from shardwise.testing import run_job

EXAMPLE = Path(__file__).parents[2] / "examples" / "operator_parallel.py"
STEPS = 6


def write_mnist(folder: Path, rows: int = 256) -> None:
    g = torch.Generator().manual_seed(4)
    folder.mkdir(parents=True)
    write_idx(
        folder / "train-images-idx3-ubyte",
        torch.randint(0, 256, (rows, 28, 28), generator=g, dtype=torch.uint8),
    )
    write_idx(
        folder / "train-labels-idx1-ubyte",
        torch.randint(0, 10, (rows,), generator=g, dtype=torch.uint8),
    )


def single_device(data_path: Path) -> list[float]:
    spec = importlib.util.spec_from_file_location("operator_parallel", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    sw.set_seed(1)
    net = example.Network(example.strategies(4))  # primitives run single-device outside a job
    opt = torch.optim.SGD(net.parameters(), 1e-2)
    data = sw.dataset.MnistDataset(str(data_path))
    data = data.map(
        [vision.Rescale(1.0 / 255.0, 0), vision.Normalize((0.1307,), (0.3081,)), vision.HWC2CHW()],
        "image",
    )
    data = data.map(transforms.TypeCast(torch.int64), "label").batch(32)
    losses = []
    for i, (image, label) in enumerate(data):
        if i == STEPS:
            break
        loss = torch.nn.functional.cross_entropy(net(image), label)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_operator_parallel_example_four_processes(tmp_path: Path) -> None:
    data_path = tmp_path / "MNIST"
    write_mnist(data_path)
    out = tmp_path / "losses.txt"
    res = run_job(
        EXAMPLE, 4, tmp_path / "logs", "--max-steps", str(STEPS), "--losses-out", str(out),
        env={"DATA_PATH": str(data_path)}, timeout=200,
    )  # fmt: skip
    assert res.returncode == 0, res.output
    got = [float(x) for x in out.read_text().split()]
    assert "epoch: 0, step: 0, loss is " in res.worker_log(3)
    torch.testing.assert_close(
        torch.tensor(got), torch.tensor(single_device(data_path)), rtol=1e-5, atol=1e-6
    )
