"""The real MNIST files in data/MNIST (``make data``); skipped when they are absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.dataset import MnistDataset, load_mnist

DATA = Path(__file__).resolve().parents[2] / "data" / "MNIST"
COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]

pytestmark = pytest.mark.skipif(
    not (DATA / "train-labels-idx1-ubyte").is_file(), reason="data/MNIST absent: run `make data`"
)


def test_train_label_counts() -> None:
    images, labels = load_mnist(DATA, "train").columns
    assert images.shape == (60000, 28, 28, 1) and images.dtype == torch.uint8
    assert labels.dtype == torch.uint32
    assert torch.bincount(labels.to(torch.int64)).tolist() == COUNTS


def test_sizes() -> None:
    assert len(MnistDataset(DATA, usage="test").batch(32)) == 313
    assert len(MnistDataset(DATA, num_shards=8, shard_id=5).batch(32)) == 235  # 60000 / 256
