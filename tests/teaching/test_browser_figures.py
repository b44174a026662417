"""Every lesson's figures fit a projector: measured in headless Chromium, all 16 lessons.

Each lesson is executed once (``simcomm.handout.build_page``: a fresh kernel on the simulator,
exported by nbconvert, as the workshop handout builds its pages) and its page opened in Debian's
Chromium (``/usr/bin/chromium``, network blocked). At two widths:

* a 1024 px viewport (the exported page and the handout: an output column of about 894 px);
* the viewport at which the output column is :data:`JUPYTERLAB_COLUMN_PX` wide, as JupyterLab's is
  at a 1024 px viewport,

the browser's own geometry (``tests.teaching.test_browser.FIGURE_GEOMETRY``) must show every figure
no wider than its output column, and every title, axis title, legend, colour bar, annotation,
slider and button row inside its figure, and every text label of a point or bar inside its plot
area (where its trace clips to the axes); no two of the title, axis titles, legend and colour bars
may overlap. The page must hold exactly as many drawn figures as the
executed lesson displayed, and at least one, so the check cannot pass on an empty page or a
figure that failed to draw. A failure names the figure, the part and its overflow in px.

``test_the_figure_check_fails_on_what_it_must_catch`` shows the check can fail: a fixed-width
figure, a legend or an annotation outside its figure, a point's label cut off by its axes, a
legend over an axis title, a wide figure in a scrolling box, and an empty page are all reported; a figure that sizes to its column passes.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from simcomm import handout
from tests.teaching.test_browser import CHROMIUM, CHROMIUM_ARGS, figure_geometry, misfits
from tests.teaching.test_handout import export_in_a_fresh_process

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = handout.lesson_notebooks()
#: JupyterLab's output column at a 1024 px viewport (px)
JUPYTERLAB_COLUMN_PX = 844

pytestmark = [
    pytest.mark.browser, pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing (apt-get install chromium)"),
]


def build(notebook: Path, out: Path) -> tuple[Path, int, float]:
    """Execute and export ``notebook`` into ``out`` in a fresh process: ``(page, figures, seconds)``.
    A build that times out is tried once more (nbclient has now and then waited forever on a kernel
    that had gone idle, see test_handout.py)."""
    start = time.perf_counter()
    figures = export_in_a_fresh_process(notebook, out, cell_timeout=300, timeout=420)
    return out / f"{notebook.stem}.html", figures, time.perf_counter() - start


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            page = chromium.new_page(viewport={"width": 1024, "height": 900})
            page.set_default_timeout(60_000)
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                       else route.abort())
            yield page
        finally:
            chromium.close()


def measure(page, path: Path, expected: int) -> dict[str, list[dict]]:
    """``{"1024 px page": figures, "JupyterLab's column": figures}``: :func:`figure_geometry` of the
    page ``path`` at a 1024 px viewport, and at the viewport whose output column is
    :data:`JUPYTERLAB_COLUMN_PX`; ``expected`` figures must have drawn."""
    page.set_viewport_size({"width": 1024, "height": 900})
    page.goto(path.as_uri())
    page.wait_for_function("([n]) => document.querySelectorAll('.js-plotly-plot svg.main-svg').length >= n",
                           arg=[expected])
    wide = figure_geometry(page)
    column = max(figure["column"] for figure in wide) if wide else 0
    page.set_viewport_size({"width": 1024 - (column - JUPYTERLAB_COLUMN_PX), "height": 900})
    narrow = figure_geometry(page)
    assert narrow and max(figure["column"] for figure in narrow) == JUPYTERLAB_COLUMN_PX, narrow[:1]
    return {"1024 px page": wide, "JupyterLab's column": narrow}


def _lesson_param(notebook: Path):
    return pytest.param(notebook, id=notebook.stem)


def test_every_lesson_is_measured():
    assert len(NOTEBOOKS) == 16, [nb.stem for nb in NOTEBOOKS]


@pytest.mark.parametrize("notebook", [_lesson_param(nb) for nb in NOTEBOOKS])
def test_every_figure_fits_at_1024_px(notebook: Path, browser, tmp_path: Path):
    path, expected, seconds = build(notebook, tmp_path)
    assert expected >= 1, f"{notebook.stem} displayed no figure"
    started = time.perf_counter()
    widths = measure(browser, path, expected)
    problems = []
    for where, figures in widths.items():
        assert len(figures) == expected, (f"{notebook.stem} ({where}): {len(figures)} figures drawn, "
                                          f"the lesson displayed {expected}")
        problems += [f"{where}: {line}" for line in misfits(figures)]
    print(f"{notebook.stem}: {expected} figures, built in {seconds:.1f} s, measured in "
          f"{time.perf_counter() - started:.1f} s")
    assert not problems, f"{notebook.stem}: figures that do not fit:\n" + "\n".join(problems)


_CASES = {
    "fixed 1500 px": "Plotly.newPlot(d, [{y: [1, 2]}], {width: 1500, height: 300})",
    "legend outside": ("Plotly.newPlot(d, [{y: [1, 2], name: 'a long series name'}, {y: [2, 1], name: 'b'}], "
                       "{height: 300, showlegend: true, legend: {x: 1.3}, margin: {r: 10, autoexpand: false}}, "
                       "{responsive: true})"),
    "annotation outside": ("Plotly.newPlot(d, [{y: [1, 2]}], {height: 300, margin: {r: 10}, annotations: "
                           "[{text: 'beyond the right edge', x: 1.02, xref: 'paper', xanchor: 'left', y: 1, "
                           "showarrow: false}]}, {responsive: true})"),
    "point label cut off": ("Plotly.newPlot(d, [{x: [0, 1], y: [0, 1], mode: 'markers+text', text: ['low', 'high'], "
                            "textposition: 'top center'}], {height: 300, xaxis: {range: [0, 1]}, "
                            "yaxis: {range: [0, 1]}}, {responsive: true})"),
    "legend over the axis title": ("Plotly.newPlot(d, [{y: [1, 2], name: 'first series'}, {y: [2, 1], name: 'second'}], "
                                   "{height: 300, showlegend: true, xaxis: {title: {text: 'time of the step (ms)'}}, "
                                   "legend: {orientation: 'h', x: 0.3, y: -0.2, yanchor: 'top'}}, {responsive: true})"),
    "in a scrolling box": ("d.parentElement.style.overflowX = 'auto'; "
                           "Plotly.newPlot(d, [{y: [1, 2]}], {width: 1400, height: 300})"),
    "sizes to its column": ("Plotly.newPlot(d, [{y: [1, 2], name: 'a'}, {y: [2, 1], name: 'b'}], "
                            "{height: 300, title: {text: 'fits'}, xaxis: {title: {text: 'x'}}}, {responsive: true})"),
}


def test_the_figure_check_fails_on_what_it_must_catch(browser, tmp_path: Path):
    from plotly.offline import get_plotlyjs

    library = tmp_path / "plotly.js"
    library.write_text(get_plotlyjs(), encoding="utf-8")
    found = {}
    for name, script in {**_CASES, "empty page": ""}.items():
        body = ("" if not script else
                '<div class="jp-OutputArea-output"><div><div id="f"></div></div></div>'
                f"<script>const d = document.getElementById('f'); {script};</script>")
        path = tmp_path / f"{name.replace(' ', '_')}.html"
        path.write_text(f'<!DOCTYPE html><html><body><script src="{library.name}"></script>{body}</body></html>',
                        encoding="utf-8")
        try:
            widths = measure(browser, path, 1 if script else 0)
            found[name] = [line for figures in widths.values() for line in misfits(figures)]
        except AssertionError as error:          # no figure: the check refuses to pass
            found[name] = [f"refused: {error}"]
    assert not found.pop("sizes to its column"), found
    for name, lines in found.items():
        assert lines, f"the check missed: {name}"
    assert "legend" in " ".join(found["legend outside"]) and "annotation" in " ".join(found["annotation outside"])
    assert "wider than its column" in " ".join(found["in a scrolling box"])
    assert "axis title and legend" in " ".join(found["legend over the axis title"])
    assert "point label 'high'" in " ".join(found["point label cut off"])
    assert "refused" in found["empty page"][0]
