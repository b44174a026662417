"""The lessons in a real browser: JupyterLab, headless Chromium, Playwright.

The test copies ``notebooks/01_collectives.ipynb`` into a temporary folder,
starts JupyterLab there (127.0.0.1, a free port, token auth on, its settings,
workspaces and runtime files in the temporary folder too, so nothing is
written into the repository), opens the notebook in Debian's Chromium
(``/usr/bin/chromium``; no browser is ever downloaded), runs all cells, waits
for a plotly figure and the explorer's world-size slider, moves the slider
and checks that the explorer's figure is redrawn with one more rank, then that at 1024 px every
figure fits its output column with its title, legend, colour bars and annotations inside it
(:data:`FIGURE_GEOMETRY`, also used on every lesson's export by
``tests/teaching/test_browser_figures.py``). It saves
a screenshot in the test's temporary folder and prints its path.

JupyterLab is stopped the way it expects: SIGINT twice (the first asks for a
confirmation that nobody gives). The test then asserts that the server and
every process it started (kernels) are gone.

Exported lessons (static HTML, no kernel, network blocked) are tested with
the workshop handout in ``tests/teaching/test_handout.py``.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launchers import default_sigint

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "01_collectives.ipynb"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = [
    pytest.mark.browser, pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(),
                       reason=f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium)"),
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_server(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"JupyterLab exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"JupyterLab did not answer {url} within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _descendants(pid: int) -> list:
    import psutil
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _stop_jupyter(proc: subprocess.Popen) -> list[int]:
    """SIGINT twice, wait; return the pids of the server and its children still alive afterwards."""
    import psutil
    children = _descendants(proc.pid)
    for _ in range(2):
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    gone, alive = psutil.wait_procs(children, timeout=15)
    left = [p.pid for p in alive] + ([proc.pid] if proc.poll() is None else [])
    for pid in left:            # do not leave them behind even when the test fails
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.wait(timeout=10)
    return left


#: user settings for the test's JupyterLab: start the notebook's kernel without asking; no news toast;
#: every cell laid out (no windowing), so that the width check sees every figure's real size
_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"autoStartDefaultKernel": True,
                                                                  "windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                       "checkForUpdates": False},
}


def _write_settings(folder: Path) -> None:
    for name, values in _SETTINGS.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


@contextlib.contextmanager
def serving_lesson(notebook: Path, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A JupyterLab server on a copy of ``notebook`` in ``tmp_path``, its settings and runtime
    files there too: yields ``(base_url, token)``; on exit it is stopped and must leave no process."""
    lab_root = tmp_path / "lab"
    lab_root.mkdir()
    shutil.copy(notebook, lab_root / notebook.name)
    port, token = _free_port(), os.urandom(16).hex()
    path = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env = dict(os.environ, SIMCOMM_BACKEND="sim", PYTHONPATH=path,
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"),
               IPYTHONDIR=str(tmp_path / "ipython"))
    _write_settings(tmp_path / "settings")
    log = tmp_path / "jupyterlab.log"
    command = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={lab_root}",
               "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")      # containers and CI run as root
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=lab_root,
                                preexec_fn=default_sigint)    # stopped by SIGINT below
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_server(f"{base_url}/api/status?token={token}", proc, log)
        yield base_url, token
    finally:
        left = _stop_jupyter(proc)
        assert not left, f"processes left after stopping JupyterLab: {left}\n{log.read_text()[-2000:]}"


#: JavaScript (the handout's tests, tests/teaching/test_handout.py): the figures (``.js-plotly-plot``)
#: cut off at the right edge without a scrollbar, and
#: how many figures it looked at. The edge is the page's (an exported page) or, given a selector,
#: that element's (JupyterLab's notebook panel); a figure wider than the edge passes only inside a
#: box that scrolls sideways (overflow-x auto or scroll) and itself ends within the edge.
CUT_OFF_FIGURES = """(boundary) => {
  const edge = boundary ? document.querySelector(boundary) : null;
  const limit = edge ? edge.getBoundingClientRect().right : document.documentElement.clientWidth;
  const cut = [];
  const plots = [...(edge || document).querySelectorAll('.js-plotly-plot')];
  plots.forEach((plot, index) => {
    const right = plot.getBoundingClientRect().left + plot.scrollWidth;
    if (right <= limit + 1) return;
    let box = plot.parentElement, scrolls = false;
    while (box && box !== document.body && box !== edge) {
      const style = getComputedStyle(box);
      if (['auto', 'scroll'].includes(style.overflowX) && box.getBoundingClientRect().right <= limit + 1) {
        scrolls = true; break;
      }
      box = box.parentElement;
    }
    if (!scrolls) cut.push(index + ': ' + Math.round(right) + ' px wide on a ' + Math.round(limit) + ' px page');
  });
  return {checked: plots.length, cut: cut};
}"""


#: JavaScript: the geometry of every plotly figure of the page, measured as the browser drew it.
#: Per figure (``.js-plotly-plot``): its width, its output column's (the closest
#: ``.jp-OutputArea-output``, in JupyterLab and in an nbconvert export alike) and every problem
#: found: the figure (its ``svg.main-svg``) reaching beyond its column or the viewport, or a
#: title, axis title, legend, colour bar, annotation, slider or button row reaching beyond the
#: figure (what lies outside a figure's svg is not drawn: a clipped label), or a text label of a
#: point or bar cut off by its plot area (traces that clip to their axes), or two of the title, axis
#: titles, legend and colour bars overlapping. Each problem names the part, its text and its
#: overflow (for an overlap: its smaller extent) in px. A scrolling box around a figure does not excuse it.
FIGURE_GEOMETRY = """() => {
  const viewport = document.documentElement.clientWidth;
  const parts = [['title', '.g-gtitle'], ['axis title', 'g[class^="g-"][class$="title"]:not(.g-gtitle)'],
                 ['legend', 'g.legend'], ['colour bar', 'g.colorbar'], ['annotation', 'g.annotation'],
                 ['slider', 'g.slider-container'], ['buttons', 'g.updatemenu-container']];
  const beyond = (outer, r) => Math.max(outer.left - r.left, r.right - outer.right, outer.top - r.top,
                                        r.bottom - outer.bottom);
  return [...document.querySelectorAll('.js-plotly-plot')].map((plot) => {
    const svg = plot.querySelector('svg.main-svg');
    const figure = (svg || plot).getBoundingClientRect();
    const column = (plot.closest('.jp-OutputArea-output') || plot.parentElement).getBoundingClientRect();
    const title = plot.querySelector('.g-gtitle');
    const problems = [];
    if (!svg) problems.push({part: 'figure', text: 'not drawn', overflow: 0});
    const wide = Math.max(figure.right - Math.min(column.right, viewport), column.left - figure.left);
    if (wide > 1) problems.push({part: 'figure', text: 'wider than its column', overflow: Math.round(wide)});
    for (const [name, selector] of parts) {
      for (const element of plot.querySelectorAll(selector)) {
        const box = element.getBoundingClientRect();
        if (box.width < 1 || box.height < 1) continue;
        const over = beyond(figure, box);
        if (over > 1) problems.push({part: name, text: (element.textContent || '').slice(0, 60),
                                     overflow: Math.round(over)});
      }
    }
    // the title, axis titles, legend and colour bars do not overlap one another
    const furniture = [['title', '.g-gtitle'], ['axis title', 'g[class^="g-"][class$="title"]:not(.g-gtitle)'],
                       ['legend', 'g.legend'], ['colour bar', 'g.colorbar']].flatMap(([name, selector]) =>
      [...plot.querySelectorAll(selector)].map((element) => [name, element, element.getBoundingClientRect()]))
      .filter(([, , box]) => box.width >= 1 && box.height >= 1);
    furniture.forEach(([name, element, box], i) => furniture.slice(i + 1).forEach(([other, next, box2]) => {
      const across = Math.min(box.right, box2.right) - Math.max(box.left, box2.left);
      const down = Math.min(box.bottom, box2.bottom) - Math.max(box.top, box2.top);
      if (across > 2 && down > 2 && !element.contains(next) && !next.contains(element))
        problems.push({part: name + ' and ' + other, text: (element.textContent || '').slice(0, 30) + ' / ' +
                       (next.textContent || '').slice(0, 30), overflow: Math.round(Math.min(across, down))});
    }));
    // a point's or bar's text label of a trace that clips to its axes must lie in a plot area
    const areas = [...plot.querySelectorAll('.nsewdrag')].map((area) => area.getBoundingClientRect());
    for (const element of plot.querySelectorAll('g.trace g.textpoint text, g.trace.bars g.point text')) {
      const bound = (element.closest('g.trace').__data__ || [{}])[0];
      const box = element.getBoundingClientRect();
      if (!bound || !bound.trace || bound.trace.cliponaxis === false || box.width < 1 || !areas.length) continue;
      const over = Math.min(...areas.map((area) => beyond(area, box)));
      if (over > 1) problems.push({part: 'point label', text: element.textContent.slice(0, 60),
                                   overflow: Math.round(over)});
    }
    return {title: title ? title.textContent.slice(0, 80) : '', width: Math.round(figure.width),
            column: Math.round(column.width), problems: problems};
  });
}"""


def figure_geometry(page) -> list[dict]:
    """:data:`FIGURE_GEOMETRY` of ``page``, measured once plotly has stopped resizing its figures
    (two measurements a quarter second apart agree)."""
    previous = None
    for _ in range(40):
        current = page.evaluate(FIGURE_GEOMETRY)
        if current == previous:
            return current
        previous = current
        page.wait_for_timeout(250)
    return current


def misfits(figures: list[dict]) -> list[str]:
    """One line per problem of :func:`figure_geometry`'s figures: figure number, title, part, overflow."""
    return [f"figure {index} ({figure['title'][:50]!r}, {figure['width']} px in a {figure['column']} px column): "
            f"{problem['part']} {problem['text'][:40]!r} "
            f"{'overlap' if ' and ' in problem['part'] else 'beyond'} by {problem['overflow']} px"
            for index, figure in enumerate(figures) for problem in figure["problems"]]


def figures_cut_off_at_1024_px(page, *, expect_at_least: int = 1) -> list[str]:
    """Close JupyterLab's left sidebar, resize ``page`` (JupyterLab, every cell run) to a projector's
    1024 px (an output column of about 844 px) and return what does not
    fit (:func:`misfits`): a figure wider than its output column, or a figure's title, legend,
    colour bar, annotation or axis title outside it. At least ``expect_at_least`` figures must
    have been measured, so the check cannot pass on an empty page."""
    current = page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current")
    if current.count():     # on a projector the notebook is shown without the file browser beside it
        current.first.click()
    page.set_viewport_size({"width": 1024, "height": 900})
    page.wait_for_timeout(1500)                          # JupyterLab and plotly lay out again
    figures = figure_geometry(page)
    assert len(figures) >= expect_at_least, f"only {len(figures)} figures in the notebook"
    columns = sorted({figure["column"] for figure in figures})
    print(f"JupyterLab at 1024 px: {len(figures)} figures, output columns {columns} px")
    assert columns[-1] >= 800, f"JupyterLab's output column is {columns[-1]} px: did the file browser close?"
    return misfits(figures)


@pytest.fixture
def jupyterlab(tmp_path: Path):
    """A JupyterLab server on a copy of lesson 01: yields ``(base_url, token)``."""
    with serving_lesson(NOTEBOOK, tmp_path) as server:
        yield server


def _wait_for_idle_kernel(base_url: str, token: str, timeout: float = 120.0) -> None:
    """Wait until the notebook's kernel has started and is idle (asked from the server's REST API)."""
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{base_url}/api/sessions?token={token}", timeout=5) as response:
            sessions = json.loads(response.read())
        states = [session["kernel"]["execution_state"] for session in sessions if session.get("kernel")]
        state = states[0] if states else None
        if state == "idle":
            return
        time.sleep(0.5)
    raise AssertionError(f"the notebook's kernel was not idle within {timeout:.0f} s (last state: {state})")


@contextlib.contextmanager
def lesson_after_run_all(served: tuple[str, str], notebook: Path, tmp_path: Path,
                         timeout_ms: int = 180_000) -> Iterator:
    """Headless Chromium (1400 x 1000) on the lesson ``notebook`` served at ``served`` (the
    ``(base_url, token)`` of :func:`serving_lesson`): its kernel idle, then Run All Cells
    clicked. Yields the page; on a failure inside the block saves a full-page screenshot in
    ``tmp_path`` and prints its path."""
    from playwright.sync_api import expect, sync_playwright

    # expect()'s own default is 5 s: a widget's kernel round trip on a loaded 2-core machine can
    # take longer (the page's default timeout does not apply to expect)
    expect.set_options(timeout=60_000)
    base_url, token = served
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.set_default_timeout(timeout_ms)
            page.goto(f"{base_url}/lab/tree/{notebook.name}?token={token}")
            page.locator(".jp-Notebook .jp-Cell").first.wait_for()
            _wait_for_idle_kernel(base_url, token)
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
            yield page
        except Exception:
            failure = tmp_path / "failure.png"
            page.screenshot(path=str(failure), full_page=True)
            print(f"screenshot of the failure: {failure}")
            raise
        finally:
            browser.close()


def _explorer_state(page) -> tuple[int, str]:
    """(number of plotly subplots, status text) of the explorer widget."""
    explorer = page.locator(".widget-vbox:has(.widget-slider)").first
    plot = explorer.locator(".js-plotly-plot").first
    return plot.locator("g.cartesianlayer > g.subplot").count(), explorer.locator(".widget-html").first.inner_text()


def test_lesson_01_in_chromium(jupyterlab, tmp_path: Path):
    from playwright.sync_api import expect

    base_url, token = jupyterlab
    before = NOTEBOOK.read_bytes()
    screenshot = tmp_path / "01_collectives.png"
    with lesson_after_run_all(jupyterlab, NOTEBOOK, tmp_path, timeout_ms=120_000) as page:
        # a plotly figure drawn by plotly's JupyterLab renderer, and the explorer's slider
        page.locator(".jp-OutputArea .js-plotly-plot").first.wait_for(state="attached")
        slider = page.locator(".widget-vbox .widget-slider").first
        slider.wait_for(state="attached")
        slider.scroll_into_view_if_needed()
        expect(slider).to_be_visible()
        explorer = page.locator(".widget-vbox:has(.widget-slider)").first
        explorer.locator(".js-plotly-plot g.cartesianlayer > g.subplot").first.wait_for(state="attached")
        subplots_before, status_before = _explorer_state(page)
        assert "on 4 ranks" in status_before, status_before

        # move the world-size slider one step to the right, from the keyboard
        handle = slider.locator(".noUi-handle").first
        handle.focus()
        handle.press("ArrowRight")
        expect(explorer.locator(".widget-html").first).to_contain_text("on 5 ranks")
        page.wait_for_function(
            """([count]) => {
                const box = [...document.querySelectorAll('.widget-vbox')].find(b => b.querySelector('.widget-slider'));
                const plot = box && box.querySelector('.js-plotly-plot');
                return plot && plot.querySelectorAll('g.cartesianlayer > g.subplot').length > count;
            }""", arg=[subplots_before])
        subplots_after, status_after = _explorer_state(page)
        assert subplots_after * 4 == subplots_before * 5, (subplots_before, subplots_after)

        _wait_for_idle_kernel(base_url, token)
        explorer.scroll_into_view_if_needed()
        page.screenshot(path=str(screenshot))
        cut = figures_cut_off_at_1024_px(page)
        assert not cut, f"lesson 01 at 1024 px: figures that do not fit: {cut}"
    assert screenshot.stat().st_size > 10_000
    assert NOTEBOOK.read_bytes() == before, "JupyterLab wrote into the repository's notebook"
    print(f"screenshot: {screenshot}")
    print(f"explorer: {subplots_before} subplots ({status_before}) -> {subplots_after} ({status_after})")
