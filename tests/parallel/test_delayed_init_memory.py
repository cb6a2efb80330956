"""Peak memory of delayed init: rank 5 of an 8-device plan materializes only its blocks.

A 1 GiB model (8 parameters of [4096, 8192] float32, 128 MiB each) is built inside
``sw.no_init_parameters()`` in a fresh process, then materialized either whole (`materialize`)
or as rank 5's blocks of a ((2, 4) matrix, rows over the first axis, columns over the second)
layout, with `block_slicer` (the slicer `AutoParallel` uses). The measured figure is an upper
bound of the extra memory materialization needed: the process's peak RSS (``VmHWM``, reset just
before materializing through ``/proc/self/clear_refs``) minus its RSS just before. The local
blocks are 8 x 16 MiB = 128 MiB; the cap is 4x that (512 MiB), below the model's 1 GiB. The
whole materialization must exceed the cap (so the measurement sees torch allocations) and the
sharded one stay under it (it holds its blocks plus the one full tensor being generated, 128 MiB
here: measured about +258 MiB, against +1025 MiB whole). Both runs give the same block values.
"""

from __future__ import annotations

import json
import subprocess
import sys

MIB = 1 << 20
LAYERS, ROWS, COLS, RANK = 8, 4096, 8192, 5
FULL_BYTES = LAYERS * ROWS * COLS * 4
LOCAL_BYTES = FULL_BYTES // 8
CAP = 4 * LOCAL_BYTES

WORKER = f"""
import gc, json, os, sys
import torch
import shardwise as sw
from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.parallel._delayed import block_slicer
from shardwise.parameter import materialize

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def reset_peak():  # Linux: "5" resets VmHWM (the peak RSS) to the current RSS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

def peak_rss():
    with open("/proc/self/status") as f:
        line = next(l for l in f if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024

torch.manual_seed(0)
with sw.no_init_parameters():
    net = torch.nn.ParameterList(
        sw.Parameter(sw.initializer("normal", [{ROWS}, {COLS}])) for _ in range({LAYERS})
    )
layout = TensorLayout(DeviceMatrix((2, 4), ("a", "b")), ((0,), (1,)))
params = {{n: (layout, ({ROWS}, {COLS})) for n, _ in net.named_parameters()}}
gc.collect()
before = rss()
reset_peak()  # the peak of the materialization alone (not of the imports before it)
if sys.argv[1] == "full":
    materialize(net)
else:
    materialize(net, slicer=block_slicer(params, {RANK}))
peak = peak_rss()
index = layout.local_slice({RANK}, ({ROWS}, {COLS}))
sums = [float(p.detach()[index].double().sum()) if sys.argv[1] == "full"
        else float(p.detach().double().sum()) for p in net]
shapes = [list(p.shape) for p in net]
print(json.dumps({{"extra": peak - before, "sums": sums, "shapes": shapes}}))
"""


def run(mode: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, mode], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_sharded_materialization_peak_is_bounded_by_local_blocks() -> None:
    full, sharded = run("full"), run("sharded")
    full_extra, sharded_extra = full["extra"], sharded["extra"]
    assert isinstance(full_extra, int) and isinstance(sharded_extra, int)
    report = (
        f"model {FULL_BYTES // MIB} MiB, rank {RANK} blocks {LOCAL_BYTES // MIB} MiB, cap "
        f"{CAP // MIB} MiB: whole +{full_extra // MIB} MiB, blocks +{sharded_extra // MIB} MiB"
    )
    print(report)
    assert sharded["shapes"] == [[ROWS // 2, COLS // 4]] * LAYERS, report
    assert full_extra > CAP, report  # the measurement sees torch's allocations
    assert sharded_extra < CAP, report
    one_full = ROWS * COLS * 4  # blocks + the one full tensor being generated, + 64 MiB slack
    assert sharded_extra < LOCAL_BYTES + one_full + 64 * MIB, report
    assert sharded["sums"] == full["sums"]  # the same values as the block of the whole
