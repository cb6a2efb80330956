"""Run every Python block of README.md and docs/*.md that is marked runnable.

The marker is an HTML comment (invisible on GitHub) on the line right before a fence:

- ``<!-- runnable -->`` before a `````python`` fence: the block runs on its own, in a fresh
  namespace and a fresh temporary directory.
- ``<!-- runnable continues -->``: the block runs after the previous runnable block of the same
  file, in that block's namespace (a walk-through split by prose).
- ``<!-- output -->`` before the first fence after a runnable block: that block's standard
  output must equal the fence's text (trailing spaces ignored).

Blocks needing several ranks use `shardwise.testing.simulated_world(n)` themselves; blocks that
read ``data/MNIST`` get a small random stand-in there (`write_small_mnist`). Blocks that need
real worker processes or names the reader supplies stay unmarked (docs/README.md says the same
for writers). `parse_doc` finds the blocks and every malformed marker;
`test_markers_well_formed` fails on any of the latter.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.dataset import write_idx

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^\s*<!--\s*(runnable(?: continues)?|output)\s*-->\s*$")
CANDIDATE = re.compile(r"<!--\s*(run|out)", re.IGNORECASE)  # anything that looks like a marker
FENCE = re.compile(r"^\s*```(.*)$")


@dataclass
class DocBlock:
    """One marked block: where its fence opens (1-based line), its code, and what it needs."""

    path: Path
    line: int
    code: str
    chain: list[DocBlock] = field(default_factory=list)  # earlier blocks it continues
    expected_output: str | None = None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    """README.md and every docs/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _fences(lines: list[str]) -> Iterator[tuple[int, int, str]]:
    """(opening index, closing index, info string) of every fenced block (0-based indices);
    an unclosed fence ends at the last line."""
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith("```"):
            j += 1
        yield i, j, m.group(1).strip()
        i = j + 1


def parse_doc(path: Path, text: str) -> tuple[list[DocBlock], list[str]]:
    """The marked blocks of one Markdown file, and every problem with its markers."""
    lines = text.splitlines()
    problems: list[str] = []
    fences = {start: (end, info) for start, end, info in _fences(lines)}
    inside = {k for start, (end, _) in fences.items() for k in range(start + 1, end)}
    blocks: list[DocBlock] = []
    last_runnable: DocBlock | None = None  # the runnable block whose output may follow
    marked: dict[int, str] = {}
    for n, line in enumerate(lines):
        if n in inside or not CANDIDATE.search(line):
            continue
        where = f"{path.name}:{n + 1}"
        m = MARKER.match(line)
        if m is None:
            problems.append(
                f"{where}: malformed marker {line.strip()!r}; use '<!-- runnable -->', "
                f"'<!-- runnable continues -->' or '<!-- output -->' alone on its line"
            )
        elif n + 1 not in fences:
            problems.append(f"{where}: {m.group(1)!r} must be on the line right before a fence")
        else:
            marked[n + 1] = m.group(1)
    for start, (end, info) in sorted(fences.items()):
        kind = marked.get(start)
        where = f"{path.name}:{start + 1}"
        code = "\n".join(lines[start + 1 : end])
        if kind == "output":
            if last_runnable is None:
                problems.append(f"{where}: an output block must follow a runnable block")
            else:
                last_runnable.expected_output = code
        elif kind is not None and info != "python":
            problems.append(f"{where}: {kind!r} marks a {info or 'plain'!r} block, not python")
        elif kind is not None:
            chain: list[DocBlock] = []
            if kind == "runnable continues":
                if not blocks:
                    problems.append(f"{where}: 'runnable continues' but no runnable block before")
                else:
                    chain = [*blocks[-1].chain, blocks[-1]]
            block = DocBlock(path, start + 1, code, chain)
            blocks.append(block)
            last_runnable = block
            continue
        last_runnable = None
    return blocks, problems


def run_block(block: DocBlock) -> str:
    """Execute `block` (after the blocks it continues) in one namespace; its standard output.
    Tracebacks point at the Markdown file's own line numbers."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    out = io.StringIO()
    for b in [*block.chain, block]:
        code = compile("\n" * b.line + b.code, str(b.path), "exec")
        with contextlib.redirect_stdout(out if b is block else io.StringIO()):
            exec(code, namespace)
    return out.getvalue()


def _collect() -> list[DocBlock]:
    return [b for path in doc_files() for b in parse_doc(path, path.read_text())[0]]


def write_small_mnist(directory: Path, n_train: int = 64, n_test: int = 16) -> None:
    """MNIST's four IDX files with a few random samples (the real files are 55 MB): blocks that
    read ``data/MNIST`` run on these."""
    directory.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", n_train), ("t10k", n_test)):
        images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, 10, (n,), dtype=torch.uint8, generator=g)
        write_idx(directory / f"{split}-images-idx3-ubyte", images)
        write_idx(directory / f"{split}-labels-idx1-ubyte", labels)


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A fresh working directory holding a small ``data/MNIST``; shardwise's global settings
    and torch's RNG put back afterwards."""
    write_small_mnist(tmp_path / "data" / "MNIST")
    monkeypatch.chdir(tmp_path)
    rng = torch.random.get_rng_state()
    try:
        yield
    finally:
        torch.random.set_rng_state(rng)
        sw.reset_auto_parallel_context()
        sw.set_context(save_graphs=0, save_graphs_path="./saved_graph")
        sw.runtime.set_memory(None)


def check_block(block: DocBlock) -> None:
    """Run `block`; when it has an output block, compare what it printed."""
    printed = run_block(block)
    if block.expected_output is not None:
        got = [line.rstrip() for line in printed.rstrip().splitlines()]
        want = [line.rstrip() for line in block.expected_output.rstrip().splitlines()]
        assert got == want, f"{block.id}: the block printed\n{printed}"


@pytest.mark.parametrize("block", _collect(), ids=lambda b: b.id)
def test_doc_block_runs(block: DocBlock, isolated: None) -> None:
    check_block(block)


def test_markers_well_formed() -> None:
    problems = [p for path in doc_files() for p in parse_doc(path, path.read_text())[1]]
    assert problems == []


def test_docs_have_runnable_blocks() -> None:
    """The collector finds the marked blocks (a broken pattern would silently run none)."""
    files = {b.path.name for b in _collect()}
    assert {"README.md", "layout.md", "redistribution.md"} <= files


def test_parse_doc_reports_malformed_markers() -> None:
    text = "\n".join(
        [
            "<!-- runable -->",  # misspelt
            "```python",
            "x = 1",
            "```",
            "<!-- runnable -->",  # marks a bash block
            "```bash",
            "ls",
            "```",
            "<!-- runnable -->",  # not right before a fence
            "",
            "```python",
            "y = 2",
            "```",
            "<!-- output -->",  # no runnable block before it
            "```",
            "2",
            "```",
        ]
    )
    blocks, problems = parse_doc(ROOT / "README.md", text)
    assert blocks == []
    assert [p.split(": ", 1)[0] for p in problems] == [
        "README.md:1",
        "README.md:9",
        "README.md:6",
        "README.md:15",
    ]
    assert "malformed marker" in problems[0] and "not python" in problems[2]


def test_runner_catches_drift_and_wrong_output(isolated: None) -> None:
    """A block calling a name the code lacks fails, with the Markdown line in the traceback;
    a block printing something other than its output block fails; a continued block sees the
    names of the block before it."""
    text = "\n".join(
        [
            "<!-- runnable -->",
            "```python",
            "import shardwise as sw",
            "print(len(sw.Layout((2, 4), ('dp', 'mp')).device_matrix))",
            "```",
            "<!-- output -->",
            "```text",
            "2",
            "```",
            "<!-- runnable continues -->",
            "```python",
            "sw.no_such_function()",
            "```",
        ]
    )
    first, second = parse_doc(ROOT / "README.md", text)[0]
    assert first.expected_output == "2" and second.chain == [first]
    check_block(first)
    first.expected_output = "3"
    with pytest.raises(AssertionError, match=r"README\.md:2: the block printed"):
        check_block(first)
    with pytest.raises(AttributeError, match="no_such_function") as info:
        run_block(second)
    in_text = [e.lineno + 1 for e in info.traceback if str(e.path).endswith("README.md")]
    assert in_text[-1] == 12  # the line of the call in the text above
