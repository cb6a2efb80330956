"""Datasets with MindSpore's API, yielding torch tensors: ``sw.dataset``.

``MnistDataset(dir).map([...], "image").batch(32)`` reads, transforms and batches on top of
``torch.utils.data.DataLoader``; ``num_shards``/``shard_id`` (or ``num_shards="auto"``) make
each rank read only its rows ``[r*b, (r+1)*b)`` of every global batch. See docs/dataset.md.

Where each step lives:

- `sources`: `MnistDataset`, `GeneratorDataset` (and `load_mnist`).
- `pipeline`: `Dataset` with ``map``/``shuffle``/``batch``, iteration, sizes.
- `_order`: seeded global order, buffered shuffles, per-rank sharding (indices only).
- `_shard`: explicit vs ``"auto"`` shards; seed agreement across ranks.
- `_sources` / `_fetch`: tables of rows, and the DataLoader-side fetch with vectorized maps.
- `_iterate`: MindSpore's multi-epoch tuple/dict iterators.
- `vision` (Rescale, Normalize, HWC2CHW), `transforms` (TypeCast, Transform).
- `idx`: the IDX reader/writer; `mnist_fetch`: ``python -m shardwise.dataset.mnist_fetch``.
"""

from shardwise.dataset import transforms, vision
from shardwise.dataset.idx import IdxFileNotFoundError, IdxFormatError, read_idx, write_idx
from shardwise.dataset.pipeline import Dataset
from shardwise.dataset.sources import GeneratorDataset, MnistDataset, load_mnist

__all__ = [
    "Dataset",
    "GeneratorDataset",
    "IdxFileNotFoundError",
    "IdxFormatError",
    "MnistDataset",
    "load_mnist",
    "read_idx",
    "transforms",
    "vision",
    "write_idx",
]
