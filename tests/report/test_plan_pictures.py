"""The plan pictures (`shardwise.report.write_plan_html` / `write_plan_png`) and their writing
with ``save_graphs``.

Seed 003's plan (8 devices, (g0, g1, g2) = (2, 2, 2), global batch 32): the page names every op
with a stable id, shows the axes with their sizes and strides, the bytes of the collectives (the
total checked against a simulated forward's recorder, one AllReduce by hand), the slice table of
matmul1 (rank 5's blocks, as the IR's level 2 shows them), and memory bars whose bytes are the
blocks' sizes worked out by hand. A given memory breakdown is stacked in its order, equal ranks
merged. A 1,024-device plan lists the first 8 ranks and the chosen one per op and says so; a
1,000-op plan keeps every op (closed, with a filter). The PNG is a real PNG of fixed size with
many colours, and its memory panel follows the breakdown given.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
import torch
from tests.parallel.test_seed003_parity import Network
from tests.report.plans import deep_plan, seed003_plan, wide_plan

from shardwise.communication import CommRecorder
from shardwise.context import set_context
from shardwise.parallel import AutoParallel
from shardwise.planner import ParallelPlan
from shardwise.report import (
    dump_parallel_plan,
    format_plan_html,
    plan_memory,
    render_plan_png,
    write_plan_html,
    write_plan_png,
)
from shardwise.testing import simulated_world

SEED003_OPS = [
    "flatten/Flatten",
    "matmul1/MatMul",
    "relu1/ReLU",
    "matmul2/MatMul",
    "relu2/ReLU",
    "matmul3/MatMul",
]
OP = re.compile(
    r"<details class='op' id='op-(\d+)'[^>]*><summary>%(\d+) <span class='name'>([^<]*)"
)


def op_blocks(html: str) -> dict[int, str]:
    """Op index -> the text of its ``<details>`` element."""
    parts = re.split(r"(?=<details class='op')", html)
    out = {}
    for part in parts[1:]:
        m = OP.match(part)
        assert m is not None, part[:200]
        out[int(m.group(1))] = part.split("</details>", 1)[0]
    return out


def slice_rows(block: str) -> list[list[str]]:
    """The cells of each body row of an op's slice table."""
    table = block.split("<table class='slices'>", 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr(?: class='me')?><td>(.*?)</tr>", table)
    return [("<td>" + r).replace("</td>", "").split("<td>")[1:] for r in rows]


@pytest.fixture(scope="module")
def seed003() -> ParallelPlan:
    return seed003_plan()


def test_every_op_with_its_id_and_name(seed003: ParallelPlan) -> None:
    html = format_plan_html(seed003)
    found = [(int(i), int(k), name) for i, k, name in OP.findall(html)]
    assert found == [(i, i, name) for i, name in enumerate(SEED003_OPS)]
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    assert "(semi_auto, 8 devices, 6 ops)" in html
    # strategies as the seed writes them, and where they came from
    blocks = op_blocks(html)
    assert "<span class='tag'>user</span> <code>((2, 4), (4, 1))</code>" in blocks[1]
    assert "<span class='tag'>default</span> <code>((8, 1), (1, 1))</code>" in blocks[5]
    assert "<td class='mono'>(g0, (g1, g2))</td><td>[16, 196]</td>" in blocks[1]  # x's layout


def test_self_contained(seed003: ParallelPlan) -> None:
    html = format_plan_html(seed003)
    assert "http" not in html and "//" not in html.replace("://", "")  # no URL at all
    assert not re.search(r"\ssrc\s*=", html)
    assert "<link" not in html and "@import" not in html and "url(" not in html
    hrefs = re.findall(r"href='([^']*)'", html)
    assert hrefs and all(h.startswith("#") for h in hrefs)  # only links within the page


def test_device_matrix_axes(seed003: ParallelPlan) -> None:
    html = format_plan_html(seed003)
    for name, size, stride in [("g0", 2, 4), ("g1", 2, 2), ("g2", 2, 1)]:
        assert f"<td class='axis'>{name}</td><td>{size}</td><td>{stride}</td>" in html
    cells = re.findall(r"title='rank (\d+): ([^']*)'>(\d+)</td>", html)
    assert len(cells) == 8
    assert ("5", "g0=1, g1=0, g2=1", "5") in cells  # rank = 4*g0 + 2*g1 + g2


def test_collective_bytes_match_a_simulated_forward(seed003: ParallelPlan) -> None:
    net = Network()
    with simulated_world(8) as world, CommRecorder() as rec:
        world.replicate(net)
        AutoParallel(net)(world.rank_map(lambda r: torch.zeros(4, 1, 28, 28)))
    sent = sum(r.bytes_sent for r in rec.records)
    html = format_plan_html(seed003)
    assert f"Rank 0 sends {sent} bytes" in html
    # matmul2's AllReduce of its [32, 512] float32 output over all 8 ranks: 2 * 7/8 * 65536
    assert "<td>AllReduce over g0, g1, g2</td><td>1</td><td title='112.0 KiB'>114688</td>" in html
    mm2 = op_blocks(html)[3]
    assert "AllReduce(sum) over g0, g1, g2</td><td>[0, 1, 2, 3, 4, 5, 6, 7]</td><td>114688" in mm2


def test_slice_table_as_seed_003(seed003: ParallelPlan) -> None:
    html = format_plan_html(seed003, rank=5)
    rows = slice_rows(op_blocks(html)[1])
    assert [r[0] for r in rows] == [str(r) for r in range(8)]
    assert rows[5] == ["5", "(1, 0, 1)", "[16:32, 196:392]", "[196:392, 0:512]", "[16:32, 0:512]"]
    assert "<tr class='me'><td>5</td>" in op_blocks(html)[1]
    assert "AllReduce(sum) over g1, g2</td><td>[4, 5, 6, 7]</td>" in op_blocks(html)[1]
    with pytest.raises(ValueError, match="rank 8"):
        format_plan_html(seed003, rank=8)


def test_memory_bars_from_the_plan(seed003: ParallelPlan) -> None:
    # blocks: fc1 [196, 512] + fc2 [64, 512] + fc3 [512, 10] = 138240 floats. The peak is the
    # gradient reduction (every whole gradient; no shard bucket: no reduction buffers), above
    # the start of backward (op outputs but Flatten's view: 30760 floats, the largest one's
    # gradient [32, 512], an edge's [16, 196]: 129584 floats)
    expected = {
        "parameters": 552960,
        "gradients": 552960,
        "optimizer state": 0,  # (no optimizer known)
        "activations": 0,
        "communication buffers": 0,
    }
    assert plan_memory(seed003) == {r: expected for r in range(8)}
    html = format_plan_html(seed003)
    rects = re.findall(r"<rect class='mem' data-kind='([^']*)' data-bytes='(\d+)'", html)
    assert rects == [(k, str(v)) for k, v in expected.items()]  # one bar: ranks 0-7
    assert "<tr><td>0-7</td>" in html


def test_memory_given_is_stacked_in_its_order(seed003: ParallelPlan) -> None:
    memory = {
        r: {"parameters": 1000, "optimizer state": 2000, "communication buffers": 5 + (r >= 4)}
        for r in range(8)
    }
    html = format_plan_html(seed003, memory)
    rects = re.findall(r"<rect class='mem' data-kind='([^']*)' data-bytes='(\d+)'", html)
    kinds = ["parameters", "optimizer state", "communication buffers"]
    assert [k for k, _ in rects] == kinds * 2  # two bars: ranks 0-3 and 4-7
    assert [b for _, b in rects] == ["1000", "2000", "5", "1000", "2000", "6"]
    assert "<tr><td>0-3</td>" in html and "<tr><td>4-7</td>" in html
    assert "optimizer state</div>" not in html and "</span>optimizer state" in html  # legend


def test_1024_devices_list_a_bounded_set_of_ranks() -> None:
    plan = wide_plan()
    html = format_plan_html(plan, rank=517)
    assert "(32, 32)" in html  # matmul1's strategy
    blocks = op_blocks(html)
    assert len(blocks) == len(plan.nodes) == 3
    for block in blocks.values():
        assert [r[0] for r in slice_rows(block)] == [*map(str, range(8)), "517"]
        assert len(block) < 20_000
    assert "Slice tables list ranks 0, 1, 2, 3, 4, 5, 6, 7, 517 of 1024" in html
    assert "<td class='axis'>g0</td><td>32</td><td>32</td>" in html
    assert html.count("title='rank ") == 1024  # the matrix: every rank once
    assert len(html) < 200_000


def test_a_thousand_ops() -> None:
    plan = deep_plan()
    html = format_plan_html(plan)
    ids = [int(i) for i, _, _ in OP.findall(html)]
    assert ids == list(range(1000))
    assert " open>" not in html  # closed: a filter box finds them
    assert "<input id='filter'" in html
    assert len(html) < 5_000_000


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def colours(path: Path) -> int:
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    return len({tuple(p) for p in pixels.reshape(-1, pixels.shape[-1])[::7].tolist()})


def test_png(seed003: ParallelPlan, tmp_path: Path) -> None:
    path = write_plan_png(seed003, tmp_path / "a" / "plan.png")
    data = path.read_bytes()
    assert png_size(data) == (1600, 550)
    assert len(data) > 20_000
    assert colours(path) > 100
    wide = write_plan_png(wide_plan(), tmp_path / "wide.png").read_bytes()
    assert png_size(wide) == (1600, 550) and len(wide) < 400_000  # bounded for 1,024 devices
    other = {r: {"parameters": 10**6, "optimizer state": 3 * 10**6} for r in range(8)}
    assert render_plan_png(seed003, other) != data  # the memory panel follows the breakdown


def test_png_frames_the_chosen_rank(seed003: ParallelPlan) -> None:
    """`rank` is framed on the device matrix and its bytes drawn (`shardwise plan --rank R`
    passes R: the picture showed the first rank whatever R was)."""
    first = render_plan_png(seed003)
    assert render_plan_png(seed003, rank=0) == first
    fifth = render_plan_png(seed003, rank=5)
    assert fifth != first and png_size(fifth) == (1600, 550)
    with pytest.raises(ValueError, match=r"plan picture for rank 8: .* has ranks 0 to 7"):
        render_plan_png(seed003, rank=8)


def test_save_graphs_writes_the_pictures(seed003: ParallelPlan, tmp_path: Path) -> None:
    try:
        set_context(save_graphs=1, save_graphs_path=tmp_path)
        written = dump_parallel_plan(seed003)
        dump_parallel_plan(seed003, variant=2)
    finally:
        set_context(save_graphs=0, save_graphs_path="./saved_graph")
    assert tmp_path / "rank_0" / "plan.png" in written
    assert png_size((tmp_path / "rank_0" / "plan_2.png").read_bytes()) == (1600, 550)
    for r in range(8):
        html = (tmp_path / f"rank_{r}" / "plan.html").read_text()
        assert html == format_plan_html(seed003, rank=r)
        assert (tmp_path / f"rank_{r}" / "plan_2.html").exists()
    assert not (tmp_path / "rank_1" / "plan.png").exists()


def test_write_plan_html(seed003: ParallelPlan, tmp_path: Path) -> None:
    path = write_plan_html(seed003, tmp_path / "deep" / "plan.html")
    assert path.read_text() == format_plan_html(seed003)
    assert sorted(p.name for p in path.parent.iterdir()) == ["plan.html"]  # no temporary left
