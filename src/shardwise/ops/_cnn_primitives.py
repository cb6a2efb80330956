"""Convolution and pooling primitives: `Conv2D`, `MaxPool`, `AvgPool` (NCHW).

Each takes MindSpore's constructor arguments and computes the single-device result with torch
ops: the padding MindSpore's ``pad_mode`` implies (`shardwise.ops._cnn_specs.window`) is applied
with ``F.pad`` first, then ``F.conv2d`` / ``F.max_pool2d`` / ``F.avg_pool2d`` run unpadded.
Their sharding rules are in `shardwise.ops.rules` (families ``conv2d`` and ``pool``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.ops._base import Primitive
from shardwise.ops._cnn_specs import conv_pads, pair, window


def _mode(value: object, allowed: tuple[str, ...], who: str) -> str:
    if not isinstance(value, str) or value.lower() not in allowed:
        raise ValueError(f"{who}: pad_mode must be one of {allowed} (any case), got {value!r}")
    return value


def _format(value: object, who: str) -> str:
    if value != "NCHW":
        raise ValueError(f"{who}: data_format must be 'NCHW' (the only layout supported)")
    return value


def _padded(x: torch.Tensor, pads: tuple[int, int, int, int], value: float) -> torch.Tensor:
    """`x` padded by (top, bottom, left, right) on H and W."""
    if not any(pads):
        return x
    top, bottom, left, right = pads
    return F.pad(x, (left, right, top, bottom), value=value)


class Conv2D(Primitive):
    """2-D convolution (cross-correlation) of NCHW input (MindSpore ``ops.Conv2D``).

    Args:
        out_channel: C_out.
        kernel_size: an int or (kh, kw).
        mode: 1 (the only mode MindSpore has).
        pad_mode: ``"valid"`` (no padding), ``"same"`` (output ``ceil(H / stride)``, the
            padding split with the extra row / column after) or ``"pad"`` (`pad`).
        pad: with ``"pad"``: an int or (top, bottom, left, right).
        stride: an int, (h, w) or (1, 1, h, w).
        dilation: an int, (h, w) or (1, 1, h, w).
        group: channel groups (C_in and C_out divisible by it).
        data_format: ``"NCHW"`` only.

    Call ``op(x, weight)`` with weight [C_out, C_in / group, kh, kw]; returns [N, C_out, H_out,
    W_out]. Strategy ``((n, c_in, h, w), (c_out, c_in, 1, 1))`` (device matrix ``[n, c_in, h, w,
    c_out]``): N and C_out splits are local, a C_in split leaves partial sums (AllReduce over its
    axes); H and W must be 1 (a split would need a halo exchange), like the kernel dims.

    Example:
        >>> conv = Conv2D(16, 3, pad_mode="same").shard(((2, 1, 1, 1), (4, 1, 1, 1)))
        >>> y = conv(x, weight)          # x [32, 3, 28, 28], weight [16, 3, 3, 3]
    """

    input_names = ("x", "weight")

    def __init__(
        self,
        out_channel: int,
        kernel_size: int | tuple[int, int],
        mode: int = 1,
        pad_mode: str = "valid",
        pad: int | tuple[int, int, int, int] = 0,
        stride: int | tuple[int, ...] = 1,
        dilation: int | tuple[int, ...] = 1,
        group: int = 1,
        data_format: str = "NCHW",
    ) -> None:
        who = "Conv2D"
        for name, value in (("out_channel", out_channel), ("group", group)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{who}: {name} must be an int >= 1, got {value!r}")
        if mode != 1:
            raise ValueError(f"{who}: mode must be 1, got {mode!r}")
        if out_channel % group:
            raise ValueError(f"{who}: out_channel {out_channel} is not divisible by group {group}")
        pair(kernel_size, "kernel_size", who), pair(stride, "stride", who)
        pair(dilation, "dilation", who), conv_pads(pad, who)
        super().__init__(
            out_channel=out_channel,
            kernel_size=kernel_size,
            mode=mode,
            pad_mode=_mode(pad_mode, ("valid", "same", "pad"), who),
            pad=pad,
            stride=stride,
            dilation=dilation,
            group=group,
            data_format=_format(data_format, who),
        )

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        a = self.init_args()
        if x.dim() != 4 or weight.dim() != 4:
            raise ValueError(f"{self.who}: Conv2D takes 4-D x and weight, got {list(x.shape)}")
        kh, kw = int(weight.shape[2]), int(weight.shape[3])
        stride = pair(a["stride"], "stride", self.who)
        dilation = pair(a["dilation"], "dilation", self.who)
        mode, pads = str(a["pad_mode"]).lower(), conv_pads(a["pad"], self.who)
        _, top, bottom = window(x.shape[2], kh, stride[0], dilation[0], mode, pads[:2], self.who)
        _, left, right = window(x.shape[3], kw, stride[1], dilation[1], mode, pads[2:], self.who)
        x = _padded(x, (top, bottom, left, right), 0.0)
        return F.conv2d(x, weight, None, stride, 0, dilation, int(a["group"]))


class _Pool(Primitive):
    """MaxPool / AvgPool: the window arguments.

    Args:
        kernel_size: an int, (kh, kw) or (1, 1, kh, kw).
        strides: an int, (h, w) or (1, 1, h, w).
        pad_mode: ``"VALID"`` or ``"SAME"`` (any case; ``"SAME"``: output ``ceil(H /
            stride)``, the padding split with the extra one after).
        data_format: ``"NCHW"`` only.
    """

    def __init__(
        self,
        kernel_size: int | tuple[int, ...] = 1,
        strides: int | tuple[int, ...] = 1,
        pad_mode: str = "VALID",
        data_format: str = "NCHW",
    ) -> None:
        who = type(self).__name__
        pair(kernel_size, "kernel_size", who), pair(strides, "strides", who)
        super().__init__(
            kernel_size=kernel_size,
            strides=strides,
            pad_mode=_mode(pad_mode, ("valid", "same"), who),
            data_format=_format(data_format, who),
        )

    def _geometry(
        self, x: torch.Tensor
    ) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int, int, int]]:
        """(kernel, strides, (top, bottom, left, right)) for input `x`."""
        if x.dim() != 4:
            raise ValueError(f"{self.who}: {self.name} takes a 4-D input, got {list(x.shape)}")
        a = self.init_args()
        k = pair(a["kernel_size"], "kernel_size", self.who)
        s = pair(a["strides"], "strides", self.who)
        mode = str(a["pad_mode"]).lower()
        _, top, bottom = window(x.shape[2], k[0], s[0], 1, mode, (0, 0), self.who)
        _, left, right = window(x.shape[3], k[1], s[1], 1, mode, (0, 0), self.who)
        return k, s, (top, bottom, left, right)


class MaxPool(_Pool):
    """The maximum over each window (MindSpore ``ops.MaxPool``); see `_Pool` for the arguments.

    Strategy ``((n, c, 1, 1),)``: N and C splits are local; H and W must be 1 (a split would
    need a halo exchange). ``"SAME"`` pads with -inf (padding never wins).

    Example:
        >>> y = MaxPool(kernel_size=2, strides=2).shard(((8, 1, 1, 1),))(x)
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, s, pads = self._geometry(x)
        return F.max_pool2d(_padded(x, pads, float("-inf")), k, s)


class AvgPool(_Pool):
    """The mean over each window (MindSpore ``ops.AvgPool``); see `_Pool` for the arguments.

    Strategy as `MaxPool`. With ``"SAME"`` the padding is not counted: each output is the mean
    of the input values its window covers.

    Example:
        >>> y = AvgPool(kernel_size=2, strides=2).shard(((2, 4, 1, 1),))(x)
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, s, pads = self._geometry(x)
        if not any(pads):
            return F.avg_pool2d(x, k, s)
        ones = torch.ones((1, 1, *x.shape[2:]), dtype=x.dtype, device=x.device)
        covered = F.avg_pool2d(_padded(ones, pads, 0.0), k, s)
        return F.avg_pool2d(_padded(x, pads, 0.0), k, s) / covered
