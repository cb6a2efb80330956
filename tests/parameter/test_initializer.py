"""sw.initializer: each distribution, MindSpore's defaults and fans, determinism, errors."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.parameter import (
    VALID_NAMES,
    HeNormal,
    InitializerError,
    Normal,
    TruncatedNormal,
    Uniform,
    XavierUniform,
    fan_in_and_fan_out,
    initializer,
)

SHAPE = [512, 512]


def _sample(init: object, shape: list[int] = SHAPE) -> torch.Tensor:
    torch.manual_seed(0)
    return initializer(init, shape)  # type: ignore[arg-type]


def test_normal_default_sigma_is_0_01() -> None:
    w = _sample("normal")
    assert w.dtype == torch.float32 and list(w.shape) == SHAPE
    assert abs(float(w.mean())) < 1e-3
    assert float(w.std()) == pytest.approx(0.01, rel=0.02)


def test_uniform_default_scale_is_0_07() -> None:
    w = _sample("uniform")
    assert float(w.min()) >= -0.07 and float(w.max()) <= 0.07
    assert float(w.std()) == pytest.approx(0.07 / math.sqrt(3), rel=0.02)


def test_truncated_normal_stays_within_two_sigma() -> None:
    w = _sample("truncated_normal")
    assert float(w.abs().max()) <= 0.02
    # std of N(0, s) truncated at +-2s is 0.8796 s
    assert float(w.std()) == pytest.approx(0.008796, rel=0.03)


def test_xavier_uniform_bound_uses_mindspore_fans() -> None:
    shape = [256, 128, 3, 3]
    fan_in, fan_out = 128 * 9, 256 * 9
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    w = _sample("xavier_uniform", shape)
    assert float(w.abs().max()) <= bound
    assert float(w.abs().max()) > 0.99 * bound
    assert float(w.std()) == pytest.approx(bound / math.sqrt(3), rel=0.02)


def test_he_normal_std_is_sqrt2_over_sqrt_fan_in() -> None:
    w = _sample("he_normal", [512, 1024])
    assert float(w.std()) == pytest.approx(math.sqrt(2.0) / math.sqrt(1024), rel=0.02)
    assert abs(float(w.mean())) < 1e-3


def test_constants_and_numbers() -> None:
    assert torch.equal(initializer("zeros", [2, 3]), torch.zeros(2, 3))
    assert torch.equal(initializer("ones", 4), torch.ones(4))
    assert torch.equal(initializer(2.5, (2,)), torch.full((2,), 2.5))
    assert initializer("ones", [2], torch.float16).dtype == torch.float16


def test_class_forms_take_parameters() -> None:
    assert float(_sample(Normal(sigma=0.05)).std()) == pytest.approx(0.05, rel=0.02)
    assert float(_sample(Uniform(scale=0.5)).abs().max()) <= 0.5
    assert float(_sample(TruncatedNormal(sigma=0.1)).abs().max()) <= 0.2
    assert float(_sample(XavierUniform(gain=2.0)).abs().max()) <= 2 * math.sqrt(6 / 1024)
    he = _sample(HeNormal(mode="fan_out", nonlinearity="relu"), [256, 1024])
    assert float(he.std()) == pytest.approx(math.sqrt(2 / 256), rel=0.03)


def test_names_are_case_and_underscore_insensitive() -> None:
    assert torch.equal(_sample("truncatedNormal"), _sample("truncated_normal"))
    assert torch.equal(_sample("XavierUniform", [8, 4]), _sample("xavier_uniform", [8, 4]))


def test_same_seed_same_values_and_global_rng_is_used() -> None:
    assert torch.equal(_sample("normal"), _sample("normal"))
    torch.manual_seed(0)
    expected = torch.empty(4, 4).normal_(0.0, 0.01)
    assert torch.equal(_sample("normal", [4, 4]), expected)


def test_tensor_init_is_returned_in_dtype_and_shape_checked() -> None:
    data = torch.arange(6.0).reshape(2, 3)
    assert initializer(data, [2, 3]) is data
    assert initializer(data, [2, 3], torch.float64).dtype == torch.float64
    with pytest.raises(InitializerError, match=r"shape \[2, 3\] but shape is \[3, 2\]"):
        initializer(data, [3, 2])


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(InitializerError) as info:
        initializer("gaussian", [2, 2])
    assert "gaussian" in str(info.value)
    for name in VALID_NAMES:
        assert name in str(info.value)


@pytest.mark.parametrize("shape", [[2, 0], [-1, 3], [2.0, 3], "ab", None])
def test_bad_shapes(shape: object) -> None:
    with pytest.raises(InitializerError):
        initializer("normal", shape)  # type: ignore[arg-type]


def test_bad_types() -> None:
    with pytest.raises(TypeError, match="init must be"):
        initializer(object(), [2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype"):
        initializer("ones", [2], "float32")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["normal", "uniform", "truncated_normal", "he_uniform"])
def test_a_random_init_of_an_integer_dtype_names_both(name: str) -> None:
    """``initializer("normal", [2, 2], torch.int32)`` raised torch's NotImplementedError
    ("normal_kernel_cpu" not implemented for 'Int')."""
    with pytest.raises(
        TypeError,
        match=r"draws random floating-point values and cannot fill a "
        r"tensor of dtype torch.int32; give a floating-point dtype",
    ):
        initializer(name, [2, 2], torch.int32)
    assert torch.equal(initializer("zeros", [2], torch.int32), torch.zeros(2, dtype=torch.int32))
    assert torch.equal(initializer(3, [2], torch.int64), torch.full((2,), 3))


def test_fans_need_two_dims() -> None:
    assert fan_in_and_fan_out([10, 20]) == (20, 10)
    with pytest.raises(InitializerError, match="at least 2 dimensions"):
        initializer("xavier_uniform", [10])
