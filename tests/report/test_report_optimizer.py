"""The optimizer-parallel section of ``execute.ir``: with hsdp, every bucket's collectives per
training step on each rank, with that rank's groups; its ``send_bytes`` add up to what the
CommRecorder measures in one step (8 simulated ranks, seed 000's MLP, fusion ids 0/1/2).
Without hsdp, the same section lists the gradient AllReduce buckets."""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

from shardwise.context import set_context
from shardwise.testing import CommRecorder, simulated_world

sys.path.insert(0, str(Path(__file__).parents[1] / "optim"))
from test_hsdp import SMALL, Mlp, train

LINE = re.compile(
    r"^%opt\d+ = (\w+)\((.*)\) \{when: (\w+).*group: \[([\d, ]+)\].*send_bytes: (\d+)\}$"
)


def run(tmp_path: Path, level: str | None, shard_size: int = -1) -> tuple[CommRecorder, Path]:
    """Two SGD steps with ``save_graphs=2`` (hsdp at `level`; None: without hsdp); the recorder
    of the second step."""
    recorders: list[CommRecorder] = []
    net = Mlp(small=True)  # outside the world (inside, factories draw per rank)
    set_context(save_graphs=2, save_graphs_path=str(tmp_path))
    try:
        with simulated_world(8) as world:
            train(
                world,
                net,
                "sgd",
                lambda p: (
                    None
                    if level is None
                    else p.hsdp(shard_size=shard_size, threshold=0, optimizer_level=level)
                ),
                lambda step, parallel, rec: recorders.append(rec),
                SMALL[:2],
            )
    finally:
        set_context(save_graphs=0, save_graphs_path="./saved_graph")
    return recorders[-1], tmp_path


HSDP = "# optimizer parallel: hsdp("
BUCKETS = "# gradient buckets (no optimizer parallel); collectives per training step"


def section(path: Path, header: str = HSDP) -> list[tuple[str, str, str, tuple[int, ...], int]]:
    """The section's collectives (its header checked: `HSDP` or `BUCKETS`)."""
    text = path.read_text()
    assert header in text and text.endswith("\n")  # (the section ends the file: a last newline)
    if header == BUCKETS:  # (hsdp never asked for: the section does not claim it)
        assert "hsdp(" not in text and "optimizer-parallel bytes" not in text
        assert "# gradient-bucket bytes this rank sends per step: " in text
    out = []
    for line in text.splitlines():
        if line.startswith("%opt"):
            m = LINE.match(line)
            assert m, line
            kind, names, when, group, sent = m.groups()
            out.append((kind, names, when, tuple(int(r) for r in group.split(", ")), int(sent)))
    return out


def test_level1_section_matches_the_recorded_step(tmp_path: Path) -> None:
    rec, root = run(tmp_path, "level1", shard_size=2)
    pairs, copies = (0, 1), (0, 2, 4, 6)
    got = section(root / "rank_0" / "execute.ir")
    # four shard buckets (layer1's weight and bias alone: fusion id 0; layer2; layer3)
    assert Counter((k, w, g) for k, _, w, g, _ in got) == Counter(
        {
            ("AllGather", "forward", pairs): 4,
            ("ReduceScatter", "optimizer", pairs): 4,
            ("AllReduce", "after", copies): 4,
        }
    )
    assert [n for k, n, *_ in got if k == "AllGather"] == [
        "layer1.weight", "layer1.bias", "layer2.weight, layer2.bias",
        "layer3.weight, layer3.bias",
    ]  # fmt: skip
    # everything but the loss's AllReduce pair: the same bytes as the recorded step
    recorded = sum(r.bytes_sent for r in rec.records if r.group != tuple(range(8)))
    assert sum(s for *_, s in got) == recorded
    # rank 5: its own pair and copies
    groups = {g for *_, g, _ in section(root / "rank_5" / "execute.ir")}
    assert groups == {(4, 5), (1, 3, 5, 7)}


def test_level3_lists_the_backward_gathers_that_run(tmp_path: Path) -> None:
    """Level 3 gathers a bucket again in backward only when backward reads a member: layer2's
    and layer3's (their weights multiply activations that need a gradient), not layer1's
    weight or bias (the first layer's input needs no gradient; a bias is added). The section
    lists exactly the backward AllGathers the recorded step ran, with their bytes."""
    rec, root = run(tmp_path, "level3", shard_size=-1)
    got = section(root / "rank_0" / "execute.ir")
    everyone = tuple(range(8))
    assert Counter((k, w, g) for k, _, w, g, _ in got) == Counter(
        {
            ("AllGather", "forward", everyone): 4,
            ("AllGather", "backward", everyone): 2,
            ("ReduceScatter", "backward", everyone): 4,
        }
    )
    again = [(n, s) for k, n, w, _, s in got if (k, w) == ("AllGather", "backward")]
    ran = rec.select(kind="AllGather", phase="backward")
    assert [n for n, _ in again] == ["layer2.weight, layer2.bias", "layer3.weight, layer3.bias"]
    assert len(ran) == len(again), rec.summary()
    assert sum(s for _, s in again) == sum(r.bytes_sent for r in ran)


def test_without_hsdp_lists_the_gradient_buckets(tmp_path: Path) -> None:
    """Without hsdp: one AllReduce per 25 MB gradient bucket, here one for the whole MLP (every
    parameter replicated on all 8 ranks), its bytes those of the recorded step; the header says
    gradient buckets, no optimizer parallel (not ``hsdp(...)``)."""
    rec, root = run(tmp_path, None)
    got = section(root / "rank_0" / "execute.ir", BUCKETS)
    everyone = tuple(range(8))
    names = "layer3.bias, layer3.weight, layer2.bias, layer2.weight, layer1.bias, layer1.weight"
    assert [(k, n, w, g) for k, n, w, g, _ in got] == [("AllReduce", names, "backward", everyone)]
    # the loss's forward AllReduce (1 element) is not in the section
    recorded = sum(r.bytes_sent for r in rec.records if r.phase == "backward")
    assert sum(s for *_, s in got) == recorded
