"""Errors of the parallel runtime, and `Replan`, the executor's signal to plan a call again."""

from __future__ import annotations


class UnsupportedParallelError(ValueError):
    """The network uses something the semi_auto runtime cannot run in parallel (yet): the
    message names the primitive or tensor and what is supported."""


class Replan(BaseException):
    """The network ran other ops than the plan's before any backward of this call (a branch
    on a Python flag): `GraphRun` plans it again and runs the call anew. A BaseException, so
    that user code's ``except Exception`` lets it pass.

    Attributes:
        cursor: how many of the plan's ops ran.
        op: the op the network called instead of the plan's next one (None: it stopped there).
    """

    def __init__(self, message: str, cursor: int, op: str | None) -> None:
        super().__init__(message)
        self.cursor, self.op = cursor, op
