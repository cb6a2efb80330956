"""The source datasets: `MnistDataset` (IDX files) and `GeneratorDataset` (Python data).

- `load_mnist`: finds and reads the IDX files of one usage (``train``, ``test`` or ``all``) and
  checks that images and labels agree; `MnistDataset` wraps the result.
- `GeneratorDataset`: a generator function, an iterable or a random-access object
  (``__getitem__`` + ``__len__``), via `_sources.make_source`.

Both capture their seed when created (`pipeline.pipeline_seed`): torch's once the script seeded
it (``sw.set_seed(s)`` or ``torch.manual_seed(s)``), else MindSpore's constant default seed;
either way one order that every rank shares.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from shardwise.dataset._args import as_int, check_flag, check_workers
from shardwise.dataset._shard import NumShards, ShardSetting
from shardwise.dataset._sources import TensorTable, make_source
from shardwise.dataset.idx import IdxFileNotFoundError, IdxFormatError, find_idx_file, read_idx
from shardwise.dataset.pipeline import Dataset, source_spec

__all__ = ["GeneratorDataset", "MnistDataset", "load_mnist"]

_HINT = "run `make data` (or `python -m shardwise.dataset.mnist_fetch --dest {dir}`) to fetch MNIST"
_PREFIX = {"train": ("train",), "test": ("t10k",), "all": ("train", "t10k")}


def _check_num_samples(num_samples: object, who: str) -> int | None:
    if num_samples is None:
        return None
    number = as_int(num_samples)
    if number is None or number < 1:
        raise ValueError(f"{who}: num_samples={num_samples!r} must be an int >= 1 or None (all)")
    return number


def _require(directory: Path, prefix: str, kind: str, ndim: int) -> Path:
    found = find_idx_file(directory, prefix, kind, ndim)
    if found is None:
        name = f"{prefix}-{kind}-idx{ndim}-ubyte"
        raise IdxFileNotFoundError(
            f"MnistDataset: {name} (or {prefix}-{kind}.idx{ndim}-ubyte, optionally .gz) not found "
            f"in {directory}; " + _HINT.format(dir=directory)
        )
    return found


def _read_split(directory: Path, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``(n, rows, cols, 1)`` uint8 and labels ``(n,)`` uint32 of one split."""
    image_file = _require(directory, prefix, "images", 3)
    label_file = _require(directory, prefix, "labels", 1)
    images, labels = read_idx(image_file), read_idx(label_file)
    if images.dim() != 3 or images.dtype != torch.uint8:
        raise IdxFormatError(
            f"{image_file}: expected uint8 images of shape (n, rows, cols), got {images.dtype} "
            f"{list(images.shape)}"
        )
    if labels.dim() != 1 or labels.dtype != torch.uint8:
        raise IdxFormatError(
            f"{label_file}: expected uint8 labels of shape (n,), got {labels.dtype} "
            f"{list(labels.shape)}"
        )
    if len(images) != len(labels):
        raise IdxFormatError(
            f"{image_file} holds {len(images)} images but {label_file} holds {len(labels)} "
            "labels; the files belong to different splits or one is damaged"
        )
    return images.unsqueeze(-1), labels.to(torch.uint32)


def load_mnist(dataset_dir: str | Path, usage: str | None = "train") -> TensorTable:
    """Read MNIST from IDX files into memory.

    Args:
        dataset_dir: folder holding ``train-images-idx3-ubyte`` etc. (``.idx3-ubyte`` and
            ``.gz`` spellings are accepted too).
        usage: ``"train"`` (60,000), ``"test"`` (10,000) or ``"all"`` (train then test);
            None means ``"all"``, as in MindSpore.

    Returns:
        A table of columns ``image`` (uint8 ``(n, 28, 28, 1)``) and ``label`` (uint32 ``(n,)``).

    Raises:
        ValueError: an unknown `usage`.
        IdxFileNotFoundError: the folder or a file is missing (the message says how to fetch).
        IdxFormatError: a damaged file (wrong magic, truncated, images/labels disagree).

    Example:
        >>> load_mnist("data/MNIST", "test").columns[0].shape
        torch.Size([10000, 28, 28, 1])
    """
    key = "all" if usage is None else usage
    if key not in _PREFIX:
        raise ValueError(f"MnistDataset: usage={usage!r} must be 'train', 'test', 'all' or None")
    directory = Path(dataset_dir)
    if not directory.is_dir():
        raise IdxFileNotFoundError(
            f"MnistDataset: dataset_dir {directory} does not exist; " + _HINT.format(dir=directory)
        )
    splits = [_read_split(directory, prefix) for prefix in _PREFIX[key]]
    images = torch.cat([s[0] for s in splits]) if len(splits) > 1 else splits[0][0]
    labels = torch.cat([s[1] for s in splits]) if len(splits) > 1 else splits[0][1]
    return TensorTable([images, labels])


class MnistDataset(Dataset):
    """MNIST from the original IDX files, columns ``image`` and ``label`` (MindSpore's API).

    Args:
        dataset_dir: folder with the IDX files (plain or ``.gz``); ``make data`` fills
            ``data/MNIST``.
        usage: ``"train"``, ``"test"`` or ``"all"`` (None: all, as in MindSpore).
        num_samples: read at most this many samples (per shard when sharded); None: all.
        shuffle: shuffle every epoch; None means True (MindSpore's default).
        num_shards: an int N to read one of N shards, ``"auto"`` to take N and the shard from
            ``shardwise.communication`` (world group size and rank; unsharded without a
            distributed job), or None.
        shard_id: this pipeline's shard in ``[0, N)`` when `num_shards` is an int.
        num_parallel_workers: DataLoader worker processes (0, or None as MindSpore's default:
            read in this process).

    Raises:
        FileNotFoundError: (`IdxFileNotFoundError`) a missing folder or file; the message says
            to run ``make data``.
        ValueError: a damaged file (`IdxFormatError`) or an invalid argument.

    Example:
        >>> sw.set_seed(1)
        >>> ds = sw.dataset.MnistDataset("data/MNIST", num_shards="auto")
        >>> ds = ds.map([vision.Rescale(1 / 255, 0), vision.HWC2CHW()], "image").batch(32)
        >>> image, label = next(iter(ds))        # (32, 1, 28, 28) float32, (32,) uint32
    """

    def __init__(
        self,
        dataset_dir: str | Path,
        usage: str | None = "train",
        num_samples: int | None = None,
        shuffle: bool | None = None,
        num_shards: NumShards = None,
        shard_id: int | None = None,
        *,
        num_parallel_workers: int | None = 0,
    ) -> None:
        shard = ShardSetting.create(num_shards, shard_id, "MnistDataset")
        spec = source_spec(
            load_mnist(dataset_dir, usage),
            ("image", "label"),
            shuffle=True if shuffle is None else check_flag(shuffle, "MnistDataset", "shuffle"),
            num_samples=_check_num_samples(num_samples, "MnistDataset"),
            shard=shard,
            workers=check_workers(num_parallel_workers, "MnistDataset"),
            label=f"MnistDataset({str(dataset_dir)!r}, usage={usage!r})",
        )
        super().__init__(spec)


def _column_names(column_names: object) -> tuple[str, ...]:
    names = (column_names,) if isinstance(column_names, str) else column_names
    if not isinstance(names, Sequence) or not names:
        raise ValueError(
            "GeneratorDataset: column_names must be a name or a non-empty list of names"
        )
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"GeneratorDataset: column_names must be strings, got {list(names)}")
    if len(set(names)) != len(names):
        raise ValueError(f"GeneratorDataset: column_names {list(names)} has duplicates")
    return tuple(names)


class GeneratorDataset(Dataset):
    """A dataset from Python data (MindSpore's ``GeneratorDataset``).

    Args:
        source: a random-access object (``source[i]`` and ``len(source)``), a list, a
            generator function (called again each epoch) or any iterable (read once per
            epoch; a one-shot iterator is read once in all; a torch ``IterableDataset`` is
            an iterable, with or without ``__len__``). Each row is a tuple with one
            value per column (tensor, NumPy array or number); a single column may yield bare
            values, and a random-access source may also return ``{name: value}`` dicts.
        column_names: a name or a list of names, one per value of a row.
        shuffle: shuffle every epoch (default True; None, MindSpore's default, too). Streams
            are read completely at the start of each epoch, so they shuffle and shard like
            random-access sources.
        num_samples: at most this many rows (per shard when sharded); None: all.
        num_shards: an int, ``"auto"`` or None, as in `MnistDataset`.
        shard_id: the shard when `num_shards` is an int.
        num_parallel_workers: DataLoader worker processes (0 or None: this process).

    Raises:
        TypeError: `source` is not indexable, callable or iterable; or bad column names.
        ValueError: empty or duplicate column names, invalid arguments; at iteration time, a
            row with the wrong number of values.

    Example:
        >>> def gen():
        ...     for i in range(8):
        ...         yield (torch.full((2,), i), i % 2)
        >>> ds = GeneratorDataset(gen, ["data", "label"], shuffle=False).batch(4)
        >>> [tuple(t.shape) for t in next(iter(ds))]
        [(4, 2), (4,)]
    """

    def __init__(
        self,
        source: Callable[[], Iterable[Any]] | Iterable[Any] | Any,
        column_names: str | Sequence[str],
        shuffle: bool | None = True,
        *,
        num_samples: int | None = None,
        num_shards: NumShards = None,
        shard_id: int | None = None,
        num_parallel_workers: int | None = 0,
    ) -> None:
        names = _column_names(column_names)
        shard = ShardSetting.create(num_shards, shard_id, "GeneratorDataset")
        spec = source_spec(
            make_source(source, names),
            names,
            shuffle=True if shuffle is None else check_flag(shuffle, "GeneratorDataset", "shuffle"),
            num_samples=_check_num_samples(num_samples, "GeneratorDataset"),
            shard=shard,
            workers=check_workers(num_parallel_workers, "GeneratorDataset"),
            label=f"GeneratorDataset({type(source).__name__}, {list(names)})",
        )
        super().__init__(spec)
