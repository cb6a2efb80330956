"""Errors of the checkpoint package."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint file that is truncated, corrupt, not safetensors, or does not fit."""
