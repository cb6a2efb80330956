"""`import shardwise` loads its parts on first use: every public name resolves, in a fresh
interpreter, to the object its home module defines (the homes read from the imports type
checkers see), other subpackages resolve too (``sw.planner``), and the launcher and a worker
that only communicates start without the planner, DTensor or `torch.distributed.checkpoint`
(a second or more of start-up per process)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import shardwise as sw

HEAVY = ("shardwise.planner", "torch.distributed.tensor", "torch.distributed.checkpoint")


def run(code: str) -> object:
    """What a fresh interpreter running `code` prints on its last line, as JSON."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def loaded_after(code: str) -> set[str]:
    """The HEAVY modules a fresh interpreter holds after running `code`."""
    found = run(f"{code}\nimport sys, json\nprint(json.dumps([m for m in {HEAVY!r} "
                f"if m in sys.modules]))")  # fmt: skip
    assert isinstance(found, list)
    return set(found)


def checked_homes() -> dict[str, str]:
    """Each name the ``if TYPE_CHECKING:`` block of shardwise/__init__.py imports -> the
    module it imports it from (``shardwise`` itself for the subpackages)."""
    tree = ast.parse(Path(sw.__file__).read_text())
    block = next(
        n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.dump(n.test)
    )
    return {a.name: str(n.module) for n in block.body if isinstance(n, ast.ImportFrom)
            for a in n.names}  # fmt: skip


def test_every_public_name_resolves_to_its_home_in_a_fresh_interpreter() -> None:
    homes = checked_homes()
    assert set(homes) == set(sw.__all__) - {"__version__"}
    probe = (
        "import importlib, json, shardwise as sw\n"
        f"homes = {homes!r}\n"
        "bad = [n for n, m in homes.items() if getattr(sw, n) is not (importlib.import_module("
        "m + '.' + n) if m == 'shardwise' else getattr(importlib.import_module(m), n))]\n"
        "print(json.dumps([bad, sorted(set(sw.__all__) - set(dir(sw)))]))"
    )
    assert run(probe) == [[], []]
    from shardwise import Layout, save_checkpoint

    assert Layout is sw.layout.Layout and save_checkpoint is sw.checkpoint.save_checkpoint


def test_other_subpackages_resolve_and_unknown_names_fail() -> None:
    probe = (
        "import json, shardwise as sw\n"
        "print(json.dumps([sw.planner.PlanError.__name__, sw.context.get_context.__name__, "
        "sw.optim.__name__]))"
    )
    assert run(probe) == ["PlanError", "get_context", "shardwise.optim"]
    with pytest.raises(AttributeError, match="no attribute 'AutoParalel'"):
        _ = sw.AutoParalel  # type: ignore[attr-defined]
    assert not hasattr(sw, "AutoParalel")


def test_the_launcher_communication_and_capture_start_light() -> None:
    # (one fresh interpreter, the HEAVY modules held after each step in turn)
    steps = [
        "import shardwise, shardwise.launch.cli, shardwise.launch.job",
        "import shardwise as sw\nsw.communication.init",
        # capture reads shardwise.parallel._discover; the package loads its names on first use
        "import torch\nfrom shardwise.planner import capture\n"
        "capture(torch.nn.Linear(4, 2), torch.ones(3, 4))\nimport shardwise.parallel as p\n"
        "assert 'shardwise.parallel._auto' not in sys.modules, 'capture loaded the wrapper'",
        # planning loads what it needs when it is used
        "assert p.AutoParallel.__module__ == 'shardwise.parallel._auto'\n"
        "from shardwise.parallel import shard, UnsupportedParallelError\nsw.AutoParallel",
    ]
    marks = "\n".join(
        f"{step}\nheld.append([m for m in {HEAVY!r} if m in sys.modules])" for step in steps
    )
    held = run(f"import sys, json\nheld = []\n{marks}\nprint(json.dumps(held))")
    assert held[:3] == [[], [], ["shardwise.planner", "torch.distributed.tensor"]]  # (no DCP)
    assert "shardwise.planner" in held[3]
