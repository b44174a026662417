"""Lesson 12's layout widget in a real browser, and its static HTML export.

The first test copies ``notebooks/12_a_transformer_in_3d.ipynb`` into a temporary folder,
starts JupyterLab there (the helpers and settings of ``tests/teaching/test_browser.py``), runs all
cells in headless Chromium, waits for the layout explorer's figure of the default layout
(tp=2 dp=2 pp=2), picks another layout in its dropdown and checks that the figure is redrawn
for it, then that at 1024 px every figure fits its output column with its title, legend, colour
bars and annotations inside it (``figures_cut_off_at_1024_px``). The second
exports the lesson to static HTML (``nbconvert --execute``) and checks,
offline, that the default layout's figure is drawn without a kernel.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.teaching.test_browser import (CHROMIUM, CHROMIUM_ARGS, _wait_for_idle_kernel, figures_cut_off_at_1024_px,
                                lesson_after_run_all, serving_lesson)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "12_a_transformer_in_3d.ipynb"

pytestmark = [
    pytest.mark.browser, pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing: install Debian's chromium"),
]


def _env(tmp_path: Path) -> dict:
    path = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return dict(os.environ, SIMCOMM_BACKEND="sim", PYTHONPATH=path, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
                JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
                JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"), IPYTHONDIR=str(tmp_path / "ipython"))


@pytest.fixture
def jupyterlab_12(tmp_path: Path):
    with serving_lesson(NOTEBOOK, tmp_path) as server:
        yield server


def test_lesson_12_layout_widget_in_chromium(jupyterlab_12, tmp_path: Path):
    from playwright.sync_api import expect

    base_url, token = jupyterlab_12
    with lesson_after_run_all(jupyterlab_12, NOTEBOOK, tmp_path) as page:
        explorer = page.locator(".widget-vbox:has(.widget-dropdown)").first
        explorer.wait_for(state="attached")
        explorer.scroll_into_view_if_needed()
        title = explorer.locator(".js-plotly-plot g.g-gtitle").first
        expect(title).to_contain_text("tp=2 dp=2 pp=2")
        explorer.locator(".widget-dropdown select").first.select_option(label="tp=1 dp=8 pp=1")
        expect(title).to_contain_text("tp=1 dp=8 pp=1")
        _wait_for_idle_kernel(base_url, token)
        page.screenshot(path=str(tmp_path / "12_layout_widget.png"))
        cut = figures_cut_off_at_1024_px(page, expect_at_least=3)
        assert not cut, f"lesson 12 at 1024 px: figures that do not fit: {cut}"


def test_lesson_12_html_export_shows_the_default_layout(tmp_path: Path):
    from playwright.sync_api import sync_playwright

    shutil.copy(NOTEBOOK, tmp_path / NOTEBOOK.name)
    export = subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "html", "--execute",
                             "--ExecutePreprocessor.timeout=300", NOTEBOOK.name], cwd=tmp_path, env=_env(tmp_path),
                            capture_output=True, text=True, timeout=600)
    assert export.returncode == 0, export.stderr[-3000:]
    html = tmp_path / f"{NOTEBOOK.stem}.html"

    def offline(route) -> None:
        route.continue_() if route.request.url.startswith("file:") else route.abort()

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.route("**/*", offline)
            page.goto(html.as_uri())
            default = page.locator(".js-plotly-plot:has(g.g-gtitle:has-text('tp=2 dp=2 pp=2'))").first
            default.wait_for()
            assert page.locator(".js-plotly-plot:has(g.g-gtitle:has-text('per layout'))").count() == 1
        finally:
            browser.close()
