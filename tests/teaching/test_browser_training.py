"""Lesson 06 in a real browser: JupyterLab, headless Chromium, Playwright; the bucket-size slider moves.

Uses the JupyterLab helpers of ``tests/teaching/test_browser.py`` (a server on a temporary copy of the
notebook, its settings and runtime files in the temporary folder, stopped with SIGINT and checked
to leave no process behind). Runs all cells, waits for the bucket slider and its timeline, moves
the slider one step right (from 1 MiB buckets to one bucket) and checks that the timeline shown is
redrawn with the one-bucket numbers. Then, at a projector's 1024 px, every figure of the notebook
fits its output column, its title, legend and annotations inside it. Saves a screenshot in the test's temporary folder.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.teaching.test_browser import CHROMIUM, _wait_for_idle_kernel, figures_cut_off_at_1024_px, lesson_after_run_all, serving_lesson

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "06_data_parallel.ipynb"

pytestmark = [
    pytest.mark.browser, pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing"),
]


@pytest.fixture
def lab(tmp_path: Path):
    with serving_lesson(NOTEBOOK, tmp_path) as server:
        yield server


def test_lesson_06_bucket_slider_in_chromium(lab, tmp_path: Path):
    from playwright.sync_api import expect

    base_url, token = lab
    before = NOTEBOOK.read_bytes()
    screenshot = tmp_path / "06_data_parallel.png"
    with lesson_after_run_all(lab, NOTEBOOK, tmp_path) as page:
        box = page.locator(".widget-vbox:has(.widget-slider)").first
        box.wait_for(state="attached")
        box.scroll_into_view_if_needed()
        expect(box.locator(".widget-readout").first).to_contain_text("1 MiB")
        expect(box.locator(".js-plotly-plot").first).to_contain_text("exposed 17.9")
        handle = box.locator(".widget-slider .noUi-handle").first
        handle.focus()
        handle.press("ArrowRight")
        expect(box.locator(".widget-readout").first).to_contain_text("one bucket")
        expect(box.locator(".js-plotly-plot").first).to_contain_text("exposed 31.8")
        _wait_for_idle_kernel(base_url, token)
        page.screenshot(path=str(screenshot))
        cut = figures_cut_off_at_1024_px(page, expect_at_least=4)
        assert not cut, f"lesson 06 at 1024 px: figures that do not fit: {cut}"
    assert screenshot.stat().st_size > 10_000
    assert NOTEBOOK.read_bytes() == before, "JupyterLab wrote into the repository's notebook"
    print(f"screenshot: {screenshot}")
