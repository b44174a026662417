"""Write each lesson notebook from its jupytext source: ``python notebooks/sync.py 09 10``.

The notebook is paired (``ipynb,sources//py:percent``), stripped of outputs and execution
counts, and its cell ids are ``NN-000``, ``NN-001``, ... so that rebuilding it changes nothing.
"""
from __future__ import annotations

import sys
from pathlib import Path

import jupytext

HERE = Path(__file__).resolve().parent


def sync(prefix: str) -> Path:
    (source,) = sorted((HERE / "sources").glob(f"{prefix}_*.py"))
    nb = jupytext.read(source)
    nb.metadata["jupytext"] = {"formats": "ipynb,sources//py:percent"}
    for index, cell in enumerate(nb.cells):
        cell.id = f"{prefix}-{index:03d}"
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    target = HERE / f"{source.stem}.ipynb"
    jupytext.write(nb, target, fmt="ipynb")
    return target


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(sync(name))
