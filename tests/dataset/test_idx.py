"""IDX reader/writer and MnistDataset's file handling, on files written into tmp_path."""

from __future__ import annotations

import gzip
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from shardwise.dataset import (
    IdxFileNotFoundError,
    IdxFormatError,
    MnistDataset,
    load_mnist,
    read_idx,
    write_idx,
)
from shardwise.dataset.idx import find_idx_file


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(2 * 3 * 4, dtype=torch.uint8).reshape(2, 3, 4),
        torch.tensor([-7, 0, 2**20, -(2**31)], dtype=torch.int32),
        torch.tensor([[1.5, -2.25], [3.0e7, 0.0]], dtype=torch.float32),
        torch.tensor([-300, 300], dtype=torch.int16),
        torch.tensor([1e-300, -2.5], dtype=torch.float64),
    ],
)
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_round_trip(tmp_path: Path, tensor: torch.Tensor, suffix: str) -> None:
    path = write_idx(tmp_path / f"t-idx{suffix}", tensor)
    back = read_idx(path)
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_big_endian_on_disk(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "x", torch.tensor([1, 258], dtype=torch.int32))
    assert path.read_bytes() == bytes([0, 0, 0x0C, 1, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 1, 2])


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope-idx1-ubyte: no such IDX file"):
        read_idx(tmp_path / "nope-idx1-ubyte")


def test_wrong_magic(tmp_path: Path) -> None:
    path = tmp_path / "bad"
    path.write_bytes(b"\x1f\x8b\x08\x00" + bytes(20))  # a gzip file without .gz
    with pytest.raises(ValueError, match=r"bad: wrong magic number 0x1f8b0800"):
        read_idx(path)


def test_unknown_type_code(tmp_path: Path) -> None:
    path = tmp_path / "bad"
    path.write_bytes(bytes([0, 0, 0x07, 1, 0, 0, 0, 1, 5]))
    with pytest.raises(IdxFormatError, match="unknown IDX type code 0x07"):
        read_idx(path)


def test_truncated_data(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "train-labels-idx1-ubyte", torch.zeros(10, dtype=torch.uint8))
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(IdxFormatError, match=r"train-labels-idx1-ubyte: truncated.*10 data bytes"):
        read_idx(path)


def test_truncated_header(tmp_path: Path) -> None:
    path = tmp_path / "h"
    path.write_bytes(bytes([0, 0, 8, 3, 0, 0]))
    with pytest.raises(IdxFormatError, match="truncated header"):
        read_idx(path)


def test_trailing_bytes(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "x", torch.zeros(4, dtype=torch.uint8))
    path.write_bytes(path.read_bytes() + b"\x00\x00")
    with pytest.raises(IdxFormatError, match="2 trailing bytes"):
        read_idx(path)


def test_truncated_gzip(tmp_path: Path) -> None:
    path = tmp_path / "x.gz"
    path.write_bytes(gzip.compress(bytes([0, 0, 8, 1, 0, 0, 0, 9]) + bytes(9))[:-12])
    with pytest.raises(IdxFormatError, match=r"x.gz: not a readable gzip file"):
        read_idx(path)


def test_write_rejects_dtype(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"IDX cannot store torch\.int64"):
        write_idx(tmp_path / "x", torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize(("sep", "gz"), [("-", False), (".", False), ("-", True), (".", True)])
def test_spellings(make_mnist: Callable[..., Any], mnist_dir: Path, sep: str, gz: bool) -> None:
    images, labels = make_mnist(n_train=12, n_test=5, sep=sep, gz=gz)
    found = find_idx_file(mnist_dir, "train", "images", 3)
    assert found is not None and found.name.startswith(f"train-images{sep}idx3")
    table = load_mnist(mnist_dir, "train")
    assert torch.equal(table.columns[0], images.unsqueeze(-1))
    assert torch.equal(table.columns[1], labels.to(torch.uint32))


def test_mnist_columns(make_mnist: Callable[..., Any], mnist_dir: Path) -> None:
    images, labels = make_mnist(n_train=12, n_test=5)
    ds = MnistDataset(mnist_dir, shuffle=False)
    assert ds.get_col_names() == ["image", "label"] and len(ds) == 12
    rows = list(ds)
    image, label = rows[3]
    assert image.shape == (28, 28, 1) and image.dtype == torch.uint8
    assert label.shape == () and label.dtype == torch.uint32
    assert torch.equal(image[..., 0], images[3]) and int(label) == int(labels[3])


def test_mnist_usage(make_mnist: Callable[..., Any], mnist_dir: Path) -> None:
    make_mnist(n_train=12, n_test=5)
    assert len(MnistDataset(mnist_dir, usage="test")) == 5
    everything = MnistDataset(mnist_dir, usage="all", shuffle=False)
    labels = [int(label) for _, label in everything]
    assert labels == [i % 10 for i in range(17)]  # train first, then test
    assert len(MnistDataset(mnist_dir, usage=None)) == 17
    with pytest.raises(ValueError, match="usage='val' must be 'train', 'test', 'all'"):
        MnistDataset(mnist_dir, usage="val")


def test_mnist_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"does not exist; run `make data`"):
        MnistDataset(tmp_path / "absent")


def test_mnist_missing_file(make_mnist: Callable[..., Any], mnist_dir: Path) -> None:
    make_mnist()
    (mnist_dir / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(
        IdxFileNotFoundError, match=r"t10k-labels-idx1-ubyte .*not found.*make data"
    ):
        MnistDataset(mnist_dir, usage="test")
    assert len(MnistDataset(mnist_dir, usage="train")) == 20  # the train split is complete


def test_mnist_count_mismatch(make_mnist: Callable[..., Any], mnist_dir: Path) -> None:
    make_mnist(n_train=12)
    write_idx(mnist_dir / "train-labels-idx1-ubyte", torch.zeros(11, dtype=torch.uint8))
    with pytest.raises(IdxFormatError, match=r"holds 12 images but .* holds 11 labels"):
        MnistDataset(mnist_dir)


def test_mnist_wrong_kind(make_mnist: Callable[..., Any], mnist_dir: Path) -> None:
    make_mnist()
    write_idx(mnist_dir / "train-images-idx3-ubyte", torch.zeros(20, 4, dtype=torch.uint8))
    with pytest.raises(IdxFormatError, match=r"expected uint8 images of shape \(n, rows, cols\)"):
        MnistDataset(mnist_dir)
