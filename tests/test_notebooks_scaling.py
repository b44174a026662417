"""Lessons 09-12 are tests: nbval runs each once per backend, within the time budget.

The same rules as ``tests/test_notebooks.py`` for lessons 00-05, for these four notebooks:
every committed notebook is stripped, paired with its jupytext source
``notebooks/sources/NN_name.py`` (same cells), states its goal, has exercises with hidden
solutions that check Correct, short cells and a closing takeaway; nbval
(``--nbval-lax --nbval-current-env``) runs it in a fresh kernel with
``SIMCOMM_BACKEND=sim`` and ``=real``, comparing the printed text of the cells that hold an
``expect`` list in their metadata; each run must finish within ``SIMCOMM_LESSON_BUDGET_S``
seconds (default 60), kernel start included.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
LESSONS = ("09_context_parallel", "10_expert_parallel", "11_debugging_distributed_programs",
           "12_a_transformer_in_3d")
NOTEBOOKS = [NOTEBOOK_DIR / f"{name}.ipynb" for name in LESSONS if (NOTEBOOK_DIR / f"{name}.ipynb").exists()]
BUDGET_S = float(os.environ.get("SIMCOMM_LESSON_BUDGET_S", "60"))
MAX_CELL_LINES = 25
PAIRING = "ipynb,sources//py:percent"


def test_every_lesson_exists():
    assert [nb.stem for nb in NOTEBOOKS] == list(LESSONS)


def _cells(nb) -> list[tuple[str, str, dict]]:
    return [(cell["cell_type"], "".join(cell["source"]), dict(cell.get("metadata", {}))) for cell in nb["cells"]]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stripped_and_matches_its_paired_source(notebook: Path):
    import jupytext

    nb = json.loads(notebook.read_text())
    assert "widgets" not in nb.get("metadata", {})
    for index, cell in enumerate(nb["cells"]):
        assert "widgets" not in cell.get("metadata", {}), f"cell {index} holds widget state"
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, f"cell {index} holds outputs"
    assert nb["metadata"].get("jupytext", {}).get("formats") == PAIRING
    source = NOTEBOOK_DIR / "sources" / f"{notebook.stem}.py"
    assert _cells(jupytext.read(source)) == _cells(nb), f"run python notebooks/sync.py {notebook.stem[:2]}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_lesson_shape(notebook: Path):
    cells = json.loads(notebook.read_text())["cells"]
    text = ["".join(cell["source"]) for cell in cells]
    assert cells[0]["cell_type"] == "markdown" and "**Goal:**" in text[0]
    assert sum(cell["cell_type"] == "markdown" and "## Exercise" in source for cell, source in zip(cells, text)) >= 2
    solutions = [cell for cell in cells if "solution" in cell["metadata"].get("tags", [])]
    assert len(solutions) >= 2
    for cell in solutions:
        source = "".join(cell["source"])
        assert cell["metadata"].get("jupyter", {}).get("source_hidden") is True
        assert source.splitlines()[0].startswith("# Solution")
        assert cell["metadata"].get("expect", [""])[-1].startswith("Correct")
    takeaway = [i for i, source in enumerate(text) if source.startswith("## Takeaway")]
    assert takeaway and takeaway[0] >= len(cells) - 2
    assert "from simcomm import" in text[1]
    long_cells = [(i, len(s.splitlines())) for i, (c, s) in enumerate(zip(cells, text))
                  if c["cell_type"] == "code" and len(s.splitlines()) > MAX_CELL_LINES]
    assert not long_cells, long_cells


def with_expected_outputs(notebook: Path, folder: Path) -> Path:
    """Copy ``notebook`` into ``folder`` with its checked cells' expected text as stored output."""
    nb = json.loads(notebook.read_text())
    for index, cell in enumerate(nb["cells"]):
        if "expect" in cell.get("metadata", {}):
            cell["metadata"].setdefault("tags", []).append("nbval-check-output")
            cell["execution_count"] = index + 1
            cell["outputs"] = [{"output_type": "stream", "name": "stdout",
                                "text": "\n".join(cell["metadata"]["expect"]) + "\n"}]
    copy = folder / notebook.name
    copy.write_text(json.dumps(nb, indent=1))
    return copy


def _real_unavailable() -> str | None:
    probe = ("import torch, real\n"
             "outs = real.run(lambda comm: comm.all_reduce(torch.ones(2) * (comm.rank + 1)), world_size=2)\n"
             "assert all(o.tolist() == [3.0, 3.0] for o in outs), outs\n")
    try:
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=180, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return "real.run(world_size=2) did not finish within 180 s"
    if result.returncode != 0:
        return "real.run(world_size=2) failed: " + (result.stderr.strip().splitlines() or ["?"])[-1]
    return None


@pytest.fixture(scope="module")
def real_unavailable() -> str | None:
    return _real_unavailable()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sim", pytest.param("real", marks=pytest.mark.real)])
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_lesson_runs(notebook: Path, backend: str, real_unavailable: str | None, record_property, tmp_path: Path):
    if backend == "real" and real_unavailable:
        pytest.skip(f"SIMCOMM_BACKEND=real: {real_unavailable}")
    copy = with_expected_outputs(notebook, tmp_path)
    path = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env = dict(os.environ, SIMCOMM_BACKEND=backend, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=path)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
               "--nbval-current-env", "--nbval-cell-timeout=300", str(copy)]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    seconds = time.perf_counter() - start
    record_property("seconds", round(seconds, 1))
    print(f"{notebook.stem} [SIMCOMM_BACKEND={backend}]: {seconds:.1f} s")
    if result.returncode != 0:
        pytest.fail(f"nbval failed on {notebook.name} with SIMCOMM_BACKEND={backend}:\n"
                    + result.stdout[-8000:] + result.stderr[-2000:], pytrace=False)
    assert seconds < BUDGET_S, f"{notebook.name} took {seconds:.1f} s with SIMCOMM_BACKEND={backend}"
