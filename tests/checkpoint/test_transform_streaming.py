"""transform streams and publishes atomically: a killed transform leaves no destination (and its
partial output does not break the next run), and peak memory stays within twice the largest
tensor plus a bounded buffer while the model is far larger.

Both run `sw.checkpoint.transform` in a fresh subprocess: the kill test SIGKILLs it once its
hidden partial output holds a file; the memory test reads the process's peak RSS
(``VmHWM``) before and after the transform.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests.checkpoint.ckpt_cases import hidden, merged, snapshot, source, split

import shardwise as sw

MiB = 1 << 20
TRANSFORM = """
import sys
import shardwise.checkpoint as _  # (its imports are not the transform's memory)
import shardwise as sw
def peak():  # this process's peak RSS (ru_maxrss would include the parent's, from the fork)
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
src, dst, strategy = sys.argv[1:4]
base = peak()
sw.checkpoint.transform(src, dst, None if strategy == "-" else strategy, progress=False)
print(peak() - base)
"""


def _start(src: Path, dst: Path, strategy: str = "-") -> subprocess.Popen[str]:
    cmd = [sys.executable, "-c", TRANSFORM, str(src), str(dst), strategy]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _big_source(root: Path, shapes: dict[str, tuple[int, ...]], ranks: int) -> Path:
    """Random tensors of `shapes` as a `ranks`-rank checkpoint (dim 0 split)."""
    g = torch.Generator().manual_seed(0)
    whole = sw.save_checkpoint(
        {k: torch.randn(s, generator=g) for k, s in shapes.items()}, root / "whole.safetensors"
    )
    out = sw.checkpoint.transform(whole, root / "ckpt", split(ranks, shapes), progress=False)
    whole.unlink()
    return out


def _host() -> str:
    """This host's name as partial outputs carry it (``.<dst>.partial-<host>-<pid>-<tag>``)."""
    return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())


def _partial_file(parent: Path, name: str) -> bool:
    """Whether a hidden partial output of `name` already holds a (non-empty) file."""
    for p in parent.glob(f".{name}.partial-*"):
        if any(f.is_file() and f.stat().st_size for f in p.rglob("*")):
            return True
    return False


def test_a_killed_transform_leaves_no_destination_and_the_next_run_completes(
    tmp_path: Path,
) -> None:
    shapes = {f"layer{i}.weight": (1024, 1024) for i in range(16)}  # 64 MiB
    src = _big_source(tmp_path / "s", shapes, 4)
    dst = tmp_path / "out" / "dst"
    proc = _start(src, dst)
    deadline = time.monotonic() + 60
    while not _partial_file(dst.parent, dst.name):
        assert proc.poll() is None, f"finished before it was killed: {proc.communicate()}"
        assert time.monotonic() < deadline, "no partial output appeared in 60 s"
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert not dst.exists()
    stale = hidden(dst.parent)  # the partial output and its (no longer held) lock file
    assert len(stale) == 2 and stale[0].startswith(f".dst.partial-{_host()}-{proc.pid}-")
    assert stale[1] == stale[0] + ".lock"

    sw.checkpoint.transform(src, dst)  # the same again: completes, and clears the stale output
    assert hidden(dst.parent) == [] and (dst / "whole.safetensors").is_file()
    want = merged(src, tmp_path / "want.safetensors")
    got = merged(dst, tmp_path / "got.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_partial_outputs_of_live_processes_or_other_hosts_are_left_alone(tmp_path: Path) -> None:
    src = source(tmp_path / "s")
    dst = tmp_path / "out" / "dst"
    dst.parent.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # (reaped: its pid names no process)
    host = _host()
    names = {
        f".dst.partial-{host}-{dead.pid}-abcdef": False,  # this host, process gone: removed
        f".dst.partial-{host}-{os.getpid()}-abcdef": True,  # this host, alive: kept
        f".dst.partial-otherhost-{dead.pid}-abcdef": True,  # another host's: kept
        ".dst.old-abcdef": True,  # not a partial output
        f".dstx.partial-{host}-{dead.pid}-abcdef": True,  # another destination's
    }
    for name in names:
        (dst.parent / name).mkdir()
        (dst.parent / name / "f").write_bytes(b"x")
    held = f".dst.partial-otherhost-{dead.pid}-held"  # a lock held: a live writer, kept
    freed = f".dst.partial-otherhost-{dead.pid}-freed"  # a lock nobody holds: removed
    for name in (held, freed):
        (dst.parent / name).mkdir()
        (dst.parent / (name + ".lock")).write_bytes(b"")
    with open(dst.parent / (held + ".lock")) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sw.checkpoint.transform(src, dst, 2)
    assert {n: (dst.parent / n).exists() for n in names} == names
    assert (dst.parent / held).exists() and not (dst.parent / freed).exists()
    assert not (dst.parent / (freed + ".lock")).exists()
    assert snapshot(dst) is not None


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize(("ranks", "dst_ranks"), [(4, 2), (2, 1)])
def test_peak_memory_stays_within_twice_the_largest_tensor(
    ranks: int, dst_ranks: int, tmp_path: Path
) -> None:
    shapes = {f"layer{i}.weight": (2048, 2048) for i in range(8)}  # 8 x 16 MiB = 128 MiB
    src = _big_source(tmp_path / "s", shapes, ranks)
    strategy = tmp_path / "dst.json"  # the destination cuts the other dim: every block re-cut
    strategy.write_text(json.dumps(split(dst_ranks, shapes, dim=1).to_json()))
    proc = _start(src, tmp_path / "dst", str(strategy) if dst_ranks > 1 else "-")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    peak, largest, total = int(out.split()[-1]), 16 * MiB, 128 * MiB
    assert peak <= 2 * largest + 32 * MiB <= total / 2, f"peak {peak / MiB:.1f} MiB"
    print(f"peak {peak / MiB:.1f} MiB")
