"""Peak memory of delayed init: a rank holds its block plus a bounded buffer, not the whole.

An ``nn.Linear(4096, 4096)`` (a [4096, 4096] float32 weight, 64 MiB, drawn by
``kaiming_uniform_``) is built inside ``sw.no_init_parameters()`` in a fresh process, and
rank 1's block of MatMul strategy ``((1, 1), (1, 4))`` (the weight split 4 ways, 16 MiB) is
materialized with `block_slicer` (the slicer `AutoParallel` uses), either chunked (the default
4 MiB buffer) or whole then cut (``chunk_bytes=0``, the path before chunking).

The figure asserted is allocator-level: the C heap in use (glibc ``mallinfo2``: bytes in use
in the arena plus mmapped blocks, where torch's CPU tensors live), sampled before and after
every torch call of the materialization by a torch-function mode, minus the same figure just
before. The peak RSS rise (``VmHWM``, reset through ``/proc/self/clear_refs``) is reported as
a second figure. Chunked, the peak must stay within the block plus the buffer plus 8 MiB;
whole, it must exceed the block plus the full weight less 8 MiB (the measurement sees the
full tensor). Both runs give the same block, byte for byte.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

MIB = 1 << 20
SIDE, WAYS, RANK = 4096, 4, 1
FULL = SIDE * SIDE * 4
BLOCK = FULL // WAYS
BUFFER = 4 * MIB  # DEFAULT_CHUNK_BYTES
SLACK = 8 * MIB

WORKER = f"""
import ctypes, gc, hashlib, json, os, sys, time
import torch
from torch.overrides import TorchFunctionMode
import shardwise as sw
from shardwise.layout import strategy_layouts
from shardwise.parallel._delayed import block_slicer
from shardwise.parameter import materialize

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

LIBC = ctypes.CDLL(None)
LIBC.mallinfo2.restype = MallInfo2

def heap():  # bytes malloc has handed out and not taken back
    info = LIBC.mallinfo2()
    return info.uordblks + info.hblkhd

class HeapPeak(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.peak = heap()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.peak = max(self.peak, heap())
        out = func(*args, **(kwargs or {{}}))
        self.peak = max(self.peak, heap())
        return out

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def peak_rss():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: reset VmHWM to the current RSS
    def read():
        with open("/proc/self/status") as f:
            return int(next(l for l in f if l.startswith("VmHWM:")).split()[1]) * 1024
    return read

torch.manual_seed(0)
with sw.no_init_parameters():
    if sys.argv[2] == "linear":
        net = torch.nn.Linear({SIDE}, {SIDE}, bias=False)
    else:  # an initializer name
        net = torch.nn.Module()
        net.weight = sw.Parameter(sw.initializer(sys.argv[2], [{SIDE}, {SIDE}]))
layout = strategy_layouts(((1, 1), (1, {WAYS})), {WAYS}, [[0, 1], [1, 2]]).layouts[1]
params = {{"weight": (layout, ({SIDE}, {SIDE}))}}
gc.collect()
before, rss_before, read_hwm = heap(), rss(), peak_rss()
start = time.perf_counter()
with HeapPeak() as probe:
    materialize(net, slicer=block_slicer(params, {RANK}), chunk_bytes=int(sys.argv[1]))
seconds = time.perf_counter() - start
block = net.weight.detach()
print(json.dumps({{
    "seconds": seconds,
    "heap": probe.peak - before,
    "rss": read_hwm() - rss_before,
    "shape": list(block.shape),
    "sha": hashlib.sha256(block.contiguous().numpy().tobytes()).hexdigest(),
}}))
"""


def run(chunk_bytes: int, build: str = "linear") -> dict[str, object]:
    """One fresh process: ``build`` ("linear" or an initializer name), rank 1's block."""
    command = [sys.executable, "-c", WORKER, str(chunk_bytes), build]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallinfo2, /proc")
def test_chunked_generation_peak_is_the_block_plus_the_buffer() -> None:
    chunked, whole = run(BUFFER), run(0)
    heap_c, heap_w, rss_c, rss_w = chunked["heap"], whole["heap"], chunked["rss"], whole["rss"]
    assert isinstance(heap_c, int) and isinstance(heap_w, int)
    assert isinstance(rss_c, int) and isinstance(rss_w, int)
    report = (
        f"[{SIDE}, {SIDE}] float32 ({FULL // MIB} MiB) split {WAYS} ways, block "
        f"{BLOCK // MIB} MiB: heap peak chunked +{heap_c / MIB:.1f} MiB, whole +{heap_w / MIB:.1f}"
        f" MiB; peak RSS chunked +{rss_c / MIB:.1f} MiB, whole +{rss_w / MIB:.1f} MiB"
    )
    print(report)
    assert chunked["shape"] == whole["shape"] == [SIDE, SIDE // WAYS], report
    assert chunked["sha"] == whole["sha"], report  # the same block, bit for bit
    assert heap_c <= BLOCK + BUFFER + SLACK, report
    assert heap_w >= BLOCK + FULL - SLACK, report  # the measurement sees the full tensor
