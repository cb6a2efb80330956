"""assert_matches_single_device catches differences, names where they are, and accepts parity."""

from __future__ import annotations

import pytest
import torch

from shardwise.testing import assert_matches_single_device, simulated_world


def test_plain_tensors() -> None:
    assert_matches_single_device(torch.ones(3), torch.ones(3) * (1 + 1e-7))
    with pytest.raises(AssertionError, match=r"loss: differs .* 0.5 at flat index 2"):
        assert_matches_single_device(
            torch.tensor([1.0, 2, 3]), torch.tensor([1.0, 2, 3.5]), what="loss"
        )
    with pytest.raises(AssertionError, match=r"shape \[2\] != single-device \[3\]"):
        assert_matches_single_device(torch.ones(2), torch.ones(3))


def test_per_rank_values_and_structures() -> None:
    with simulated_world(2) as world:
        x = world.rank_map(lambda r: torch.full((2,), float(r)))
        assert_matches_single_device({"a": [x]}, {"a": [lambda r: torch.full((2,), float(r))]})
        with pytest.raises(AssertionError, match=r"grads\['a'\]\[0\] on rank 1"):
            assert_matches_single_device({"a": [x]}, {"a": [torch.zeros(2)]}, what="grads")


def test_per_rank_values_kept_after_the_world_ended() -> None:
    """Compared after ``simulated_world`` closed: each rank's value, named (before: an
    ``AttributeError`` from the per-rank integer of a mismatch)."""
    with simulated_world(2) as world:
        x = world.rank_map(lambda r: torch.full((3,), float(r)))
    assert_matches_single_device(x, lambda r: torch.full((3,), float(r)))
    with pytest.raises(AssertionError, match=r"x on rank 1: differs"):
        assert_matches_single_device(x, torch.zeros(3), what="x")


def test_per_rank_expected_values() -> None:
    """An expected value that holds one value per rank (``world.rows(want)``) is compared rank
    by rank, inside the world and after it ended (before: a mismatch raised an
    ``AttributeError`` from a per-rank integer instead of naming the rank)."""
    x = torch.arange(8.0).reshape(4, 2)
    wrong = x.clone()
    wrong[3, 1] = 100.0  # (in rank 1's rows)
    with simulated_world(2) as world:
        rows, want, bad = world.rows(x), world.rows(x), world.rows(wrong)
        assert_matches_single_device(rows, want)
        with pytest.raises(AssertionError, match=r"rows on rank 1: differs .* 7.0 vs 100.0"):
            assert_matches_single_device(rows, bad, what="rows")
    assert_matches_single_device(rows, want)
    with pytest.raises(AssertionError, match=r"rows on rank 1: differs"):
        assert_matches_single_device(rows, bad, what="rows")


def test_the_message_names_the_element_past_the_tolerance() -> None:
    """The element named is the one furthest past the tolerance, not the largest absolute
    difference (there: 1000.0 vs 1000.005, within 1e-5 of itself, while 0.001 vs 0.0011
    failed)."""
    with pytest.raises(AssertionError, match=r"worst difference 0.0001 at flat index 1"):
        assert_matches_single_device(
            torch.tensor([1000.0, 0.001]), torch.tensor([1000.005, 0.0011])
        )


def test_complex_tensors_compare_both_parts() -> None:
    """Complex values whose imaginary parts differ are caught, naming the part (before: both
    sides were cast to float64, dropping the imaginary parts, and the comparison passed)."""
    a = torch.tensor([1 + 1j, 2 + 2j])
    assert_matches_single_device(a, a * (1 + 1e-7))
    with pytest.raises(AssertionError, match=r"z: differs .* 7 in the imaginary part at flat "):
        assert_matches_single_device(a, torch.tensor([1 - 5j, 2 + 9j]), what="z")
    with pytest.raises(AssertionError, match=r"real part at flat index 0: \(1\+1j\) vs \(3\+1j\)"):
        assert_matches_single_device(a, torch.tensor([3 + 1j, 2 + 2j]))
    with pytest.raises(AssertionError, match=r"imaginary part at flat index 1"):
        assert_matches_single_device(a, torch.tensor([1.0, 2.0]).to(torch.complex64))
    with simulated_world(2) as world:
        x = world.rank_map(lambda r: torch.tensor([1 + 1j * r]))
        assert_matches_single_device(x, lambda r: torch.tensor([1 + 1j * r]))
        with pytest.raises(AssertionError, match=r"on rank 1: differs .* imaginary part"):
            assert_matches_single_device(x, torch.tensor([1 + 0j]))
