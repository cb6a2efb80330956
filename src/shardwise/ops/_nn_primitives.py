"""Network primitives: `LayerNorm`, `BatchNorm`, `SoftmaxCrossEntropyWithLogits`, `Gather`
(`Dropout` is in `shardwise.ops._dropout`).

Each forward is the single-device result, with MindSpore's outputs:

- `LayerNorm` -> ``(y, mean, rstd)`` (MindSpore >= 2.3: the third output is the reciprocal of
  the standard deviation, ``1 / sqrt(variance + epsilon)``; mean and rstd keep the leading
  ``begin_norm_axis`` dims and have size 1 elsewhere).
- `BatchNorm` -> ``(y, batch_mean, batch_variance, reserve_space_1, reserve_space_2)``; in
  training the statistics are those of the whole batch: `batch_stats` combines each block's
  mean and sum of squared deviations (one entry per rank; one device: its own), and the
  running `mean` / `variance` inputs are updated in place.
- `SoftmaxCrossEntropyWithLogits` -> ``(loss [N], backprop [N, C])``.
- `Gather` -> ``params[..., indices, ...]`` along `axis` (with `batch_dims`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from shardwise.ops._base import REQUIRED, Primitive
from shardwise.ops._specs import norm_axis


class LayerNorm(Primitive):
    """Layer normalization over the dims from `begin_norm_axis` on (MindSpore ``ops.LayerNorm``).

    Args:
        begin_norm_axis: first normalized dim of input_x.
        begin_params_axis: gamma and beta have shape ``input_x.shape[begin_params_axis:]``.
        epsilon: added to the variance.

    Call ``op(input_x, gamma, beta)``; returns ``(y, mean, rstd)``. Strategy: the normalized
    dims not split; gamma / beta split like ``input_x[begin_params_axis:]``, e.g.
    ``((2, 1, 1), (1,), (1,))``.
    """

    input_names = ("input_x", "gamma", "beta")

    def __init__(
        self, begin_norm_axis: int = 1, begin_params_axis: int = 1, epsilon: float = 1e-7
    ) -> None:
        for name, value in (
            ("begin_norm_axis", begin_norm_axis),
            ("begin_params_axis", begin_params_axis),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"LayerNorm: {name} must be an int, got {value!r}")
        if not isinstance(epsilon, float):
            raise TypeError(f"LayerNorm: epsilon must be a float, got {epsilon!r}")
        super().__init__(
            begin_norm_axis=begin_norm_axis, begin_params_axis=begin_params_axis, epsilon=epsilon
        )

    def forward(
        self, input_x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        args = self.init_args()
        r = input_x.dim()
        bna = norm_axis(args["begin_norm_axis"], r, self.who, "begin_norm_axis")
        bpa = norm_axis(args["begin_params_axis"], r, self.who, "begin_params_axis")
        eps = float(args["epsilon"])
        if bna == bpa:
            y, mean, rstd = torch.native_layer_norm(input_x, input_x.shape[bna:], gamma, beta, eps)
            return y, mean, rstd
        dims = tuple(range(bna, r))
        mean = input_x.mean(dim=dims, keepdim=True)
        var = input_x.var(dim=dims, keepdim=True, unbiased=False)
        rstd = torch.rsqrt(var + eps)
        return (input_x - mean) * rstd * gamma + beta, mean, rstd


def batch_stats(stats: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and the sum of squared deviations of a whole batch from those of its blocks.

    Args:
        stats: [k, 2, C]: per block (k of them, `count` values per channel each), its mean and
            its sum of squared deviations from that mean.
        count: values per channel in one block.

    Returns:
        ([C] mean, [C] sum of squared deviations) of the k blocks together (Chan et al.'s
        pairwise combination, exact for equal block sizes).
    """
    means, m2 = stats[:, 0], stats[:, 1]
    mean = means.mean(dim=0)
    return mean, m2.sum(dim=0) + count * ((means - mean) ** 2).sum(dim=0)


def batch_norm_training(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor | None,
    variance: torch.Tensor | None,
    eps: float,
    momentum: float,
    gather: Callable[[torch.Tensor], torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training-mode batch normalization of `x` ([N, C, ...]) with the whole batch's statistics.

    This block's per-channel mean and sum of squared deviations, collected over the blocks of
    the batch by `gather` ([1, 2, C] -> [k, 2, C], autograd-aware; None: this block is the
    batch) and combined (`batch_stats`), normalize `x`; `scale` and `bias` (None: none) follow.
    The running `mean` / `variance` (None: none kept) are updated in place with `momentum` (the
    variance with the unbiased batch variance). Used by `BatchNorm` and by the plan executor's
    training ``F.batch_norm`` on split rows (`parallel/_local.batch_norm_split`).

    Returns:
        (y, the batch mean [C], the biased batch variance [C]).
    """
    dtype = x.dtype  # (statistics in float32 for half types, as torch's kernels keep them)
    if dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    view = (1, -1) + (1,) * (x.dim() - 2)
    dims = (0, *range(2, x.dim()))
    count = x.numel() // max(x.shape[1], 1)
    local_mean = x.mean(dim=dims)
    local_m2 = ((x - local_mean.reshape(view)) ** 2).sum(dim=dims)
    stats = torch.stack([local_mean, local_m2]).unsqueeze(0)
    blocks = gather(stats) if gather is not None else stats
    batch_mean, m2 = batch_stats(blocks, count)
    total = count * blocks.shape[0]
    batch_var = m2 / total
    inv = torch.rsqrt(batch_var + eps)
    y = (x - batch_mean.reshape(view)) * (inv if scale is None else inv * scale).reshape(view)
    if mean is not None and variance is not None:
        with torch.no_grad():
            mean.mul_(1 - momentum).add_(batch_mean.detach(), alpha=momentum)
            unbiased = m2.detach() / (total - 1) if total > 1 else batch_var.detach()
            variance.mul_(1 - momentum).add_(unbiased, alpha=momentum)
    y = y if bias is None else y + bias.reshape(view)
    return y.to(dtype), batch_mean, batch_var


class BatchNorm(Primitive):
    """Batch normalization over N (and H, W) per channel (MindSpore ``ops.BatchNorm``).

    Args:
        is_training: True: normalize with the batch's statistics and update `mean` / `variance`
            in place (``new = (1 - momentum) * old + momentum * batch``; the running variance
            takes the unbiased batch variance); False: normalize with `mean` / `variance`.
        epsilon: added to the variance.
        momentum: weight of the batch statistics in the running ones, in [0, 1].
        data_format: ``"NCHW"`` only.

    Call ``op(input_x, scale, bias, mean, variance)`` with input_x [N, C] or [N, C, H, W] and
    four [C] tensors; returns ``(y, batch_mean, batch_variance, reserve_space_1,
    reserve_space_2)``: in training the batch mean and (biased) variance, the reserve spaces
    equal to them; in inference `mean` and `variance` (copies). Strategy ``((n, c, h, w), (c,),
    (c,), (c,), (c,))``, any split; in training the statistics are those of the *global* batch
    (the blocks' statistics gathered over the axes splitting N / H / W), so a split batch trains
    exactly like one device (MindSpore uses SyncBatchNorm only on Ascend).

    Example:
        >>> bn = BatchNorm(is_training=True).shard(((8, 1, 1, 1), (1,), (1,), (1,), (1,)))
        >>> y, *_ = bn(x, gamma, beta, running_mean, running_var)
    """

    input_names = ("input_x", "scale", "bias", "mean", "variance")

    def __init__(
        self,
        is_training: bool = False,
        epsilon: float = 1e-5,
        momentum: float = 0.1,
        data_format: str = "NCHW",
    ) -> None:
        if not isinstance(is_training, bool):
            raise TypeError(f"BatchNorm: is_training must be a bool, got {is_training!r}")
        for name, value, lo in (("epsilon", epsilon, 0.0), ("momentum", momentum, 0.0)):
            if not isinstance(value, float | int) or not lo <= value <= 1:
                raise ValueError(f"BatchNorm: {name} must be a float in [0, 1], got {value!r}")
        if data_format != "NCHW":
            raise ValueError("BatchNorm: data_format must be 'NCHW' (the only layout supported)")
        super().__init__(
            is_training=is_training,
            epsilon=float(epsilon),
            momentum=float(momentum),
            data_format=data_format,
        )
        self._gather: Callable[[torch.Tensor], torch.Tensor] | None = None

    def set_next_gather(self, gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Use `gather` ([1, 2, C] -> [k, 2, C], autograd-aware) in the next training forward
        to collect the statistics of the k blocks of the batch (the parallel runtime passes an
        AllGather over the ranks splitting N / H / W)."""
        self._gather = gather

    def forward(
        self,
        input_x: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor,
        mean: torch.Tensor,
        variance: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        args = self.init_args()
        x, eps = input_x, float(args["epsilon"])
        view = (1, -1) + (1,) * (x.dim() - 2)
        gather, self._gather = self._gather, None
        if not args["is_training"]:
            y = (x - mean.reshape(view)) * (torch.rsqrt(variance + eps) * scale).reshape(view)
            return (
                y + bias.reshape(view),
                mean.clone(),
                variance.clone(),
                mean.clone(),
                variance.clone(),
            )
        m = float(args["momentum"])
        y, batch_mean, batch_var = batch_norm_training(
            x, scale, bias, mean, variance, eps, m, gather
        )
        return y, batch_mean, batch_var, batch_mean.clone(), batch_var.clone()


class SoftmaxCrossEntropyWithLogits(Primitive):
    """Cross entropy of ``softmax(logits)`` against (one-hot or soft) labels, per sample
    (MindSpore ``ops.SoftmaxCrossEntropyWithLogits``).

    Call ``op(logits, labels)`` with both [N, C]; returns ``(loss [N], backprop [N, C])`` where
    ``backprop = softmax(logits) - labels`` (the gradient of the summed loss). Strategy: the
    class dim not split, e.g. ``((8, 1), (8, 1))``.
    """

    input_names = ("logits", "labels")

    def __init__(self) -> None:
        super().__init__()

    def forward(
        self, logits: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss = -(labels * torch.log_softmax(logits, -1)).sum(-1)
        return loss, torch.softmax(logits, -1) - labels


class Gather(Primitive):
    """Take slices of `input_params` along `axis` at `input_indices` (MindSpore ``ops.Gather``).

    Args:
        batch_dims: leading dims shared by params and indices (gathered per batch element).

    Call ``op(input_params, input_indices, axis)``; the output has shape
    ``params[:axis] + indices[batch_dims:] + params[axis + 1:]``. Strategy ``(params, indices)``;
    params split on `axis` (an embedding split by rows) means each rank looks up only the rows it
    holds and the results are summed (AllReduce); split on other dims, no communication.

    Example:
        >>> Gather().shard(((1, 8), (1, 1)))(table, ids, 0)      # table split by columns
    """

    input_names = ("input_params", "input_indices")
    call_args = (("axis", REQUIRED),)

    def __init__(self, batch_dims: int = 0) -> None:
        if isinstance(batch_dims, bool) or not isinstance(batch_dims, int) or batch_dims < 0:
            raise TypeError(f"Gather: batch_dims must be an int >= 0, got {batch_dims!r}")
        super().__init__(batch_dims=batch_dims)

    def forward(
        self, input_params: torch.Tensor, input_indices: torch.Tensor, axis: int
    ) -> torch.Tensor:
        params, indices = input_params, input_indices
        b = int(self.init_args()["batch_dims"])
        axis = norm_axis(axis, params.dim(), self.who)
        shape = (*params.shape[:axis], *indices.shape[b:], *params.shape[axis + 1 :])
        if b == 0:
            return params.index_select(axis, indices.reshape(-1)).reshape(shape)
        batch = math.prod(params.shape[:b])
        flat = params.reshape(batch, *params.shape[b:]).movedim(axis - b + 1, 1)
        rows = torch.arange(batch, device=params.device).unsqueeze(1)
        out = flat[rows, indices.reshape(batch, -1)]  # [batch, K, params[b:axis], params[axis+1:]]
        return out.movedim(1, 1 + axis - b).reshape(shape)
