"""Errors of the parameter package; all are user errors (``ValueError`` subclasses)."""

from __future__ import annotations


class InitializerError(ValueError):
    """An unknown initializer name, a bad shape, or a tensor of the wrong shape."""


class DeferredInitError(ValueError):
    """Deferred initialization was used in a way that cannot be recorded or replayed."""
