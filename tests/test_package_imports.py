"""`import shardwise` loads its parts on first use: every public name resolves, and the
launcher and a worker that only communicates start without the planner, DTensor or
`torch.distributed.checkpoint` (a second or more of start-up per process)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import shardwise as sw

HEAVY = ("shardwise.planner", "torch.distributed.tensor", "torch.distributed.checkpoint")


def loaded_after(code: str) -> set[str]:
    """The HEAVY modules a fresh interpreter holds after running `code`."""
    probe = f"{code}\nimport sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(eval(out.stdout.strip().splitlines()[-1]))


def test_every_public_name_resolves_to_its_home() -> None:
    homes = {"Model": "shardwise.train", "AutoParallel": "shardwise.parallel"}
    for name in sw.__all__:
        value = getattr(sw, name)
        assert value is not None, name
        if name in homes:
            assert value is getattr(importlib.import_module(homes[name]), name)
    from shardwise import Layout, save_checkpoint

    assert Layout is sw.layout.Layout and save_checkpoint is sw.checkpoint.save_checkpoint
    assert set(sw.__all__) <= set(dir(sw))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'AutoParalel'"):
        _ = sw.AutoParalel  # type: ignore[attr-defined]
    assert not hasattr(sw, "AutoParalel")


def test_the_launcher_and_communication_start_light() -> None:
    assert loaded_after("import shardwise, shardwise.launch.cli, shardwise.launch.job") == set()
    assert loaded_after("import shardwise as sw\nsw.communication.init") == set()
    # planning loads what it needs when it is used
    assert "shardwise.planner" in loaded_after("import shardwise as sw\nsw.AutoParallel")
