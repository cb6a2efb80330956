"""``plan.html`` in a real headless browser (Debian's ``chromium``; ``make pytest`` installs it
when missing, as root with apt-get; without it these tests are skipped, saying why).

Checked: seed 003's page renders (a screenshot that is not blank: many colours, a fair share of
non-white pixels), the browser's DOM holds every op's id and the page's script ran (it counts
the ops on ``<body data-ops>``); a 1,000-op page opened at ``#op-500`` holds every op and opens
that one only; a 1,024-device page renders.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from tests.report.plans import deep_plan, seed003_plan, wide_plan

from shardwise.report import write_plan_html

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not installed and could not be: `make pytest` installs it with "
    "`apt-get install -y chromium` when run as root with apt-get",
)


def chromium(tmp_path: Path, url: str, *flags: str) -> str:
    """Run headless chromium on `url` with `flags`; its standard output."""
    assert CHROMIUM is not None
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",  # (as root)
        "--disable-gpu",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}",
        *flags,
        url,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def screenshot(tmp_path: Path, page: Path, name: str) -> tuple[int, float]:
    """Render `page` to a 1280 x 1600 screenshot: its number of colours and its share of
    pixels that are not white."""
    import matplotlib.image

    shot = tmp_path / name
    chromium(tmp_path, page.as_uri(), f"--screenshot={shot}", "--window-size=1280,1600")
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (1600, 1280)
    rgb = pixels[..., :3].reshape(-1, 3)
    colours = len({tuple(p) for p in rgb[::3].tolist()})
    return colours, float((rgb.min(axis=1) < 0.95).mean())


def test_seed003_page_renders_with_every_op(tmp_path: Path) -> None:
    plan = seed003_plan()
    page = write_plan_html(plan, tmp_path / "plan.html")
    colours, ink = screenshot(tmp_path, page, "seed003.png")
    assert colours > 50 and ink > 0.03, (colours, ink)
    dom = chromium(tmp_path, page.as_uri(), "--dump-dom")
    for n in plan.nodes:
        assert f'id="op-{n.index}"' in dom
        assert f'<span class="name">{n.name}</span>' in dom
    assert re.search(r'<body[^>]* data-ops="6"', dom)  # the script ran and found 6 ops


def test_thousand_op_page_opens_the_op_of_the_address(tmp_path: Path) -> None:
    page = write_plan_html(deep_plan(), tmp_path / "deep.html")
    dom = chromium(tmp_path, page.as_uri() + "#op-500", "--dump-dom")
    assert all(f'id="op-{i}"' in dom for i in range(1000))
    assert re.search(r'<body[^>]* data-ops="1000"', dom)
    opened = re.findall(r'<details class="op" id="op-(\d+)"[^>]* open=""', dom)
    assert opened == ["500"]


def test_1024_device_page_renders(tmp_path: Path) -> None:
    page = write_plan_html(wide_plan(), tmp_path / "wide.html", rank=517)
    colours, ink = screenshot(tmp_path, page, "wide.png")
    assert colours > 50 and ink > 0.03, (colours, ink)
