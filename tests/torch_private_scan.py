"""The scan behind `test_private_torch_apis_only_in_torch_package`: private torch APIs in a
module's syntax tree (docstrings, comments and other strings are not code).

`private_torch_uses` reports, as ``where:line: what``:

- an import from a torch module path with a ``_`` part (``torch._C``,
  ``torch.utils._python_dispatch``, ``torch.distributed.tensor._ops``), or of a ``_`` name from
  any torch module (``_StridedShard``, ``_pytree``); also ``importlib.import_module`` of one;
- an attribute chain starting at a torch name (``torch``, ``dist``, ``nn``, ``T = torch.Tensor``)
  with a ``_`` part (``torch._C._foo``, ``torch.Tensor._make_subclass``); aten op names
  (``torch.ops.aten._foo``) are the dispatcher's registry and pass;
- a ``_`` keyword argument of a call of a torch name (``DeviceMesh(..., _rank=0)``);
- a private attribute torch puts on its objects (`PRIVATE_ATTRIBUTES`: ``._base``, ``._cdata``,
  ``._parameters``, ``.kineto_results`` ...) read on anything, also by name (``getattr``,
  ``operator.attrgetter``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

# Private attributes torch puts on its objects (tensors, modules, storages, autograd Functions,
# profiler results, backend options, DTensor, LocalTensor): reading one anywhere is a finding,
# whatever the object (shardwise's own attributes avoid these names).
PRIVATE_ATTRIBUTES = frozenset(
    {
        "_backward_cls",
        "_backward_hooks",
        "_base",
        "_buffers",
        "_cdata",
        "_execution_engine",
        "_forward_hooks",
        "_forward_pre_hooks",
        "_local_tensors",
        "_make_subclass",
        "_modules",
        "_non_persistent_buffers_set",
        "_op_dispatcher",
        "_parameters",
        "_per_rank_rng_states",
        "_timeout",
        "_version",
        "experimental_event_tree",
        "kineto_results",
    }
)


def _private(name: str) -> bool:
    """A ``_name`` (not a ``__dunder__``)."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_module(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None when it does not start at a name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _torch_names(tree: ast.Module) -> dict[str, str]:
    """Each local name bound to a torch object, with its full path: ``import torch.distributed
    as dist`` -> ``dist: torch.distributed``; ``from torch import nn``; ``T = torch.Tensor``."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _torch_module(a.name):
                    names[a.asname or "torch"] = a.name if a.asname else "torch"
        elif (
            isinstance(node, ast.ImportFrom) and not node.level and _torch_module(node.module or "")
        ):
            names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], _dotted(node.value)
            if isinstance(target, ast.Name) and value and value[0] in names:
                names.setdefault(target.id, ".".join([names[value[0]], *value[1:]]))
    return names


def _import_findings(node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for a in node.names:
            if _torch_module(a.name) and any(map(_private, a.name.split("."))):
                yield f"import of private torch module {a.name}"
        return
    module = node.module or ""
    if node.level or not _torch_module(module):
        return
    if any(map(_private, module.split("."))):
        yield f"import from private torch module {module}"
    else:
        for a in node.names:
            if _private(a.name):
                yield f"import of private torch name {module}.{a.name}"


def _attribute_finding(node: ast.Attribute, names: dict[str, str]) -> str | None:
    """A finding for the outermost attribute of a chain: a private part of a torch path, or a
    private torch attribute anywhere in it."""
    dotted = _dotted(node)
    if dotted and dotted[0] in names:
        path = ".".join([names[dotted[0]], *dotted[1:]])
        # (aten op names, ``torch.ops.aten._foo``, are the dispatcher's registry, not Python API)
        if any(map(_private, dotted[1:])) and not path.startswith("torch.ops."):
            return f"private torch API {path}"
    at: ast.expr = node
    while isinstance(at, ast.Attribute):
        if at.attr in PRIVATE_ATTRIBUTES:
            return f"private torch attribute .{at.attr}"
        at = at.value
    return None


def _call_findings(node: ast.Call, names: dict[str, str]) -> Iterator[str]:
    callee = _dotted(node.func) or []
    torch_callee = bool(callee) and callee[0] in names
    for kw in node.keywords:
        if torch_callee and kw.arg and _private(kw.arg):
            yield f"private keyword argument {kw.arg}= of {'.'.join(callee)}"
    strings = [a.value for a in node.args if isinstance(a, ast.Constant)]
    text = [s for s in strings if isinstance(s, str)]
    if callee[-1:] in (["import_module"], ["__import__"]):
        for s in text:
            if _torch_module(s) and any(map(_private, s.split("."))):
                yield f"import of private torch module {s}"
    if callee[-1:] in (["getattr"], ["setattr"], ["hasattr"], ["attrgetter"]):
        for s in text:
            if s in PRIVATE_ATTRIBUTES or (torch_callee and _private(s)):
                yield f"private torch attribute {s!r} by name"


def private_torch_uses(source: str, where: str) -> list[str]:
    """Every use of a private torch API in `source`, as ``where:line: what``."""
    tree = ast.parse(source)
    names = _torch_names(tree)
    inner = {
        id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)
    }  # (attributes that a longer chain continues: reported once, at the outermost)
    found: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.update((node.lineno, f) for f in _import_findings(node))
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            finding = _attribute_finding(node, names)
            if finding:
                found.add((node.lineno, finding))
        elif isinstance(node, ast.Call):
            found.update((node.lineno, f) for f in _call_findings(node, names))
    return [f"{where}:{line}: {what}" for line, what in sorted(found)]
