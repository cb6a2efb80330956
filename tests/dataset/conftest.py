"""Fixtures for the dataset tests: small MNIST-like IDX folders written into tmp_path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shardwise.dataset import write_idx

MakeMnist = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _write_split(
    directory: Path, prefix: str, n: int, offset: int, sep: str, gz: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    ext = ".gz" if gz else ""
    # image i is filled with (offset + i) % 256 plus a pixel ramp, label (offset + i) % 10
    ids = torch.arange(offset, offset + n)
    ramp = torch.arange(28 * 28).reshape(1, 28, 28)
    images = ((ids.reshape(-1, 1, 1) + ramp) % 256).to(torch.uint8)
    labels = (ids % 10).to(torch.uint8)
    write_idx(directory / f"{prefix}-images{sep}idx3-ubyte{ext}", images)
    write_idx(directory / f"{prefix}-labels{sep}idx1-ubyte{ext}", labels)
    return images, labels


@pytest.fixture
def make_mnist(tmp_path: Path) -> MakeMnist:
    """``make_mnist(n_train=20, n_test=6, sep="-", gz=False)`` -> (train images, train labels).

    Writes both splits into ``tmp_path / "mnist"`` with the given spelling; test samples
    continue the numbering of the train samples.
    """

    def make(
        n_train: int = 20, n_test: int = 6, sep: str = "-", gz: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        directory = tmp_path / "mnist"
        directory.mkdir(exist_ok=True)
        train = _write_split(directory, "train", n_train, 0, sep, gz)
        _write_split(directory, "t10k", n_test, n_train, sep, gz)
        return train

    return make


@pytest.fixture
def mnist_dir(tmp_path: Path) -> Path:
    """Where `make_mnist` writes."""
    return tmp_path / "mnist"
