"""The rules by which `_torchops.DataParallelOps` runs each kind of unannotated torch op.

A rule takes the mode `m`, the torch function and its arguments and returns the op's result on
this rank. Each one (1) checks that the op leaves dim 0 (the data-parallel dim, split over all
ranks) first and whole, raising `UnsupportedParallelError` naming the op and what would work
otherwise, (2) brings the activations to this rank's rows (`m.to_dp`) and the weights, biases
and broadcast operands to whole tensors (`m.to_whole`), (3) runs the op locally and (4) tracks
the result as ``"dp"`` (`m.put_dp`, through `_run_rows` for most rules) or, for losses and
reductions over dim 0, as one replicated value (`m.reduce_rows`). `RULES` maps each kind of
`_torchops.OP_KINDS` to its rule:

- `_elementwise` (also ``attention``: `_attention` first refuses ``dropout_p > 0``),
  `_rowwise`, `_loss`, `_reduce`: see `_torchops`;
- `_index` (``x[:, i]``, ``x[..., :k]``), `_join` (``cat`` / ``stack`` off dim 0), `_dims`
  (``transpose`` / ``permute`` / ``unsqueeze`` / ``squeeze`` / ``split`` / ``chunk`` off dim
  0), `_cast` (dtype conversions), `_rowstat` (``var`` / ``std`` off dim 0): row-wise views;
- `_embedding` (indices ``"dp"``, table whole), `_norm` (``layer_norm`` / ``rms_norm`` over
  trailing dims), `_matmul` (``x @ weight`` or batched activations);
- `_dropout`: this rank's rows of one global mask (`communication.replicated_draw`), the mask
  a single-device run draws with the same seed.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from shardwise import communication as comm
from shardwise.parallel._errors import UnsupportedParallelError

if TYPE_CHECKING:
    from shardwise.parallel._torchops import DataParallelOps

T = torch.Tensor
Args = tuple[Any, ...]
Rule = Callable[["DataParallelOps", Any, Args, dict[str, Any]], Any]


def op_name(func: Callable[..., Any]) -> str:
    module = getattr(func, "__module__", None) or "torch.Tensor"
    return f"{module}.{getattr(func, '__name__', repr(func))}"


def _name(func: Any) -> str:
    return str(getattr(func, "__name__", ""))


@functools.cache
def _signature(func: Callable[..., Any]) -> inspect.Signature:
    """`func`'s signature, computed once (``inspect.signature`` costs ~15 us a call)."""
    return inspect.signature(func)


def _arg(args: Args, kw: dict[str, Any], i: int, name: str, default: Any = None) -> Any:
    """Argument `i` / `name` of a call (positional or keyword)."""
    return args[i] if len(args) > i else kw.get(name, default)


def _split_dim0(m: DataParallelOps, func: Any, what: str, works: str) -> UnsupportedParallelError:
    return UnsupportedParallelError(
        f"{op_name(func)}: {what} dim 0 of a data-parallel activation, which is split over "
        f"{m.world} ranks; {works}"
    )


def _run_rows(m: DataParallelOps, func: Any, args: Args, kw: dict[str, Any]) -> Any:
    """`func` on this rank's rows of ``args[0]``, every other tensor whole; each result tensor
    must keep the local dim 0 and is tracked ``"dp"``."""
    who = op_name(func)
    local = m.to_dp(args[0], who)

    def whole(a: Any) -> Any:
        return m.to_whole(a, who) if isinstance(a, T) else a

    out = func(local, *(whole(a) for a in args[1:]), **{k: whole(v) for k, v in kw.items()})
    return _put_rows(m, func, out, int(local.shape[0]))


def _put_rows(m: DataParallelOps, func: Any, out: Any, rows: int) -> Any:
    """Track `out` (a tensor or a tuple / list of them) as ``"dp"`` with `rows` local rows."""
    pieces = list(out) if isinstance(out, tuple | list) else [out]
    for p in pieces:
        if not isinstance(p, T) or p.dim() == 0 or p.shape[0] != rows:
            raise UnsupportedParallelError(
                f"{op_name(func)}: changes dim 0 of a data-parallel activation (local {rows} "
                f"rows -> {list(p.shape) if isinstance(p, T) else p!r}); only ops keeping dim 0 "
                f"run data parallel"
            )
        m.put_dp(p)
    return out


def _aligned_converter(m: DataParallelOps, who: str, ndim: int) -> Callable[[Any], Any]:
    """Tensors with `ndim` dims and a global dim 0 larger than 1 -> this rank's rows; the others
    (broadcast operands: biases, masks, scalars) -> whole."""

    def convert(a: Any) -> Any:
        if not isinstance(a, T):
            return a
        aligned = a.dim() == ndim > 0 and m.state(a)[1][0] != 1
        return m.to_dp(a, who) if aligned else m.to_whole(a, who)

    return convert


def _elementwise(m: DataParallelOps, func: Any, args: Args, kw: dict[str, Any]) -> Any:
    tensors = [a for a in (*args, *kw.values()) if isinstance(a, T)]
    convert = _aligned_converter(m, op_name(func), max(t.dim() for t in tensors))
    out = func(*(convert(a) for a in args), **{k: convert(v) for k, v in kw.items()})
    return _put_rows(m, func, out, int(out.shape[0]) if isinstance(out, T) and out.dim() else -1)


def _is_dp(m: DataParallelOps, a: Any) -> bool:
    return isinstance(a, T) and m.state(a)[0] == "dp"  # untracked: whole ("rep")


def _attention(m: DataParallelOps, func: Any, args: Args, kw: dict[str, Any]) -> Any:
    """``F.scaled_dot_product_attention``: batched q, k, v (and an aligned mask) -> rows."""
    if _arg(args, kw, 4, "dropout_p", 0.0):
        raise UnsupportedParallelError(
            f"{op_name(func)}: dropout_p > 0 would draw a different mask on each rank; pass "
            f"dropout_p=0.0 (compute the attention weights with softmax and apply F.dropout to "
            f"them for a mask equal to the single-device one)"
        )
    if _arg(args, kw, 0, "query").dim() < 3:
        raise _split_dim0(m, func, "attends over", "give q, k, v a leading batch dim")
    return _elementwise(m, func, args, kw)


def _rowwise(m: DataParallelOps, func: Any, args: Args, kw: dict[str, Any]) -> Any:
    x, softmax = args[0], _name(func) in ("softmax", "log_softmax")
    dim = _arg(args, kw, 1, "dim") if softmax else None
    if isinstance(dim, int) and dim % max(x.dim(), 1) == 0:
        raise UnsupportedParallelError(f"{op_name(func)}: over dim 0 of a data-parallel activation")
    return _run_rows(m, func, args, kw)


def _reduced_dims(x: T, args: Args, kw: dict[str, Any]) -> list[int] | None:
    """The dims a reduction (``sum`` / ``mean`` / ``var`` / ``std``) runs over (None: all)."""
    dim = kw.get("dim", args[1] if len(args) > 1 else None)
    if dim is None or isinstance(dim, torch.dtype | bool):
        return None
    return [d % x.dim() for d in ([dim] if isinstance(dim, int) else dim)]


def _loss(m: DataParallelOps, func: Any, args: Args, kw: dict[str, Any]) -> T:
    who = op_name(func)
    bound = _signature(func).bind(*args, **kw)
    given = bound.arguments
    if given.get("size_average") is not None or given.get("reduce") is not None:
        raise UnsupportedParallelError(f"{who}: legacy size_average / reduce arguments")
    reduction = given.get("reduction", "mean")
    if given.get("weight") is not None and reduction == "mean":
        raise UnsupportedParallelError(f"{who}: class weights with reduction='mean'")
    given["input"] = m.to_dp(given["input"], who)
    given["target"] = m.to_dp(given["target"], who)
    out: T = func(*bound.args, **bound.kwargs)
    if reduction == "none":
        return m.put_dp(out)
    return m.reduce_rows(out, mean=reduction == "mean")


def _reduce(m: DataParallelOps, func: Any, args: Args, kw: dict[str, Any]) -> Any:
    dims = _reduced_dims(args[0], args, kw)
    if dims is not None and 0 not in dims:
        return _run_rows(m, func, args, kw)
    out = func(m.to_dp(args[0], op_name(func)), *args[1:], **kw)
    return m.reduce_rows(out, mean=_name(func) == "mean")


def _rowstat(m: DataParallelOps, func: Any, args: Args, kw: dict[str, Any]) -> Any:
    """``var`` / ``std`` over dims other than 0."""
    dims = _reduced_dims(args[0], args, kw)
    if dims is None or 0 in dims:
        raise _split_dim0(m, func, "over", "reduce over dims >= 1 only (e.g. dim=-1)")
    return _run_rows(m, func, args, kw)


def _index(m: DataParallelOps, func: Any, args: Args, kw: dict[str, Any]) -> Any:
    """``x[index]`` with an index that leaves dim 0 whole: it starts with ``:``, or with
    ``...`` followed by fewer dim-consuming entries than ``x`` has dims."""
    x, index = args[0], args[1]
    items = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, T | list) for i in items):
        raise UnsupportedParallelError(
            f"{op_name(func)}: tensor / list indices on a data-parallel activation are not "
            f"supported; index with ints, slices, None and ... (dim 0 left whole)"
        )
    first = items[0] if items else slice(None)
    whole = isinstance(first, slice) and first == slice(None)
    if first is Ellipsis:
        whole = sum(i is not None for i in items[1:]) < x.dim()
    if not whole:
        raise _split_dim0(
            m,
            func,
            f"the index {index!r} touches",
            "start the index with ':' or '...' and index only dims >= 1 (e.g. x[:, 0], x[..., :4])",
        )
    return _run_rows(m, func, args, kw)


def _join(m: DataParallelOps, func: Any, args: Args, kw: dict[str, Any]) -> Any:
    """``cat`` / ``concat`` / ``stack`` along a dim other than 0: every input's rows."""
    who, tensors = op_name(func), _arg(args, kw, 0, "tensors")
    dim = _arg(args, kw, 1, "dim", 0)
    ndim = tensors[0].dim() + (1 if _name(func) == "stack" else 0)
    if dim % ndim == 0:
        raise _split_dim0(m, func, "joins along", "cat / stack along a dim >= 1 (e.g. dim=-1)")
    local = [m.to_dp(t, who) for t in tensors]
    return _put_rows(m, func, func(local, dim=dim), int(local[0].shape[0]))


def _moves_dim0(func: Any, x: T, args: Args, kw: dict[str, Any]) -> bool:
    """Whether a dim-moving view (transpose, permute, unsqueeze, squeeze, split, chunk) moves,
    splits or drops dim 0 of `x`."""
    name, nd = _name(func), x.dim()
    if name == "transpose":
        d0, d1 = _arg(args, kw, 1, "dim0") % nd, _arg(args, kw, 2, "dim1") % nd
        return d0 != d1 and 0 in (d0, d1)
    if name == "permute":
        dims = args[1:] or kw["dims"]
        dims = dims[0] if len(dims) == 1 and isinstance(dims[0], Sequence) else dims
        return bool(dims[0] % nd != 0)
    if name == "unsqueeze":
        return bool(_arg(args, kw, 1, "dim") % (nd + 1) == 0)
    if name == "squeeze":  # without dim it may drop a local dim 0 of size 1
        dim = _arg(args, kw, 1, "dim")
        return dim is None or any(d % nd == 0 for d in ([dim] if isinstance(dim, int) else dim))
    return bool(_arg(args, kw, 2, "dim", 0) % nd == 0)  # split / chunk


def _dims(m: DataParallelOps, func: Any, args: Args, kw: dict[str, Any]) -> Any:
    if _moves_dim0(func, args[0], args, kw):
        raise _split_dim0(
            m,
            func,
            "moves, splits or drops",
            "keep dim 0 first (use dims >= 1, e.g. "
            "transpose(1, 2), permute(0, 2, 1, 3), squeeze(-1), split(n, dim=-1))",
        )
    return _run_rows(m, func, args, kw)


def _cast(m: DataParallelOps, func: Any, args: Args, kw: dict[str, Any]) -> Any:
    """dtype conversions (``float``, ``long``, ``to(dtype)``, ``type_as``): rows -> rows."""
    if _name(func) == "to" and (
        not all(isinstance(a, torch.dtype) for a in args[1:])
        or not set(kw) <= {"dtype", "non_blocking", "copy", "memory_format"}
    ):
        raise UnsupportedParallelError(
            f"{op_name(func)}: only dtype conversions (x.to(torch.float32)) run on a "
            f"data-parallel activation; move tensors between devices outside the network"
        )
    local = m.to_dp(args[0], op_name(func))  # type_as's other only gives its dtype
    return _put_rows(m, func, func(local, *args[1:], **kw), int(local.shape[0]))


def _embedding(m: DataParallelOps, func: Any, args: Args, kw: dict[str, Any]) -> Any:
    """``F.embedding``: this rank's rows of the indices, the table whole."""
    who = op_name(func)
    given = _signature(func).bind(*args, **kw).arguments
    if given.get("max_norm") is not None:
        raise UnsupportedParallelError(
            f"{who}: max_norm renormalizes the table in place from each rank's own indices; "
            f"use max_norm=None"
        )
    given["input"] = m.to_dp(given["input"], who)
    given["weight"] = m.to_whole(given["weight"], who)
    return _put_rows(m, func, func(**given), int(given["input"].shape[0]))


def _norm(m: DataParallelOps, func: Any, args: Args, kw: dict[str, Any]) -> Any:
    """``F.layer_norm`` / ``F.rms_norm`` over trailing dims: rows, weight and bias whole."""
    given = _signature(func).bind(*args, **kw).arguments
    if len(given["normalized_shape"]) >= given["input"].dim():
        raise _split_dim0(
            m,
            func,
            "normalizes over",
            "normalize over trailing dims only (normalized_shape shorter than the input's shape)",
        )
    x = given.pop("input")
    return _run_rows(m, func, (x,), given)


def _matmul(m: DataParallelOps, func: Any, args: Args, kw: dict[str, Any]) -> Any:
    """``x @ weight`` (rows of x, weight whole) or a batched product of activations of rank
    >= 3 (``q @ k.transpose(-2, -1)``: rows of both); broadcast operands stay whole."""
    who = op_name(func)
    a, b = args[0], _arg(args, kw, 1, "mat2" if _name(func) == "bmm" else "other")
    nd = max(a.dim(), b.dim())
    if nd >= 3:
        aligned = [t.dim() == nd and m.state(t)[1][0] != 1 for t in (a, b)]
    else:
        aligned = [a.dim() == 2, False]
    works = (
        "matmul runs data parallel as activation @ whole weight, or as a product of two "
        "batched activations of the same rank >= 3 (q @ k.transpose(-2, -1))"
    )
    for t, keep in zip((a, b), aligned, strict=True):
        if not keep and _is_dp(m, t):
            raise _split_dim0(m, func, "contracts or broadcasts", works)
    if not any(aligned):
        raise _split_dim0(m, func, "loses", works)
    la, lb = (
        m.to_dp(t, who) if k else m.to_whole(t, who) for t, k in zip((a, b), aligned, strict=True)
    )
    rows = int((la if aligned[0] else lb).shape[0])
    return _put_rows(m, func, func(la, lb), rows)


def _dropout(m: DataParallelOps, func: Any, args: Args, kw: dict[str, Any]) -> Any:
    """``F.dropout`` / ``torch.dropout``: x times this rank's rows (all of it for a replicated
    x) of one global mask, drawn as a single-device ``F.dropout`` on the global tensor draws it
    (same RNG use, so the same mask after the same seed)."""
    x, p = args[0], _arg(args, kw, 1, "p", 0.5)
    training = _arg(args, kw, 2, "train" if func is torch.dropout else "training", True)
    inplace = bool(_arg(args, kw, 3, "inplace", False))
    state, shape = m.state(x)
    local = x if state == "rep" else m.to_dp(x, op_name(func))
    if not training or p == 0:
        return local if state == "rep" else m.put_dp(local)
    mask = comm.replicated_draw(
        lambda: F.dropout(torch.ones(shape, dtype=local.dtype, device=local.device), p, True)
    )
    if state != "rep":
        rows = shape[0] // m.world
        rank = comm.get_rank()
        mask = mask[rank * rows : (rank + 1) * rows]
    out = local.mul_(mask) if inplace else local * mask
    if state == "rep":
        m.tracker.put(out, "rep", shape)
        return out
    return m.put_dp(out)


RULES: dict[str, Rule] = {
    "elementwise": _elementwise,
    "rowwise": _rowwise,
    "linear": _rowwise,
    "loss": _loss,
    "reduce": _reduce,
    "rowstat": _rowstat,
    "index": _index,
    "join": _join,
    "dims": _dims,
    "cast": _cast,
    "embedding": _embedding,
    "norm": _norm,
    "matmul": _matmul,
    "attention": _attention,
    "dropout": _dropout,
}
"""Each kind of `_torchops.OP_KINDS` -> its rule."""
