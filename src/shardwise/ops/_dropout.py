"""The `Dropout` primitive (MindSpore ``ops.Dropout``) -> ``(output, mask)``, the CPU/GPU form:
a mask of x's shape and dtype, 1 = kept.

With a non-zero ``(Seed0, Seed1)`` the op draws from a ``torch.Generator`` of its own per device,
seeded with `pair_seed` (the pair's 64 bits mixed, so that both seeds reach the low 32 bits
torch's CPU generator keeps of a seed); with zero seeds, from torch's global generators. Its own
generators follow the op through activation checkpointing (a region's recomputation draws the
forward's mask again: `shardwise._torch.checkpointing.recompute_draws_alike`) and through
training checkpoints (`Dropout.rng_state` / `Dropout.set_rng_state`, which
`shardwise.train.resume` puts back).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from shardwise._torch.checkpointing import recompute_draws_alike
from shardwise.ops._base import Primitive

SEED_LIMIT = 2**32
"""Seed0 and Seed1 are each in [0, SEED_LIMIT): the pair maps to one 64-bit generator seed."""

_MASK64 = 2**64 - 1


def pair_seed(seed0: int, seed1: int) -> int:
    """The generator seed of a ``(Seed0, Seed1)`` pair: ``Seed0 * 2**32 + Seed1`` through
    SplitMix64's finalizer, a bijection of 64-bit ints, so that every bit of either seed
    reaches the low 32 bits torch's CPU generator keeps (distinct pairs: distinct 64-bit seeds,
    on CPU distinct 32-bit ones but for a 2**-32 chance)."""
    z = (seed0 * SEED_LIMIT + seed1 + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _check_args(keep_prob: object, seeds: dict[str, object]) -> None:
    """Raise for a `Dropout` argument outside MindSpore's types and this op's ranges."""
    if isinstance(keep_prob, bool) or not isinstance(keep_prob, float | int):
        raise TypeError(
            f"Dropout: keep_prob must be a float in (0, 1], got {keep_prob!r} "
            f"({type(keep_prob).__name__})"
        )
    if not 0 < keep_prob <= 1:
        raise ValueError(f"Dropout: keep_prob must be in (0, 1], got {keep_prob!r}")
    for name, seed in seeds.items():
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(
                f"Dropout: {name} must be an int in [0, 2**32 - 1], got {seed!r} "
                f"({type(seed).__name__})"
            )
        if not 0 <= seed < SEED_LIMIT:
            raise ValueError(
                f"Dropout: {name} must be in [0, 2**32 - 1] (Seed0 and Seed1 make one 64-bit "
                f"seed), got {seed}"
            )


class Dropout(Primitive):
    """Zero each element with probability ``1 - keep_prob`` and scale the rest by
    ``1 / keep_prob`` (MindSpore ``ops.Dropout``); returns ``(output, mask)``.

    Args:
        keep_prob: probability of keeping an element, in (0, 1].
        Seed0: op seed, an int in [0, 2**32 - 1]; with `Seed1`, a non-zero pair gives the op
            its own reproducible stream (distinct pairs: distinct streams, on CPU but for a
            2**-32 chance).
        Seed1: global seed part, an int in [0, 2**32 - 1].

    Raises:
        TypeError: keep_prob not a number, or a seed not an int.
        ValueError: keep_prob or a seed outside its range.

    As a PyTorch module, it is the identity (mask of ones) in ``eval()`` mode. Any strategy
    with one value per dim; the mask has the output's layout.
    """

    def __init__(self, keep_prob: float = 0.5, Seed0: int = 0, Seed1: int = 0) -> None:
        _check_args(keep_prob, {"Seed0": Seed0, "Seed1": Seed1})
        super().__init__(keep_prob=float(keep_prob), Seed0=Seed0, Seed1=Seed1)
        self._generators: dict[torch.device, torch.Generator] = {}
        self._next_noise: torch.Tensor | None = None

    def set_next_noise(self, noise: torch.Tensor) -> None:
        """Use `noise` (uniform in [0, 1), x's shape) instead of a fresh draw in the next
        forward. The parallel runtime passes this rank's block of one global draw, so that the
        mask is the same slice of the single-device mask."""
        self._next_noise = noise

    @property
    def seeded(self) -> bool:
        """Whether the op draws from generators of its own (a non-zero Seed0 / Seed1)."""
        return bool(self.init_args()["Seed0"] or self.init_args()["Seed1"])

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The op's own generator (non-zero Seed0 / Seed1), or None for the global one; call it
        right before drawing from it (an activation checkpoint's recomputation then draws the
        same values again)."""
        gen = self._generator(device)
        if gen is not None:
            recompute_draws_alike(gen)
        return gen

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if not self.seeded or device.type == "meta":  # meta: planning draws nothing
            return None
        if device not in self._generators:
            args = self.init_args()
            gen = torch.Generator(device=device)
            gen.manual_seed(pair_seed(int(args["Seed0"]), int(args["Seed1"])))
            self._generators[device] = gen
        return self._generators[device]

    def rng_state(self) -> dict[str, torch.Tensor]:
        """The states of the op's own generators by device (``{"cpu": ...}``): empty with zero
        seeds or before its first draw. `set_rng_state` puts them back."""
        return {str(d): g.get_state() for d, g in self._generators.items()}

    def set_rng_state(self, states: Mapping[str, torch.Tensor]) -> None:
        """Continue the op's draws from `states` (`rng_state`'s); a device not in it starts
        over from the seeds, one this process lacks (a CUDA device) is skipped. Nothing with
        zero seeds."""
        self._generators.clear()
        if not self.seeded:
            return
        for name, state in states.items():
            device = torch.device(name)
            if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
                continue
            gen = self._generator(device)
            if gen is not None:
                gen.set_state(state.clone())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keep = float(self.init_args()["keep_prob"])
        noise, self._next_noise = self._next_noise, None
        if not self.training or keep == 1.0:
            return x, torch.ones_like(x)
        if noise is None:
            noise = torch.rand(
                x.shape, dtype=x.dtype, device=x.device, generator=self.generator(x.device)
            )
        elif noise.shape != x.shape:
            raise ValueError(
                f"{self.who}: noise of shape {list(noise.shape)} for x {list(x.shape)}"
            )
        mask = (noise < keep).to(x.dtype)
        return x * mask / keep, mask
