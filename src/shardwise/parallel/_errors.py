"""Errors of the parallel runtime."""

from __future__ import annotations


class UnsupportedParallelError(ValueError):
    """The network uses something the semi_auto runtime cannot run in parallel (yet): the
    message names the primitive or tensor and what is supported."""
