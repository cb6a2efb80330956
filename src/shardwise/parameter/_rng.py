"""Per-device RNG state helpers for deferred initialization (CPU and CUDA generators).

- `normalize_device`: ``"cuda"`` -> ``cuda:<current>`` so states are keyed per generator.
- `get_state` / `set_state`: read and write one device's default generator state.
- `has_generator`: whether shardwise tracks that device's generator (cpu, cuda).
"""

from __future__ import annotations

import torch

DeviceLike = torch.device | str | int


def normalize_device(device: DeviceLike) -> torch.device:
    """A ``torch.device`` with an explicit index for CUDA (the current device when omitted)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def has_generator(device: torch.device) -> bool:
    """Whether `get_state` / `set_state` support this device."""
    return device.type in ("cpu", "cuda")


def get_state(device: torch.device) -> torch.Tensor:
    """The current state of ``device``'s default generator."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def set_state(device: torch.device, state: torch.Tensor) -> None:
    """Restore ``device``'s default generator to ``state``."""
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
