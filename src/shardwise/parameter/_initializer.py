"""MindSpore's ``initializer(init, shape, dtype)`` and its initializer classes, on torch's RNG.

Every random initializer draws from torch's global generator (through in-place
``normal_`` / ``uniform_``), so ``torch.manual_seed`` makes it repeatable, and inside
``sw.no_init_parameters()`` the very same calls are recorded instead of run (see
``_recorder``), which is what makes deferred values bit-identical to eager ones.

- `initializer`: validates ``init``/``shape``/``dtype``, creates the tensor, fills it.
- `Initializer` and its subclasses (`Normal`, `Uniform`, `TruncatedNormal`, `XavierUniform`,
  `XavierNormal`, `HeNormal`, `HeUniform`, `Zero`, `One`, `Constant`): one fill rule each.
- `fan_in_and_fan_out`: MindSpore's fan definition (dim 1 x receptive field = fan-in,
  dim 0 x receptive field = fan-out; fewer than 2 dims is an error).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from shardwise.parameter._errors import InitializerError

ShapeLike = int | Sequence[int] | torch.Size


def fan_in_and_fan_out(shape: Sequence[int]) -> tuple[int, int]:
    """Return MindSpore's ``(fan_in, fan_out)`` for a weight of this shape.

    Args:
        shape: the weight shape; at least 2 dims. Dim 1 counts inputs, dim 0 outputs, and
            the trailing dims are the receptive field that multiplies both.

    Returns:
        ``(fan_in, fan_out)``.

    Example:
        >>> fan_in_and_fan_out([16, 8, 3, 3])
        (72, 144)
    """
    if len(shape) < 2:
        raise InitializerError(
            f"fan_in and fan_out need a shape with at least 2 dimensions, got {list(shape)}"
        )
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


def _gain(nonlinearity: str, negative_slope: float) -> float:
    linear = {"linear", "conv1d", "conv2d", "conv3d", "sigmoid"}
    if nonlinearity in linear:
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3.0
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        return math.sqrt(2.0 / (1.0 + negative_slope**2))
    raise InitializerError(
        f"unsupported nonlinearity {nonlinearity!r}; use one of "
        "'linear', 'sigmoid', 'tanh', 'relu', 'leaky_relu'"
    )


def _fan(shape: Sequence[int], mode: str) -> int:
    if mode not in ("fan_in", "fan_out"):
        raise InitializerError(f"mode must be 'fan_in' or 'fan_out', got {mode!r}")
    fan_in, fan_out = fan_in_and_fan_out(shape)
    return fan_in if mode == "fan_in" else fan_out


class Initializer:
    """Base class: ``init(tensor)`` fills ``tensor`` in place (without autograd) and returns it.

    `draws`: the fill draws random real numbers, so it needs a floating-point tensor.
    """

    draws = False

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.draws and not tensor.dtype.is_floating_point:
            raise TypeError(
                f"initializer {type(self).__name__} draws random floating-point values and "
                f"cannot fill a tensor of dtype {tensor.dtype}; give a floating-point dtype "
                f"(torch.float32, torch.float16, torch.bfloat16, torch.float64), or for an "
                f"integer tensor a constant init ('zeros', 'ones', a number)"
            )
        with torch.no_grad():
            self._fill(tensor)
        return tensor

    def _fill(self, tensor: torch.Tensor) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class Normal(Initializer):
    """N(mean, sigma**2); MindSpore's defaults ``sigma=0.01, mean=0.0``."""

    draws = True

    def __init__(self, sigma: float = 0.01, mean: float = 0.0) -> None:
        self.sigma = sigma
        self.mean = mean

    def _fill(self, tensor: torch.Tensor) -> None:
        tensor.normal_(self.mean, self.sigma)


class Uniform(Initializer):
    """U(-scale, scale); MindSpore's default ``scale=0.07``."""

    draws = True

    def __init__(self, scale: float = 0.07) -> None:
        self.scale = scale

    def _fill(self, tensor: torch.Tensor) -> None:
        tensor.uniform_(-self.scale, self.scale)


class TruncatedNormal(Initializer):
    """N(0, sigma**2) truncated to [-2 sigma, 2 sigma]; default ``sigma=0.01``."""

    draws = True

    def __init__(self, sigma: float = 0.01) -> None:
        self.sigma = sigma

    def _fill(self, tensor: torch.Tensor) -> None:
        bound = 2.0 * self.sigma
        torch.nn.init.trunc_normal_(tensor, mean=0.0, std=self.sigma, a=-bound, b=bound)


class XavierUniform(Initializer):
    """U(-b, b) with ``b = gain * sqrt(6 / (fan_in + fan_out))``; default ``gain=1``."""

    draws = True

    def __init__(self, gain: float = 1.0) -> None:
        self.gain = gain

    def _fill(self, tensor: torch.Tensor) -> None:
        fan_in, fan_out = fan_in_and_fan_out(tensor.shape)
        bound = self.gain * math.sqrt(6.0 / (fan_in + fan_out))
        tensor.uniform_(-bound, bound)


class XavierNormal(Initializer):
    """N(0, s**2) with ``s = gain * sqrt(2 / (fan_in + fan_out))``; default ``gain=1``."""

    draws = True

    def __init__(self, gain: float = 1.0) -> None:
        self.gain = gain

    def _fill(self, tensor: torch.Tensor) -> None:
        fan_in, fan_out = fan_in_and_fan_out(tensor.shape)
        tensor.normal_(0.0, self.gain * math.sqrt(2.0 / (fan_in + fan_out)))


class HeNormal(Initializer):
    """N(0, s**2) with ``s = gain / sqrt(fan)``; defaults as MindSpore (fan_in, leaky_relu, 0)."""

    draws = True

    def __init__(
        self, negative_slope: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu"
    ) -> None:
        self.negative_slope = negative_slope
        self.mode = mode
        self.nonlinearity = nonlinearity

    def std(self, shape: Sequence[int]) -> float:
        """The standard deviation this initializer uses for ``shape``."""
        gain = _gain(self.nonlinearity, self.negative_slope)
        return gain / math.sqrt(_fan(shape, self.mode))

    def _fill(self, tensor: torch.Tensor) -> None:
        tensor.normal_(0.0, self.std(tensor.shape))


class HeUniform(HeNormal):
    """U(-b, b) with ``b = sqrt(3) * gain / sqrt(fan)``; same defaults as `HeNormal`."""

    def _fill(self, tensor: torch.Tensor) -> None:
        bound = math.sqrt(3.0) * self.std(tensor.shape)
        tensor.uniform_(-bound, bound)


class Constant(Initializer):
    """Every element equal to ``value``."""

    def __init__(self, value: float) -> None:
        self.value = value

    def _fill(self, tensor: torch.Tensor) -> None:
        tensor.fill_(self.value)


class Zero(Constant):
    """All zeros (``"zeros"``)."""

    def __init__(self) -> None:
        super().__init__(0)


class One(Constant):
    """All ones (``"ones"``)."""

    def __init__(self) -> None:
        super().__init__(1)


_BY_NAME: dict[str, type[Initializer]] = {
    "normal": Normal,
    "zeros": Zero,
    "ones": One,
    "uniform": Uniform,
    "truncated_normal": TruncatedNormal,
    "xavier_uniform": XavierUniform,
    "xavier_normal": XavierNormal,
    "he_normal": HeNormal,
    "he_uniform": HeUniform,
}
# MindSpore also accepts "truncatedNormal", "XavierUniform", "zero", ...: compare loosely.
_LOOSE = {name.replace("_", ""): cls for name, cls in _BY_NAME.items()}
_LOOSE.update({"zero": Zero, "one": One})

VALID_NAMES: tuple[str, ...] = tuple(_BY_NAME)


def _from_name(name: str) -> Initializer:
    cls = _LOOSE.get(name.lower().replace("_", ""))
    if cls is None:
        raise InitializerError(
            f"unknown initializer {name!r}; valid names are: {', '.join(VALID_NAMES)}"
        )
    return cls()


def _check_shape(shape: ShapeLike | None) -> tuple[int, ...]:
    if shape is None:
        raise InitializerError("initializer needs a shape unless init is a tensor")
    dims = (shape,) if isinstance(shape, int) else shape
    if not isinstance(dims, Sequence) or isinstance(dims, str):
        raise InitializerError(f"shape must be an int or a sequence of ints, got {shape!r}")
    for dim in dims:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
            raise InitializerError(
                f"shape must hold positive ints, got {list(dims)} ({dim!r} is not one)"
            )
    return tuple(dims)


def _as_initializer(init: object) -> Initializer:
    if isinstance(init, Initializer):
        return init
    if isinstance(init, type) and issubclass(init, Initializer):
        return init()
    if isinstance(init, str):
        return _from_name(init)
    if isinstance(init, numbers.Number) and isinstance(init, int | float):
        return Constant(init)
    raise TypeError(
        "init must be an initializer name, an Initializer, a number or a tensor, "
        f"got {type(init).__name__}"
    )


def initializer(
    init: str | Initializer | type[Initializer] | float | torch.Tensor,
    shape: ShapeLike | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Create a tensor of ``shape`` and ``dtype`` filled by ``init`` (MindSpore's ``initializer``).

    Args:
        init: a name (``"normal"``, ``"zeros"``, ``"ones"``, ``"uniform"``,
            ``"truncated_normal"``, ``"xavier_uniform"``, ``"xavier_normal"``,
            ``"he_normal"``, ``"he_uniform"``; case and underscores are ignored), an
            `Initializer` such as ``Normal(sigma=0.02)``, a number (constant fill), or a
            tensor (returned as ``dtype``; its shape must equal ``shape`` when given).
        shape: an int or a sequence of positive ints.
        dtype: the torch dtype of the result.

    Returns:
        A new tensor drawn from torch's global RNG. Inside ``sw.no_init_parameters()`` it
        is a meta tensor whose fill is recorded and replayed at materialization.

    Raises:
        TypeError: `dtype` is not a torch dtype, or a random `init` (all but zeros, ones and
            constants) is given a dtype that is not floating point.
        InitializerError: an unknown name, a bad shape, a tensor of another shape.

    Example:
        >>> torch.manual_seed(0)
        >>> w = initializer("normal", [784, 512])
        >>> w.shape, round(float(w.std()), 2)
        (torch.Size([784, 512]), 0.01)
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    if isinstance(init, torch.Tensor):
        if shape is not None and tuple(init.shape) != _check_shape(shape):
            raise InitializerError(
                f"init tensor has shape {list(init.shape)} but shape is {list(_check_shape(shape))}"
            )
        return init.to(dtype)
    fill = _as_initializer(init)
    tensor = torch.empty(_check_shape(shape), dtype=dtype)
    return fill(tensor)
