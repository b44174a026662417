"""The workshop handout: every lesson exported to HTML keeps its figures, and they work offline.

One module-scoped build (``simcomm.handout.build_handout``, every lesson
executed by nbconvert on the simulator) feeds every test:

* each page holds as many figures (``Plotly.newPlot`` calls) as its executed
  lesson displayed plotly figures, at least one, and plotly.js exactly once;
* the index links every page; lesson-to-lesson links point to pages;
* in headless Chromium with every non-``file:`` request blocked, each page
  draws all its figures, and lesson 03's ring animation plays.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from simcomm import handout
from tests.test_browser import CHROMIUM, CHROMIUM_ARGS

pytestmark = pytest.mark.slow

LESSONS = [nb.stem for nb in handout.lesson_notebooks()]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> tuple[Path, dict[str, handout.Page]]:
    out = tmp_path_factory.mktemp("handout")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SIMCOMM_BACKEND", "sim")      # the kernels inherit it
        pages = handout.build_handout(out)
    return out, {page.path.stem: page for page in pages}


def test_every_lesson_has_a_page_with_all_its_figures(site):
    out, pages = site
    assert sorted(pages) == LESSONS
    for name, page in pages.items():
        text = page.path.read_text(encoding="utf-8")
        assert page.figures >= 1, f"{name} displayed no plotly figure"
        assert text.count("Plotly.newPlot(") == page.figures, f"{name}: a figure has no HTML form"
        assert len(re.findall(r"plotly\.js v\d", text)) == 1, f"{name}: plotly.js must be inlined once"
        assert not re.search(r"<script[^>]*src=\"[^\"]*plot", text), f"{name} loads plotly from the network"
        assert not re.search(r'href="\d\d_\w+\.ipynb', text), f"{name} links a notebook, not a page"


def test_index_links_every_page_and_pages_link_each_other(site):
    out, pages = site
    index = (out / "index.html").read_text(encoding="utf-8")
    for name, page in pages.items():
        assert f'href="{name}.html"' in index
        assert page.goal and page.title in index
    assert 'href="01_collectives.html"' in pages["00_start_here"].path.read_text(encoding="utf-8")


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing (apt-get install chromium)")
def test_pages_draw_and_animate_offline_in_chromium(site):
    from playwright.sync_api import sync_playwright

    out, pages = site
    blocked: list[str] = []

    def offline(route) -> None:
        if route.request.url.startswith("file:"):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.route("**/*", offline)
            page.goto((out / "index.html").as_uri())
            for name in LESSONS:
                page.goto((out / "index.html").as_uri())
                page.locator(f'a[href="{name}.html"]').click()
                page.wait_for_url(f"**/{name}.html")
                page.wait_for_function("([n]) => document.querySelectorAll('.js-plotly-plot').length >= n",
                                       arg=[pages[name].figures])
                drawn = page.locator(".js-plotly-plot g.cartesianlayer, .js-plotly-plot g.layer-above")
                assert drawn.count() >= 1, f"{name}: no figure drew its axes"
            page.goto(pages["03_ring_allreduce_and_cost"].path.as_uri())
            ring = page.locator(".js-plotly-plot:has(g.slider-container)").first
            ring.wait_for()
            ring.scroll_into_view_if_needed()
            labels = ring.locator("g.slider-container g.slider-label-group text").all_text_contents()
            assert len(labels) == 2 * (4 - 1) + 1, labels            # 4 ranks: 6 steps and the start
            assert "start" in ring.locator("g.g-gtitle").text_content()
            ring.locator("g.updatemenu-button").first.click()        # play
            page.wait_for_function(
                "([plot]) => plot.querySelector('g.g-gtitle').textContent.includes('all-gather step')",
                arg=[ring.element_handle()])
        finally:
            browser.close()
    assert all(not url.startswith("file:") for url in blocked)
