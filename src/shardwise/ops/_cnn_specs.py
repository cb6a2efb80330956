"""Convolution, pooling and BatchNorm: window geometry and spec builders.

- Geometry (shared with the primitives' forwards): `pair` reads MindSpore's int-or-tuple sizes,
  `conv_pads` reads Conv2D's ``pad``, `window` gives one spatial dim's output size and padding
  for ``"valid"`` / ``"same"`` / ``"pad"``.
- `conv2d_spec`: Conv2D ``[N, C_in, H, W] x [C_out, C_in / group, kh, kw]``: logical axes N,
  C_in, H, W, C_out (MindSpore's device matrix ``[n, c_in, h, w, c_out]``); C_in summed; H / W
  never split (that needs a halo exchange); the kernel dims are checked by
  `shardwise.ops.rules.conv2d_rule`.
- `pool_spec`: MaxPool / AvgPool: N and C split freely, H / W never.
- `batch_norm_spec`: BatchNorm ``(input_x, scale, bias, mean, variance)``: the four [C] tensors
  split like C; in training ``local="batch_stats"`` (statistics over the ranks splitting N / H /
  W, `shardwise.parallel._local`).

Builders validate shapes and arguments and raise ValueError naming `who`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from shardwise.ops._plan import Shape
from shardwise.ops._spec import Spec

HALO = (
    "is the {what} of {op} (a split would need a halo exchange with the neighbouring blocks, "
    "which shardwise does not do; split N or the channels instead)"
)


def _ints(value: object, count: int, least: int) -> list[int] | None:
    """`value` as `count` ints >= `least` (an int is repeated), else None."""
    values = [value] * count if isinstance(value, int) else value
    if not isinstance(values, tuple | list):
        return None
    out = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= least]
    return out if len(out) == len(values) else None


def pair(value: object, name: str, who: str) -> tuple[int, int]:
    """MindSpore's size argument: an int, ``(h, w)`` or ``(1, 1, h, w)`` -> ``(h, w)``."""
    values = _ints(value, 2, 1)
    if values is not None and len(values) == 4 and values[:2] == [1, 1]:
        values = values[2:]
    if values is None or len(values) != 2:
        raise ValueError(
            f"{who}: {name} must be a positive int, (h, w) or (1, 1, h, w), got {value!r}"
        )
    return values[0], values[1]


def conv_pads(pad: object, who: str) -> tuple[int, int, int, int]:
    """Conv2D's ``pad``: an int or ``(top, bottom, left, right)``."""
    values = _ints(pad, 4, 0)
    if values is None or len(values) != 4:
        raise ValueError(
            f"{who}: pad must be an int >= 0 or (top, bottom, left, right), got {pad!r}"
        )
    return values[0], values[1], values[2], values[3]


def window(
    size: int, kernel: int, stride: int, dilation: int, mode: str, pads: tuple[int, int], who: str
) -> tuple[int, int, int]:
    """One spatial dim: ``(output size, padding before, padding after)``.

    ``"valid"``: no padding; ``"same"``: output ``ceil(size / stride)``, the padding split with
    the extra one after; ``"pad"``: the given `pads`.
    """
    span = (kernel - 1) * dilation + 1
    lo, hi = 0, 0
    if mode == "same":
        out = -(-size // stride)
        total = max((out - 1) * stride + span - size, 0)
        lo, hi = total // 2, total - total // 2
    elif mode == "pad":
        lo, hi = pads
    if mode != "same":
        out = (size + lo + hi - span) // stride + 1
    if out <= 0:
        raise ValueError(
            f"{who}: a window of {span} (kernel {kernel}, dilation {dilation}) does not fit a dim "
            f"of size {size} with pad_mode {mode!r} and padding ({lo}, {hi})"
        )
    return out, lo, hi


def _arity(op: str, shapes: Sequence[Shape], names: tuple[str, ...], who: str) -> None:
    if len(shapes) != len(names):
        raise ValueError(
            f"{who}: {op} takes {len(names)} tensor inputs ({', '.join(names)}), got "
            f"{len(shapes)} shapes"
        )


def _nchw(op: str, x: Shape, who: str, args: Mapping[str, Any]) -> None:
    if len(x) != 4:
        raise ValueError(f"{who}: {op} takes an input of 4 dims [N, C, H, W], got {list(x)}")
    if args.get("data_format", "NCHW") != "NCHW":
        raise ValueError(f"{who}: {op} supports data_format='NCHW' only")


def _spatial(op: str) -> dict[int, str]:
    return {2: HALO.format(what="height H", op=op), 3: HALO.format(what="width W", op=op)}


def conv2d_spec(op_args: Mapping[str, Any], shapes: Sequence[Shape], who: str) -> Spec:
    """Conv2D: ``x [N, C_in, H, W]``, ``weight [C_out, C_in / group, kh, kw]`` -> ``[N, C_out,
    H_out, W_out]``; logical axes N = 0, C_in = 1 (summed), H = 2, W = 3, C_out = 4."""
    names = ("x", "weight")
    _arity("Conv2D", shapes, names, who)
    x, w = shapes
    _nchw("Conv2D", x, who, op_args)
    group, c_out = int(op_args.get("group", 1)), int(op_args["out_channel"])
    kh, kw = pair(op_args.get("kernel_size"), "kernel_size", who)
    want = (c_out, x[1] // group, kh, kw)
    if x[1] % group or tuple(w) != want:
        raise ValueError(
            f"{who}: weight must have shape [out_channel, C_in / group, kh, kw] = {list(want)} "
            f"for x {list(x)} (group={group}), got {list(w)}"
        )
    mode = str(op_args.get("pad_mode", "valid")).lower()
    pads = conv_pads(op_args.get("pad", 0), who)
    sh, sw = pair(op_args.get("stride", 1), "stride", who)
    dh, dw = pair(op_args.get("dilation", 1), "dilation", who)
    ho = window(x[2], kh, sh, dh, mode, pads[:2], who)[0]
    wo = window(x[3], kw, sw, dw, mode, pads[2:], who)[0]
    fixed = _spatial("Conv2D")
    if group != 1:
        why = f"is a channel dim of a grouped Conv2D (group={group})"
        fixed |= {1: why, 4: why}
    return Spec(
        "Conv2D",
        names,
        ((0, 1, 2, 3), (4, 1, None, None)),
        ((0, 4, 2, 3),),
        ((x[0], c_out, ho, wo),),
        reduced=(1,),
        fixed=fixed,
        roles={0: "the batch dim N", 1: "the input channels C_in", 4: "the output channels C_out"},
        batch=0,
    )


def pool_spec(op_args: Mapping[str, Any], shapes: Sequence[Shape], who: str) -> Spec:
    """MaxPool / AvgPool on ``[N, C, H, W]``: N and C split freely, H and W not."""
    op = str(op_args["op"])
    _arity(op, shapes, ("x",), who)
    x = shapes[0]
    _nchw(op, x, who, op_args)
    kh, kw = pair(op_args.get("kernel_size", 1), "kernel_size", who)
    sh, sw = pair(op_args.get("strides", 1), "strides", who)
    mode = str(op_args.get("pad_mode", "VALID")).lower()
    ho = window(x[2], kh, sh, 1, mode, (0, 0), who)[0]
    wo = window(x[3], kw, sw, 1, mode, (0, 0), who)[0]
    ids = (0, 1, 2, 3)
    return Spec(op, ("x",), (ids,), (ids,), ((x[0], x[1], ho, wo),), fixed=_spatial(op))


def batch_norm_spec(op_args: Mapping[str, Any], shapes: Sequence[Shape], who: str) -> Spec:
    """BatchNorm: ``input_x [N, C]`` or ``[N, C, H, W]`` and four [C] tensors -> ``y`` and four
    [C] statistics; every dim may be split (the [C] tensors like C)."""
    names = ("input_x", "scale", "bias", "mean", "variance")
    _arity("BatchNorm", shapes, names, who)
    x = shapes[0]
    if len(x) not in (2, 4):
        raise ValueError(f"{who}: BatchNorm takes input_x of 2 or 4 dims, got {list(x)}")
    if op_args.get("data_format", "NCHW") != "NCHW":
        raise ValueError(f"{who}: BatchNorm supports data_format='NCHW' only")
    for name, shape in zip(names[1:], shapes[1:], strict=True):
        if tuple(shape) != (x[1],):
            raise ValueError(f"{who}: {name} must have shape [C] = [{x[1]}], got {list(shape)}")
    ids = tuple(range(len(x)))
    training = bool(op_args.get("is_training", False))
    if training and math.prod(x) // x[1] < 2:
        raise ValueError(f"{who}: BatchNorm in training needs more than 1 value per channel")
    return Spec(
        "BatchNorm",
        names,
        (ids, (1,), (1,), (1,), (1,)),
        (ids, (1,), (1,), (1,), (1,)),
        (tuple(x), *((x[1],),) * 4),
        roles={0: "the batch dim N", 1: "the channel dim C"},
        local="batch_stats" if training else "",
    )
