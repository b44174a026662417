"""Build the lesson notebooks from their sources in ``notebooks/src/``.

Each lesson is written as a plain Python file in the "percent" format, so it
diffs and reviews like code::

    # %% [markdown]
    # # A title
    # Some text.

    # %%
    outs = world.run(program)

    # %% solution
    print(lessons.check_...(my_answer))

    # %% expect
    # Correct: ...

Cell markers:

* ``# %%`` a code cell; ``# %% [markdown]`` a markdown cell (lines start with ``# ``);
* ``# %% solution``: a code cell JupyterLab shows collapsed, for an exercise's answer;
* ``# %% ignore-output``: a code cell whose output differs run to run (widgets,
  plotly ids); tagged ``nbval-ignore-output``;
* ``# %% expect``: not a cell, but the exact text the code cell above prints.
  The committed notebook stays without outputs; ``tests/test_notebooks.py``
  puts this text into a temporary copy as the cell's stored output, tags the
  cell ``nbval-check-output``, and nbval compares it.

    python notebooks/build.py            # write notebooks/NN_name.ipynb, outputs empty
    python notebooks/build.py --check    # exit 1 if a notebook differs from its source

The notebooks are written without outputs, execution counts or widget state,
as they are committed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "src"

_KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


class Cell:
    """One cell of a source: ``kind`` is ``"code"`` or ``"markdown"``."""

    def __init__(self, kind: str, tag: str = ""):
        self.kind = kind
        self.tag = tag
        self.lines: list[str] = []
        self.expect: list[str] | None = None

    @property
    def source(self) -> str:
        lines = [_unquote(line) for line in self.lines] if self.kind == "markdown" else self.lines
        return "\n".join(lines).strip("\n")

    @property
    def expected(self) -> str | None:
        """The text the cell prints, as written in its ``# %% expect`` block."""
        if self.expect is None:
            return None
        return "\n".join(_unquote(line) for line in self.expect).strip("\n") + "\n"


def parse(text: str) -> list[Cell]:
    """Split a percent-format source into its cells (empty ones dropped)."""
    cells: list[Cell] = []
    target_lines: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("# %%"):
            marker = line[4:].strip()
            if marker == "[markdown]":
                cells.append(Cell("markdown"))
            elif marker in ("", "solution", "ignore-output"):
                cells.append(Cell("code", marker))
            elif marker == "expect":
                code = [c for c in cells if c.source]
                if not code or code[-1].kind != "code" or code[-1].expect is not None:
                    raise ValueError("'# %% expect' must follow a code cell, once")
                code[-1].expect = []
                target_lines = code[-1].expect
                continue
            else:
                raise ValueError(f"unknown cell marker {line!r}")
            target_lines = cells[-1].lines
        elif target_lines is not None:
            target_lines.append(line)
        elif line.strip() and not line.startswith('"""') and not line.startswith("#"):
            raise ValueError(f"text before the first cell marker: {line!r}")
    return [cell for cell in cells if cell.source]


def _unquote(line: str) -> str:
    if line.startswith("# "):
        return line[2:]
    if line.rstrip() in ("#", ""):
        return ""
    raise ValueError(f"markdown and expect lines must start with '# ': {line!r}")


def cell_id(source: Path, index: int) -> str:
    return f"{source.stem[:2]}-{index:03d}"  # stable ids keep diffs small


def build(source: Path) -> nbformat.NotebookNode:
    """The notebook for one percent-format source file."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": dict(_KERNELSPEC),
                   "language_info": {"name": "python"}}
    for index, cell in enumerate(parse(source.read_text())):
        if cell.kind == "markdown":
            new = nbformat.v4.new_markdown_cell(cell.source)
        else:
            new = nbformat.v4.new_code_cell(cell.source)
            if cell.tag == "solution":
                new.metadata = {"jupyter": {"source_hidden": True}, "tags": ["solution"]}
            elif cell.tag == "ignore-output":
                new.metadata = {"tags": ["nbval-ignore-output"]}
        new.id = cell_id(source, index)
        nb.cells.append(new)
    nbformat.validate(nb)
    return nb


def expected_outputs(source: Path) -> dict[str, str]:
    """``{cell id: text}`` for every code cell of ``source`` with an ``# %% expect`` block."""
    return {cell_id(source, index): cell.expected
            for index, cell in enumerate(parse(source.read_text())) if cell.expected is not None}


def source_of(notebook: Path) -> Path:
    return SOURCES / f"{notebook.stem}.py"


def target(source: Path) -> Path:
    return HERE / f"{source.stem}.ipynb"


def render(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    args = parser.parse_args(argv)
    stale = []
    for source in sorted(SOURCES.glob("[0-9][0-9]_*.py")):
        text = render(build(source))
        path = target(source)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        print("out of date (run python notebooks/build.py):", ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
