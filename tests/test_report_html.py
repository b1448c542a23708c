"""`recovery-replay report --html`: one self-contained file that Chromium draws with no network.

Headless Chromium (Debian's `chromium`, which .ci/run installs when it is missing) loads the file twice: once to
dump the DOM after its script ran (the number of incident bars, and where each chart landed), once to take a
screenshot, in which every chart's area must hold drawn pixels. A machine without Chromium fails here, saying so.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from recovery.cli.replay import main
from recovery.report import build_report, iter_file
from tests.png_support import Image, read_png

GOLDEN = Path(__file__).parent / "golden"
WIDTH = 1280


@pytest.fixture(scope="module")
def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("chromium is not installed: the HTML report's test draws the file in headless Chromium; install "
                    "Debian's package (`apt-get install -y chromium`, as .ci/run does when it is missing)")
    return found


def _chromium(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start. A profile directory of its own per
    # run, so that concurrent runs do not share a lock. subprocess.run kills it if it outlives the timeout.
    return subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--force-device-scale-factor=1", f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=180, check=True)


def _ink(image: Image, box: dict[str, float]) -> tuple[int, int]:
    """(coloured pixels, dark pixels) inside a chart's box: bars and lines are coloured, text is dark; the
    chart's own light backgrounds are neither."""
    coloured = dark = 0
    x0, y0 = max(0, int(box["x"])), max(0, int(box["y"]))
    x1, y1 = min(image.width, int(box["x"] + box["width"])), min(image.height, int(box["y"] + box["height"]))
    for y in range(y0, y1):
        row = image.rows[y]
        for x in range(x0, x1):
            at = x * image.channels
            r, g, b = row[at], row[at + 1], row[at + 2]
            if max(r, g, b) - min(r, g, b) > 60:
                coloured += 1
            elif max(r, g, b) < 140:
                dark += 1
    return coloured, dark


@pytest.mark.parametrize("golden", ["restart_budget", "recover_in_place_fallback"])
def test_html_report_draws_every_chart_and_one_bar_per_incident(chromium: str, tmp_path: Path, golden: str) -> None:
    log = GOLDEN / f"{golden}.jsonl"
    page = tmp_path / "report.html"
    assert main(["report", str(log), "--html", str(page)]) == 0
    text = page.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text), "the page must not load anything"
    incidents = build_report(iter_file(log))["summary"]["incidents"]
    assert incidents >= 1

    dom = _chromium(chromium, tmp_path / "profile-dom", "--dump-dom", page.as_uri()).stdout
    assert dom.count('class="incident-bar"') == incidents
    layout_attr = re.search(r'data-layout="([^"]*)"', dom)
    assert layout_attr is not None, "the page's script did not run"
    layout = {c["id"]: c for c in json.loads(layout_attr.group(1).replace("&quot;", '"'))}
    assert {"timeline-0", "mttr-chart", "lemons"} <= set(layout)
    height = int(max(c["y"] + c["height"] for c in layout.values())) + 40

    shot = tmp_path / "report.png"
    _chromium(chromium, tmp_path / "profile-shot", f"--screenshot={shot}", f"--window-size={WIDTH},{height}",
              page.as_uri())
    image = read_png(shot)
    assert image.width == WIDTH
    for chart in ("timeline-0", "mttr-chart"):
        coloured, _ = _ink(image, layout[chart])
        assert coloured > 200, f"{chart} is blank in the screenshot ({coloured} coloured pixels)"
    _, dark = _ink(image, layout["lemons"])
    assert dark > 100, f"the lemon list is blank in the screenshot ({dark} dark pixels)"
