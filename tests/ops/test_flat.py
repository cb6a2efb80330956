"""`ops._flat`, the planners' flattening of aten call arguments, against torch's pytree on the
arguments the capture records for real models (GPT-2, Llama, ResNet): the same leaves in the
same order, the same structure after a replacement; its memo key tells apart what pytree's
structure tells apart."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

from shardwise.ops import _flat as flat
from shardwise.planner import AtenArg, capture

from ..zoo import GPT2, Llama, ResNet


def _aten_args(net: torch.nn.Module, *inputs: torch.Tensor) -> list[Any]:
    graph = capture(net, *inputs)
    return [(call.args, dict(call.kwargs)) for n in graph.nodes for call in n.aten]


def _cases() -> list[Any]:
    ids = torch.zeros(2, 8, dtype=torch.long)
    images = torch.zeros(2, 3, 16, 16)
    labels = torch.zeros(2, dtype=torch.long)
    return [
        *_aten_args(GPT2(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=8), ids, ids),
        *_aten_args(Llama(n_layer=1), ids, ids),
        *_aten_args(ResNet(widths=(4, 8), blocks=1), images, labels),
    ]


@pytest.fixture(scope="module")
def cases() -> list[Any]:
    return _cases()


def test_leaves_and_map_only_match_pytree(cases: list[Any]) -> None:
    assert len(cases) > 100
    tagged = 0
    for tree in cases:
        assert flat.leaves(tree) == pytree.tree_leaves(tree)
        ours = flat.map_only(AtenArg, lambda a: ("arg", a.kind, a.index), tree)
        theirs = pytree.tree_map_only(AtenArg, lambda a: ("arg", a.kind, a.index), tree)
        assert ours == theirs and pytree.tree_structure(ours) == pytree.tree_structure(theirs)
        tagged += sum(isinstance(x, AtenArg) for x in flat.leaves(tree))
    assert tagged > 100  # (the recorded calls hold tensor arguments to replace)
    size = (torch.Size([2, 3]), {"k": [torch.Size([4])]})
    assert flat.leaves(size) == pytree.tree_leaves(size) == [2, 3, 4]
    assert repr(flat.map_only(int, str, size)) == repr(pytree.tree_map_only(int, str, size))
    assert flat.plain(size) and not flat.plain((torch.return_types.max((1, 2)),))


def test_key_tells_apart_what_pytree_tells_apart(cases: list[Any]) -> None:
    keys: dict[object, Any] = {}
    for tree in cases:
        k = flat.key(AtenArg, lambda a: (a.kind, a.index, a.info.shape, a.stride), tree)
        assert k is not None and hash(k) == hash(k)
        spec = pytree.tree_structure(tree)
        plain = pytree.tree_map_only(AtenArg, lambda a: (a.kind, a.index, a.info.shape), tree)
        if k in keys:  # an equal key: the same structure and the same leaves
            assert keys[k] == (str(spec), pytree.tree_leaves(plain))
        keys[k] = (str(spec), pytree.tree_leaves(plain))
    assert flat.key(int, str, ([1], (2,))) != flat.key(int, str, ((1,), [2]))
    assert flat.key(int, str, {"a": 1}) != flat.key(int, str, {"b": 1})
    assert flat.key(int, str, ("tuple", 1)) != flat.key(int, str, ((1,),))
    assert flat.key(int, str, ([1], {"k": [2]})) is not None
    assert flat.key(int, str, ([1], {"k": {2}})) is None  # (a set is no hashable leaf)
    named = torch.return_types.max((1, 2))  # (a namedtuple: pytree's node, no plain container)
    assert flat.key(int, str, (named,)) is None
    assert flat.key(int, str, (torch.Size([1, 2]),)) == flat.key(int, str, ((1, 2),))
