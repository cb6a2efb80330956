"""Pipeline behaviour: map, batch, shuffle determinism, iterators, GeneratorDataset sources."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset as TorchDataset
from torch.utils.data import IterableDataset as TorchIterableDataset

from shardwise.dataset import Dataset, GeneratorDataset, MnistDataset, transforms, vision


def numbered(n: int, shuffle: bool = False, seed: int = 0) -> Dataset:
    """Rows (i, 10 * i) for i < n, created under torch seed `seed`."""
    torch.manual_seed(seed)
    return GeneratorDataset([(i, 10 * i) for i in range(n)], ["a", "b"], shuffle=shuffle)


def firsts(ds: Dataset) -> list[int]:
    """Column 0 of one epoch, flattened."""
    return [int(v) for row in ds for v in row[0].reshape(-1)]


def test_mnist_seed_pipeline(make_mnist: Callable[..., Any], mnist_dir: Path) -> None:
    images, labels = make_mnist(n_train=70)
    ds = MnistDataset(mnist_dir, shuffle=False)
    ds = ds.map(
        [
            vision.Rescale(1.0 / 255.0, 0),
            vision.Normalize(mean=(0.1307,), std=(0.3081,)),
            vision.HWC2CHW(),
        ],
        "image",
    )
    ds = ds.map(transforms.TypeCast(torch.int32), "label").batch(32)
    batches = list(ds)
    assert len(ds) == 3 and [b[0].shape[0] for b in batches] == [32, 32, 6]
    image, label = batches[1]
    assert image.shape == (32, 1, 28, 28) and image.dtype == torch.float32
    assert label.dtype == torch.int32 and label.tolist() == labels[32:64].tolist()
    expected = (images[32:64].float() / 255.0 - 0.1307) / 0.3081
    assert torch.allclose(image[:, 0], expected, rtol=1e-6, atol=1e-6)


def test_map_several_columns_and_callables() -> None:
    ds = numbered(6).map(transforms.TypeCast(torch.float32), ["a", "b"])
    ds = ds.map(lambda a, b: (a + b, a - b), ["a", "b"])  # one value per input column
    ds = ds.map([lambda b: b * 2, lambda b: b + 1], "b")  # ops apply in order
    rows = list(ds)
    assert rows[2][0].dtype == torch.float32
    assert [(float(a), float(b)) for a, b in rows][:3] == [(0, 1), (11, -17), (22, -35)]


def test_map_after_batch_sees_batches() -> None:
    seen: list[tuple[int, ...]] = []

    def record(a: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(a.shape))
        return a.sum(dim=0, keepdim=True)

    out = list(numbered(10).batch(4).map(record, "a"))
    assert seen == [(4,), (4,), (2,)]
    assert [int(b[0]) for b in out] == [6, 22, 17]


def test_map_errors() -> None:
    ds = numbered(4)
    with pytest.raises(ValueError, match=r"unknown input column\(s\) \['c'\].*\['a', 'b'\]"):
        ds.map(transforms.TypeCast(torch.int32), "c")
    with pytest.raises(TypeError, match="is not callable"):
        ds.map([3], "a")  # type: ignore[list-item]
    with pytest.raises(ValueError, match="returned 1 value"):
        list(ds.map(lambda a, b: a, ["a", "b"]))


def test_batch_drop_remainder() -> None:
    kept = numbered(10).batch(4)
    assert len(kept) == 3 and [len(b[0]) for b in kept] == [4, 4, 2]
    dropped = numbered(10).batch(4, drop_remainder=True)
    assert len(dropped) == 2 and firsts(dropped) == list(range(8))
    with pytest.raises(ValueError, match="already batched"):
        dropped.batch(2)
    with pytest.raises(ValueError, match="batch_size=0 must be an int >= 1"):
        numbered(3).batch(0)


def test_batch_of_unequal_shapes() -> None:
    ds = GeneratorDataset([(torch.zeros(2),), (torch.zeros(3),)], "x", shuffle=False)
    assert [tuple(r[0].shape) for r in ds] == [(2,), (3,)]
    with pytest.raises(ValueError, match=r"column 'x' has rows of different shapes"):
        list(ds.batch(2))


def test_shuffle_determinism() -> None:
    def order(seed: int, epochs: int = 1) -> list[list[int]]:
        ds = numbered(50, shuffle=True, seed=seed).shuffle(8).batch(5)
        return [firsts(ds) for _ in range(epochs)]

    first, second = order(1, epochs=2)
    assert sorted(first) == list(range(50))
    assert first != second  # the next epoch reshuffles
    assert order(1, epochs=2) == [first, second]  # same seed: bit-for-bit the same
    assert order(2)[0] != first  # another seed: another order
    ds = numbered(50, shuffle=True, seed=1).shuffle(8).batch(5)
    ds.set_epoch(1)
    assert firsts(ds) == second


def test_shuffle_does_not_touch_global_rng() -> None:
    ds = numbered(20, shuffle=True)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    firsts(ds.batch(3))
    assert torch.equal(torch.rand(3), expected)


def test_buffer_shuffle_and_batch_shuffle() -> None:
    plain = firsts(numbered(30).batch(3))
    assert plain == list(range(30))
    small = firsts(numbered(30).shuffle(2))
    assert sorted(small) == plain and small != plain
    moved = list(numbered(30).batch(3).shuffle(10))
    assert sorted(int(b[0][0]) for b in moved) == list(range(0, 30, 3))
    assert all(b[0].tolist() == list(range(int(b[0][0]), int(b[0][0]) + 3)) for b in moved)
    with pytest.raises(ValueError, match="buffer_size=1 must be an int >= 2"):
        numbered(3).shuffle(1)


def test_iterators() -> None:
    ds = numbered(6).batch(4)
    it = ds.create_tuple_iterator(num_epochs=2)
    epochs = [[int(a[0]) for a, _ in it] for _ in range(2)]
    assert epochs == [[0, 4], [0, 4]]
    with pytest.raises(RuntimeError, match=r"epoch\(s\) \(num_epochs=2\) are done"):
        next(it)  # (MindSpore: a fetch past the last epoch is an error, not an empty epoch)
    rows = ds.create_dict_iterator(num_epochs=1)
    with pytest.raises(RuntimeError, match="num_epochs=1"):
        for _ in range(2):  # (one epoch more than the iterator was made for)
            for _ in rows:
                pass
    picked = next(numbered(6).create_tuple_iterator(columns=["b"]))
    assert len(picked) == 1 and int(picked[0]) == 0
    row = next(numbered(6).create_dict_iterator())
    assert list(row) == ["a", "b"] and int(row["b"]) == 0
    arr = next(numbered(6).create_tuple_iterator(output_numpy=True))[1]
    assert type(arr).__module__ == "numpy"
    with pytest.raises(ValueError, match=r"unknown column\(s\) \['z'\]"):
        numbered(2).create_tuple_iterator(columns=["z"])


def test_num_samples(make_mnist: Callable[..., Any], mnist_dir: Path) -> None:
    make_mnist(n_train=20)
    assert len(MnistDataset(mnist_dir, num_samples=7)) == 7
    assert len(MnistDataset(mnist_dir, num_samples=70)) == 20
    with pytest.raises(ValueError, match="num_samples=0 must be an int >= 1"):
        MnistDataset(mnist_dir, num_samples=0)


def test_generator_function_is_called_each_epoch() -> None:
    calls: list[int] = []

    def gen() -> Iterator[tuple[int, torch.Tensor]]:
        calls.append(1)
        for i in range(5):
            yield i, torch.full((2,), float(i) + len(calls))

    ds = GeneratorDataset(gen, ["id", "x"], shuffle=False)
    assert len(ds) == 5  # reads epoch 0's rows, kept for the first iteration
    first = list(ds)
    second = list(ds)
    assert len(calls) == 2
    assert [int(r[0]) for r in first] == [0, 1, 2, 3, 4]
    assert float(first[0][1][0]) == 1.0 and float(second[0][1][0]) == 2.0


def test_generator_sources() -> None:
    class Squares:
        def __getitem__(self, i: int) -> tuple[int, int]:
            return i, i * i

        def __len__(self) -> int:
            return 7

    class Dicts:
        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"y": i + 1, "x": [i, i]}

        def __len__(self) -> int:
            return 3

    squares = GeneratorDataset(Squares(), ["i", "sq"], shuffle=False).batch(3)
    assert [b[1].tolist() for b in squares] == [[0, 1, 4], [9, 16, 25], [36]]
    dicts = list(GeneratorDataset(Dicts(), ["x", "y"], shuffle=False))
    assert dicts[2][0].tolist() == [2, 2] and int(dicts[2][1]) == 3
    one_shot = GeneratorDataset((torch.tensor([i]) for i in range(4)), "v", shuffle=False)
    assert firsts(one_shot) == [0, 1, 2, 3] and firsts(one_shot) == [0, 1, 2, 3]
    shuffled = GeneratorDataset(Squares(), ["i", "sq"])  # shuffle=True by default
    assert sorted(firsts(shuffled)) == list(range(7))


def test_generator_errors() -> None:
    with pytest.raises(TypeError, match="source must be a generator function"):
        GeneratorDataset(3, "x")
    with pytest.raises(ValueError, match="has duplicates"):
        GeneratorDataset([1], ["x", "x"])
    bad = GeneratorDataset([(1, 2, 3)], ["a", "b"])
    with pytest.raises(ValueError, match=r"row 0.* has 3 value\(s\) but column_names has 2"):
        list(bad)
    with pytest.raises(TypeError, match="strings are not supported"):
        list(GeneratorDataset([("text",)], "s"))
    # an empty source gives no batch, as its len() says (it failed stacking no rows)
    assert (
        list(GeneratorDataset([], "x").batch(2))
        == []
        == [None] * len(GeneratorDataset([], "x").batch(2))
    )
    # a flag given as a string was taken by its truth: "False" kept the last partial batch
    with pytest.raises(TypeError, match=r"batch: drop_remainder='False' must be True or False"):
        GeneratorDataset([1, 2, 3], "x").batch(2, drop_remainder="False")
    with pytest.raises(TypeError, match=r"GeneratorDataset: shuffle='False' must be True"):
        GeneratorDataset([1, 2, 3], "x", shuffle="False")


def test_worker_processes_give_the_same_batches() -> None:
    def make(workers: int) -> Dataset:
        torch.manual_seed(3)
        ds = GeneratorDataset([(i, i) for i in range(40)], ["a", "b"], num_parallel_workers=workers)
        return ds.map(lambda a: a * 2, "a").batch(8)

    assert firsts(make(1)) == firsts(make(0))


def test_random_map_ops_replay_and_leave_the_global_rng() -> None:
    # in this process a random map op drew from torch's global RNG: the model's next numbers
    # changed, set_epoch(0) did not replay the batch, and worker processes gave other batches
    def noisy(x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(())

    def epoch0(workers: int) -> tuple[list[float], list[float], torch.Tensor]:
        torch.manual_seed(1)
        ds = GeneratorDataset([float(i) for i in range(8)], "x", num_parallel_workers=workers)
        ds = ds.map(noisy).batch(4)
        first = [v for b in ds for v in b[0].tolist()]
        after = torch.rand(2)  # what the model draws next
        ds.set_epoch(0)
        return first, [v for b in ds for v in b[0].tolist()], after

    torch.manual_seed(1)
    untouched = torch.rand(2)
    first, replay, after = epoch0(0)
    assert torch.equal(after, untouched)
    assert replay == first and sorted(int(v) for v in first) == list(range(8))
    assert epoch0(2)[:2] == (first, first)


def test_repr_and_sizes() -> None:
    ds = numbered(9).map(transforms.TypeCast("int32"), "a").batch(4, drop_remainder=True)
    assert repr(ds).startswith("GeneratorDataset(list, ['a', 'b']) -> map(TypeCast on ['a'])")
    assert ds.get_batch_size() == 4 and ds.get_dataset_size() == 2 and ds.get_shard() == (1, 0)


def test_torch_iterable_dataset_with_len_is_a_stream() -> None:
    # torch's Dataset base defines a __getitem__ that raises NotImplementedError: a sized
    # IterableDataset was read as random-access and failed at the first batch
    class Stream(TorchIterableDataset[tuple[torch.Tensor, int]]):
        def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
            return iter([(torch.tensor([float(i)]), i % 2) for i in range(6)])

        def __len__(self) -> int:
            return 6

    class IterOnly(TorchDataset[int]):  # a map-style Dataset that only iterates
        def __iter__(self) -> Iterator[int]:
            return iter(range(4))

        def __len__(self) -> int:
            return 4

    ds = GeneratorDataset(Stream(), ["x", "y"], shuffle=False).batch(3)
    assert [b[0].flatten().tolist() for b in ds] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert len(ds) == 2
    assert firsts(GeneratorDataset(IterOnly(), "v", shuffle=False)) == [0, 1, 2, 3]

    class Neither(TorchDataset[int]):
        def __len__(self) -> int:
            return 4

    with pytest.raises(TypeError, match="neither __getitem__ nor __iter__"):
        GeneratorDataset(Neither(), "v")


def test_numpy_integers_and_mindspores_none_defaults(
    make_mnist: Callable[..., Any], mnist_dir: Path
) -> None:
    # np.int32(0) was refused as "must be an int in [0, 2)"; None, MindSpore's default for
    # num_parallel_workers (and GeneratorDataset's shuffle), was refused too
    make_mnist(n_train=20)
    mnist = MnistDataset(
        mnist_dir, num_samples=np.int64(5), num_shards=np.int64(2), shard_id=np.int32(1)
    )
    assert mnist.get_shard() == (2, 1) and len(mnist) == 5
    assert type(mnist.num_shards) is int and type(mnist.shard_id) is int
    assert len(MnistDataset(mnist_dir, num_parallel_workers=None)) == 20
    ds = numbered(10).shuffle(np.int64(4)).batch(np.int64(2), drop_remainder=True)
    assert ds.get_batch_size() == 2 and len(ds) == 5
    ds.set_epoch(np.int64(2))
    assert sorted(firsts(ds)) == list(range(10))
    assert len(list(numbered(4).batch(2).create_tuple_iterator(num_epochs=np.int64(1)))) == 2
    gen = GeneratorDataset(list(range(6)), "x", shuffle=None, num_parallel_workers=None)
    assert sorted(firsts(gen)) == list(range(6)) and firsts(gen) != list(range(6))
    with pytest.raises(ValueError, match=r"batch: batch_size=True must be an int >= 1"):
        numbered(4).batch(True)
    with pytest.raises(ValueError, match=r"shard_id=np.int64\(2\) must be an int in \[0, 2\)"):
        GeneratorDataset([1], "x", num_shards=2, shard_id=np.int64(2))
    with pytest.raises(ValueError, match=r"set_epoch: epoch=np.int64\(-1\) must be an int >= 0"):
        numbered(2).set_epoch(np.int64(-1))
