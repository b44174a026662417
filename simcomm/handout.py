"""A workshop handout: every lesson executed and written as a static web site.

    python -m simcomm.handout OUT_DIR            # all lessons, the learner's edition
    python -m simcomm.handout OUT_DIR 03 04      # only lessons whose names start so
    python -m simcomm.handout --edition instructor OUT_DIR   # with every solution, run and marked

Two editions. The **learner** edition holds no solution: the lesson's
solution cells (Markdown cells tagged ``solution``, each a collapsed
``<details>`` block around one fenced ``python`` block, so that Run All in
JupyterLab never executes them) are left out. The **instructor** edition
turns each solution into a code cell, runs it where it stands, and marks it
with a banner; its index page says which edition it is.

writes ``OUT_DIR/index.html`` (each lesson's title and goal, linked) and one
``OUT_DIR/NN_name.html`` per lesson. Each page is the lesson run top to bottom
in a fresh kernel and exported by nbconvert; the figures are there because
:mod:`simcomm.viz.render` gives each one an HTML form. plotly.js is inlined
once per page, so every figure is interactive and the ring animation plays
with no kernel and no network (the template's own CDN links, require.js and
MathJax, are not needed by any figure). Links from one lesson to the next
point to the pages. A widget needs a kernel: a page shows the static fallback a
widget's display offers (``text/html``, e.g. lesson 06's bucket slider shows the
figure of its default size), or a note saying the widget needs a running kernel
(lesson 01's explorer); no page loads a widget manager from the network.

The lessons run on the backend ``SIMCOMM_BACKEND`` names (the simulator when
unset). Nothing is written outside ``OUT_DIR``.
"""
from __future__ import annotations

import argparse
import html
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

__all__ = ["NOTEBOOK_DIR", "EDITIONS", "SOLUTION_TAG", "Page", "is_solution", "solution_code",
           "solutions_as_code", "without_solutions", "static_outputs", "WIDGET_NOTE", "lesson_notebooks", "build_page",
           "build_handout", "main"]

#: the lessons, as the repository holds them
NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"

#: the handout's editions: without solutions, and with them run and marked
EDITIONS = ("learner", "instructor")
#: the tag of a lesson's solution cells
SOLUTION_TAG = "solution"
#: what marks a solution in the instructor's edition
INSTRUCTOR_BANNER = "**Instructor's edition: the solution** (the learner's edition leaves it out)"

_SOLUTION_BLOCK = re.compile(r"^```python\n(.*?)\n```$", re.S | re.M)
_LESSON_LINK = re.compile(r'href="(\d\d_[A-Za-z0-9_]+)\.ipynb(#[^"]*)?"')
_PLOTLY_MIME = "application/vnd.plotly.v1+json"
_WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
#: what a page shows for a widget that offers no static fallback
WIDGET_NOTE = ("<p><em>An interactive widget was here: it needs a running kernel. Open the lesson in "
               "JupyterLab to use it.</em></p>")


@dataclass(frozen=True)
class Page:
    """One written lesson page: its file, title, goal and how many figures it holds."""

    path: Path
    title: str
    goal: str
    figures: int


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def is_solution(cell: dict) -> bool:
    """True for a lesson's solution cell (tagged :data:`SOLUTION_TAG`)."""
    return SOLUTION_TAG in cell.get("metadata", {}).get("tags", [])


def solution_code(cell: dict) -> str:
    """The code of a solution cell: its one fenced ``python`` block. Raises ``ValueError`` naming the
    cell's first line if it has none, or if the cell is a code cell (Run All would execute it)."""
    source = _source(cell)
    first = source.splitlines()[0] if source else ""
    if cell.get("cell_type") != "markdown":
        raise ValueError(f"handout.solution_code: the solution cell starting {first!r} is a "
                         f"{cell.get('cell_type')} cell; make it Markdown so Run All does not execute it")
    blocks = _SOLUTION_BLOCK.findall(source)
    if len(blocks) != 1:
        raise ValueError(f"handout.solution_code: the solution cell starting {first!r} holds {len(blocks)} "
                         "```python blocks; it must hold exactly one")
    return blocks[0]


def solutions_as_code(cells: list[dict]) -> list[dict]:
    """A copy of ``cells`` with every solution cell turned into a code cell holding its code (same
    metadata, no outputs): what the tests and the instructor's edition run. The input is not modified."""
    out = []
    for cell in cells:
        if is_solution(cell):
            cell = {"cell_type": "code", "execution_count": None, "id": cell.get("id", "solution"),
                    "metadata": dict(cell.get("metadata", {})), "outputs": [], "source": solution_code(cell)}
        out.append(cell)
    return out


def without_solutions(cells: list[dict]) -> list[dict]:
    """``cells`` without the solution cells (the learner's edition)."""
    return [cell for cell in cells if not is_solution(cell)]


def _edition(nb: nbformat.NotebookNode, edition: str) -> nbformat.NotebookNode:
    if edition not in EDITIONS:
        raise ValueError(f"handout: edition={edition!r}; use one of {list(EDITIONS)}")
    if edition == "learner":
        cells = without_solutions(nb.cells)
    else:
        cells = []
        for cell in solutions_as_code(nb.cells):
            if is_solution(cell):
                cells.append(nbformat.v4.new_markdown_cell(INSTRUCTOR_BANNER))
            cells.append(cell)
    nb.cells = [nbformat.from_dict(cell) for cell in cells]
    for index, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{index}"
    return nb


def lesson_notebooks(prefixes: list[str] | None = None, folder: Path = NOTEBOOK_DIR) -> list[Path]:
    """The lesson notebooks in order, only those whose names start with one of ``prefixes`` if given."""
    notebooks = sorted(folder.glob("[0-9][0-9]_*.ipynb"))
    if prefixes:
        notebooks = [nb for nb in notebooks if any(nb.stem.startswith(prefix) for prefix in prefixes)]
        if not notebooks:
            raise ValueError(f"handout: no lesson in {folder} starts with any of {prefixes}")
    return notebooks


def _title_and_goal(nb: nbformat.NotebookNode) -> tuple[str, str]:
    text = "".join(nb.cells[0].source) if nb.cells else ""
    title = next((line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("# ")), "")
    goal = re.search(r"\*\*Goal:\*\*(.*?)(\n\n|$)", text, re.S)
    return title, " ".join(goal.group(1).split()) if goal else ""


def static_outputs(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """``nb`` as a static page shows it (modified in place and returned): every widget output keeps
    only its static fallback (``text/html``) if its display offered one, and is otherwise replaced by
    :data:`WIDGET_NOTE`; the notebook's saved widget state is dropped, so the page neither needs a
    widget manager nor loads one from the network."""
    for cell in nb.cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            data = output.get("data", {})
            if _WIDGET_MIME not in data:
                continue
            del data[_WIDGET_MIME]
            if "text/html" not in data:
                data["text/html"] = WIDGET_NOTE
    nb.metadata.pop("widgets", None)
    return nb


def _figure_count(nb: nbformat.NotebookNode) -> int:
    """Figures the page will draw: plotly outputs, and widget outputs whose static fallback draws one
    (counted before :func:`static_outputs`)."""
    def draws(data: dict) -> bool:
        return _PLOTLY_MIME in data or _WIDGET_MIME in data and "Plotly.newPlot(" in data.get("text/html", "")
    return sum(1 for cell in nb.cells if cell.cell_type == "code"
               for output in cell.get("outputs", []) if draws(output.get("data", {})))


def build_page(notebook: Path, out_dir: Path, *, edition: str = "learner", timeout: int = 600) -> Page:
    """Execute ``notebook``'s ``edition`` in a fresh kernel (working directory: its folder) and write
    its page."""
    from nbconvert import HTMLExporter
    from nbconvert.preprocessors import ExecutePreprocessor

    nb = _edition(nbformat.read(notebook, as_version=4), edition)
    ExecutePreprocessor(timeout=timeout, kernel_name="python3").preprocess(
        nb, {"metadata": {"path": str(notebook.parent)}})
    figures = _figure_count(nb)
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(static_outputs(nb))
    body = _LESSON_LINK.sub(lambda m: f'href="{m.group(1)}.html{m.group(2) or ""}"', body)
    path = out_dir / f"{notebook.stem}.html"
    path.write_text(body, encoding="utf-8")
    title, goal = _title_and_goal(nb)
    return Page(path, title or notebook.stem, goal, figures)


def _index(pages: list[Page], edition: str) -> str:
    items = "\n".join(
        f'<li><a href="{page.path.name}">{html.escape(page.title)}</a>'
        f"<p>{html.escape(page.goal)}</p></li>" for page in pages)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<title>simcomm lessons</title><style>body{font:18px/1.5 sans-serif;max-width:50em;"
            "margin:2em auto;padding:0 1em}li{margin-bottom:1em}p{margin:.2em 0}</style></head>\n"
            "<body><h1>simcomm: differentiable collectives, lesson by lesson</h1>\n"
            + ("<p><strong>Instructor's edition:</strong> every exercise's solution is shown and run, marked "
               "as such. Give learners the learner's edition.</p>\n" if edition == "instructor" else
               "<p>Learner's edition: the exercises' solutions are not included.</p>\n") +
            "<p>Every lesson below was run from top to bottom; its figures are interactive "
            "(hover, zoom, play) and need neither a kernel nor a network.</p>\n"
            f"<ol>\n{items}\n</ol></body></html>\n")


def build_handout(out_dir: str | Path, prefixes: list[str] | None = None, *, edition: str = "learner",
                  folder: Path = NOTEBOOK_DIR, timeout: int = 600) -> list[Page]:
    """Write ``index.html`` and one page per lesson of ``edition`` (:data:`EDITIONS`) into ``out_dir``
    (created if missing). Raises ``ValueError`` for an unknown edition.

    Raises the kernel's error (nbconvert's ``CellExecutionError``) if a lesson
    fails to run; pages written before it stay.
    """
    if edition not in EDITIONS:
        raise ValueError(f"handout: edition={edition!r}; use one of {list(EDITIONS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pages = [build_page(notebook, out_dir, edition=edition, timeout=timeout)
             for notebook in lesson_notebooks(prefixes, folder)]
    (out_dir / "index.html").write_text(_index(pages, edition), encoding="utf-8")
    return pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simcomm.handout", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder to write index.html and the lesson pages into")
    parser.add_argument("lessons", nargs="*", help="only lessons whose names start so (e.g. 03)")
    parser.add_argument("--edition", choices=EDITIONS, default="learner",
                        help="learner: no solutions (the default); instructor: solutions run and marked")
    args = parser.parse_args(argv)
    pages = build_handout(args.out_dir, args.lessons or None, edition=args.edition)
    for page in pages:
        sys.stdout.write(f"{page.path}: {page.figures} figures\n")
    sys.stdout.write(f"{args.out_dir / 'index.html'}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
