"""Tests run the code real jobs run: outside `communication/` and `testing/`, no module of
shardwise asks whether it runs in a simulated world.

`shardwise.testing.simulated_world` runs every rank in one process; only `communication/`
(and `testing/`, which builds that world) may tell it apart from a job, and it offers
`process_ranks`, `rank_value`, `own_group`, `rank_parts`, `file_rank` and `shared_value` so that
the rest of
shardwise never needs to. The scan reads each module's syntax tree (docstrings, comments and
other strings are not code) and reports, as ``file:line: what``:

- an import of the simulator hook (``shardwise.communication._sim``) or of
  ``shardwise.testing``;
- a type test of a rank: ``isinstance(<...rank...>, int)`` or ``type(<...rank...>) is int``
  (the simulated rank is a per-rank symbolic int, so such a test is a simulated-world check);
- an identifier (name, attribute, function, class, argument, import alias) containing
  ``simulated`` or ``_sim``, or naming the simulation's own types (``LocalTensor``,
  ``_local_tensors``, ``LocalIntNode``, ``SymInt``);
- a count of the ranks a process runs compared with something: ``len(comm.process_ranks())``,
  or ``len(x)`` where the module assigns ``x = ...process_ranks()``, in a comparison (several
  ranks per process means a simulated world: ask ``communication.holds_several_ranks``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import shardwise

PACKAGE = Path(shardwise.__file__).parent
EXEMPT_PACKAGES = ("communication", "testing")  # the two that may know
ALLOWED: set[str] = set()
_SIM_MODULES = ("shardwise.communication._sim", "shardwise.testing")
_SIM_TYPES = ("LocalTensor", "_local_tensors", "LocalIntNode", "SymInt")


def _is_sim_module(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in _SIM_MODULES)


def _sim_identifier(name: str) -> bool:
    lowered = name.lower()
    return (
        "simulated" in lowered
        or lowered == "_sim"
        or lowered.startswith("_sim_")
        or any(t.lower() in lowered for t in _SIM_TYPES)
    )


def _mentions_rank(node: ast.AST) -> bool:
    """Whether an expression names a rank: ``rank``, ``self._rank``, ``comm.get_rank()`` ..."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and "rank" in sub.id.lower():
            return True
        if isinstance(sub, ast.Attribute) and "rank" in sub.attr.lower():
            return True
    return False


def _names_int(node: ast.AST) -> bool:
    """Whether a type argument is ``int`` or a tuple holding ``int``."""
    if isinstance(node, ast.Name):
        return node.id == "int"
    if isinstance(node, ast.Tuple):
        return any(_names_int(e) for e in node.elts)
    if isinstance(node, ast.BinOp):  # int | bool
        return _names_int(node.left) or _names_int(node.right)
    return False


def _is_type_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "type"
        and len(node.args) == 1
    )


def _identifiers(node: ast.AST) -> list[str]:
    """The identifiers a node introduces or uses (not strings)."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, ast.alias):
        return [node.name.rpartition(".")[2], *([node.asname] if node.asname else [])]
    return []


def _calls_process_ranks(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name == "process_ranks"


def _target_key(node: ast.AST) -> str | None:
    """``x`` or ``self.x`` as a key (None for other targets)."""
    if isinstance(node, ast.Name | ast.Attribute):
        return ast.unparse(node)
    return None


def _process_rank_holders(tree: ast.AST) -> set[str]:
    """The names (``x``, ``self._ranks``) the module assigns ``...process_ranks()`` to."""
    held = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _calls_process_ranks(node.value):
            held |= {k for t in node.targets if (k := _target_key(t)) is not None}
        elif isinstance(node, ast.AnnAssign | ast.NamedExpr) and _calls_process_ranks(node.value):
            key = _target_key(node.target)
            if key is not None:
                held.add(key)
    return held


def _counts_process_ranks(node: ast.AST, held: set[str]) -> bool:
    """Whether `node` is ``len(<...process_ranks()>)`` or ``len(<a name holding them>)``."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "len"
        and len(node.args) == 1
    ):
        return False
    arg = node.args[0]
    return _calls_process_ranks(arg) or _target_key(arg) in held


def violations(source: str, where: str) -> list[str]:
    """Every place in `source` (a module's text) that asks whether the world is simulated, as
    ``where:line: what``."""
    found: list[str] = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{where}:{getattr(node, 'lineno', '?')}: {what}")

    tree = ast.parse(source)
    held = _process_rank_holders(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(
            _counts_process_ranks(s, held) for s in [node.left, *node.comparators]
        ):
            report(node, f"counts the ranks of this process: {ast.unparse(node)}")
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_sim_module(alias.name):
                    report(node, f"imports {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if _is_sim_module(node.module) or _is_sim_module(full):
                    report(node, f"imports {full}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and len(node.args) == 2
            and _mentions_rank(node.args[0])
            and _names_int(node.args[1])
        ):
            report(node, f"type test of a rank: {ast.unparse(node)}")
        if isinstance(node, ast.Compare) and any(
            isinstance(op, ast.Is | ast.IsNot | ast.Eq | ast.NotEq) for op in node.ops
        ):
            sides = [node.left, *node.comparators]
            typed = [s.args[0] for s in sides if _is_type_call(s)]  # type: ignore[attr-defined]
            if any(_mentions_rank(t) for t in typed) and any(_names_int(s) for s in sides):
                report(node, f"type test of a rank: {ast.unparse(node)}")
        for name in _identifiers(node):
            if _sim_identifier(name):
                report(node, f"identifier {name!r}")
    return sorted(set(found), key=lambda v: (int(v.split(":")[1]), v))


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.split("/")[0] in EXEMPT_PACKAGES:
            continue
        out.append((rel, path))
    return out


def test_no_module_outside_communication_asks_whether_the_world_is_simulated() -> None:
    found = [
        v
        for rel, path in _modules()
        if rel not in ALLOWED
        for v in violations(path.read_text(encoding="utf-8"), f"src/shardwise/{rel}")
    ]
    assert not found, (
        "these modules ask whether they run in a simulated world; use shardwise.communication's "
        "process_ranks / holds_several_ranks / rank_value / own_group / rank_parts / file_rank / "
        "shared_value "
        "instead:\n  " + "\n  ".join(found)
    )


def test_allowed_modules_still_need_their_exemption() -> None:
    stale = [
        rel
        for rel, path in _modules()
        if rel in ALLOWED and not violations(path.read_text(encoding="utf-8"), rel)
    ]
    missing = [rel for rel in ALLOWED if not (PACKAGE / rel).exists()]
    assert not stale and not missing, (
        f"remove from ALLOWED: {stale + missing} (no simulated-world check left there)"
    )


@pytest.mark.parametrize(
    ("code", "what"),
    [
        ("from shardwise.communication import _sim\n", "imports shardwise.communication._sim"),
        ("import shardwise.communication._sim as s\n", "imports shardwise.communication._sim"),
        ("from shardwise.communication._sim import current\n", "imports"),
        ("from shardwise.testing import current_world\n", "imports shardwise.testing"),
        ("x = isinstance(comm.get_rank(), int)\n", "type test of a rank"),
        ("if not isinstance(rank, int):\n    pass\n", "type test of a rank"),
        ("ok = isinstance(self._rank, (int, bool))\n", "type test of a rank"),
        ("if type(rank) is not int:\n    pass\n", "type test of a rank"),
        ("self.simulated = True\n", "identifier 'simulated'"),
        ("def _simulated():\n    return 1\n", "identifier '_simulated'"),
        ("if _materialize_simulated(x):\n    pass\n", "identifier '_materialize_simulated'"),
        ("x = t._local_tensors[0]\n", "identifier '_local_tensors'"),
        ("if len(comm.process_ranks()) == 1:\n    pass\n", "counts the ranks of this process"),
        ("ranks = comm.process_ranks()\nif len(ranks) != 1:\n    pass\n", "counts the ranks"),
        ("self._r = process_ranks()\nok = 1 < len(self._r)\n", "counts the ranks"),
    ],
)
def test_the_scan_finds(code: str, what: str) -> None:
    found = violations(code, "m.py")
    assert found and all(v.startswith("m.py:") for v in found), found
    assert any(what in v for v in found), found


def test_the_scan_ignores_strings_and_other_int_tests() -> None:
    code = '''"""In a simulated world every rank ... isinstance(rank, int)."""
# a simulated world: _sim.current()
msg = "inside simulated_world, pass shard_id"
ok = isinstance(world_size, int) and type(shard) is int
from shardwise import communication as comm
ranks = comm.process_ranks()
first = ranks[0] if 0 in ranks else len(ranks)
many = len(other_ranks) > 1 and len(comm.get_ranks()) == 2
'''
    assert violations(code, "m.py") == []
