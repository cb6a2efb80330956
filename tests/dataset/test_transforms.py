"""Transforms against hand-computed values, one sample and a stack of samples."""

from __future__ import annotations

import pytest
import torch

from shardwise.dataset import transforms, vision


def test_rescale() -> None:
    x = torch.tensor([[0, 51, 255]], dtype=torch.uint8)
    out = vision.Rescale(1.0 / 255.0, 0)(x)
    assert out.dtype == torch.float32
    assert torch.allclose(out, torch.tensor([[0.0, 0.2, 1.0]]), rtol=0, atol=1e-7)
    out = vision.Rescale(0.5, -1.0)(torch.tensor([2, 4]))
    assert torch.equal(out, torch.tensor([0.0, 1.0]))


def test_rescale_rejects_non_numbers() -> None:
    with pytest.raises(TypeError, match="Rescale: shift must be a number"):
        vision.Rescale(1.0, "0")  # type: ignore[arg-type]


def test_normalize_hwc() -> None:
    x = torch.tensor([[[10.0, 20.0, 30.0]]])  # H=1, W=1, C=3
    out = vision.Normalize(mean=[10.0, 10.0, 10.0], std=[1.0, 2.0, 4.0])(x)
    assert out.shape == (1, 1, 3) and out.dtype == torch.float32
    assert torch.equal(out, torch.tensor([[[0.0, 5.0, 5.0]]]))


def test_normalize_chw_and_mnist_values() -> None:
    x = torch.full((2, 1, 1), 3.0)
    x[1] = 5.0
    out = vision.Normalize(mean=(1.0, 1.0), std=(2.0, 4.0), is_hwc=False)(x)
    assert torch.equal(out.flatten(), torch.tensor([1.0, 1.0]))
    pixel = vision.Rescale(1.0 / 255.0, 0)(torch.full((1, 1, 1), 255, dtype=torch.uint8))
    out = vision.Normalize(mean=(0.1307,), std=(0.3081,))(pixel)
    assert torch.allclose(out.flatten(), torch.tensor([(1.0 - 0.1307) / 0.3081]), atol=1e-6)


def test_normalize_2d_and_broadcast() -> None:
    out = vision.Normalize((0.5,), (0.25,))(torch.ones(2, 2))
    assert torch.equal(out, torch.full((2, 2), 2.0))
    out = vision.Normalize((1.0,), (2.0,))(torch.full((1, 1, 3), 3.0))  # one value, 3 channels
    assert torch.equal(out, torch.ones(1, 1, 3))


def test_normalize_errors() -> None:
    with pytest.raises(ValueError, match=r"every std value must lie in \(0.0, 255.0\]"):
        vision.Normalize((0.5,), (0.0,))
    with pytest.raises(ValueError, match=r"every mean value must lie in \[0.0, 255.0\]"):
        vision.Normalize((300.0,), (1.0,))
    with pytest.raises(ValueError, match="mean has 2 values but std has 1"):
        vision.Normalize((0.5, 0.5), (1.0,))
    with pytest.raises(TypeError, match="mean must be a list or tuple"):
        vision.Normalize(0.5, (1.0,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the image has 3 channels"):
        vision.Normalize((0.5, 0.5), (1.0, 1.0))(torch.zeros(2, 2, 3))
    with pytest.raises(ValueError, match=r"expected an image <H, W> or <H, W, C>"):
        vision.Normalize((0.5,), (1.0,))(torch.zeros(2))


def test_hwc2chw() -> None:
    x = torch.arange(2 * 3 * 4).reshape(2, 3, 4)  # H=2, W=3, C=4
    out = vision.HWC2CHW()(x)
    assert out.shape == (4, 2, 3)
    assert out[1, 0, 2] == x[0, 2, 1]
    flat = torch.zeros(5, 6)
    assert vision.HWC2CHW()(flat) is flat  # <H, W> stays unchanged
    with pytest.raises(ValueError, match="HWC2CHW: expected an image"):
        vision.HWC2CHW()(torch.zeros(1, 2, 3, 4))


def test_typecast() -> None:
    label = torch.tensor(7, dtype=torch.uint32)
    assert transforms.TypeCast(torch.int32)(label).dtype == torch.int32
    assert transforms.TypeCast("int64")(label).dtype == torch.int64
    assert transforms.TypeCast("mindspore.float32")(label).dtype == torch.float32
    assert transforms.TypeCast(torch.int32)(torch.tensor(7.9)).item() == 7
    with pytest.raises(ValueError, match="unknown dtype name 'int33'"):
        transforms.TypeCast("int33")
    with pytest.raises(TypeError, match="expected a torch dtype"):
        transforms.TypeCast(32)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "op",
    [
        vision.Rescale(1.0 / 255.0, -0.5),
        vision.Normalize((0.1, 0.2, 0.3), (0.5, 0.6, 0.7)),
        vision.Normalize((0.1, 0.2), (0.5, 0.6), is_hwc=False),
        vision.HWC2CHW(),
        transforms.TypeCast(torch.float64),
    ],
)
def test_batch_equals_per_sample(op: transforms.Transform) -> None:
    gen = torch.Generator().manual_seed(0)
    stack = torch.randint(0, 256, (5, 2, 4, 3), generator=gen, dtype=torch.uint8)
    if isinstance(op, vision.Normalize) and not op.is_hwc:
        stack = stack[..., :2].movedim(-1, -3).contiguous()  # (5, C=2, H, W)
    expected = torch.stack([op(s) for s in stack])
    assert torch.equal(op.apply_batch(stack), expected)
