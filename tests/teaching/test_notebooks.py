"""The lessons are tests: nbval runs every notebook once per backend.

Each notebook runs in a fresh kernel with ``--nbval-lax --nbval-current-env``:
every cell must run without error, and the ``assert`` statements in the cells
are the checks. Cells whose printed text is deterministic hold that text, line
by line, in their ``expect`` metadata (``# %% expect=[...]`` in the paired
``notebooks/sources/*.py``); the committed notebooks hold no outputs, so each
run works on a temporary copy whose checked cells carry the expected text as
stored output and the ``nbval-check-output`` tag, and nbval compares them.

``SIMCOMM_BACKEND=sim`` runs the programs on virtual ranks in the kernel;
``SIMCOMM_BACKEND=real`` runs them on gloo worker processes through
``real.Cluster``; a lesson run with ``real`` must run at least one program on real
worker processes (``real.Cluster.run``, counted by an IPython startup file in the kernel), so
a lesson that ignores the variable fails. Each run's wall time, kernel start included, is printed and
recorded (``record_property("seconds")``), not asserted: the lessons are kept
well under a minute each, but a wall-time limit would fail on a loaded machine.

Also checked: every committed notebook is stripped (no outputs, execution
counts or widget state) and has the same cells (type, source, metadata) as its
jupytext-paired source ``notebooks/sources/NN_name.py``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from simcomm import handout

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
LESSONS = ("00_start_here", "01_collectives", "02_autograd_through_collectives",
           "03_ring_allreduce_and_cost", "04_tensor_parallel_mlp", "05_ulysses_sequence_parallel",
           "06_data_parallel", "07_zero_and_fsdp", "08_pipeline_parallel", "09_context_parallel",
           "10_expert_parallel", "11_debugging_distributed_programs", "12_a_transformer_in_3d",
           "13_activations_recomputation_mixed_precision", "14_a_small_llama_in_4d", "15_plan_a_cluster")



def test_every_lesson_exists():
    assert [nb.stem for nb in NOTEBOOKS] == list(LESSONS)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_stripped(notebook: Path):
    nb = json.loads(notebook.read_text())
    assert "widgets" not in nb.get("metadata", {}), f"{notebook.name} holds widget state"
    for index, cell in enumerate(nb["cells"]):
        where = f"{notebook.name} cell {index}"
        assert "widgets" not in cell.get("metadata", {}), f"{where} holds widget state"
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [], f"{where} holds outputs"
            assert cell.get("execution_count") is None, f"{where} holds an execution count"


#: the most lines a code cell of a lesson may have: helpers belong in simcomm.lessons.foundations
MAX_CELL_LINES = 25


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_lesson_has_goal_exercise_solution_takeaway_and_short_cells(notebook: Path):
    cells = json.loads(notebook.read_text())["cells"]
    text = ["".join(cell["source"]) for cell in cells]
    assert cells[0]["cell_type"] == "markdown" and "**Goal:**" in text[0], "the first cell states the goal"
    assert any(cell["cell_type"] == "markdown" and "## Exercise" in source for cell, source in zip(cells, text))
    assert any("solution" in cell["metadata"].get("tags", []) for cell in cells) or any(
        cell["cell_type"] == "markdown" and "<details>" in source for cell, source in zip(cells, text)), \
        "an exercise has a solution (a hidden solution cell, or a collapsed <details> block)"
    takeaway = [i for i, source in enumerate(text) if source.startswith("## Takeaway")]
    assert takeaway and takeaway[0] >= len(cells) - 2, "the takeaway ends the lesson"
    assert "from simcomm" in text[1] or "from simcomm" in text[2], "the lesson imports its helpers from simcomm"
    long_cells = [(i, len(source.splitlines())) for i, (cell, source) in enumerate(zip(cells, text))
                  if cell["cell_type"] == "code" and len(source.splitlines()) > MAX_CELL_LINES]
    assert not long_cells, f"code cells longer than {MAX_CELL_LINES} lines (index, lines): {long_cells}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_solutions_do_not_run_on_run_all_and_open_on_request(notebook: Path):
    """A solution is a Markdown cell: one collapsed ``<details>`` block around one ``python`` block whose
    first line gives nothing away. Run All executes no solution (no code cell is tagged ``solution``);
    the nbval runs below turn each one into code (``handout.solutions_as_code``) and check it says
    Correct, on both backends."""
    cells = json.loads(notebook.read_text())["cells"]
    solutions = [cell for cell in cells if handout.is_solution(cell)]
    assert solutions
    for cell in solutions:
        source = "".join(cell["source"])
        assert cell["cell_type"] == "markdown", "Run All would execute a solution in a code cell"
        assert source.startswith("<details><summary>") and source.rstrip().endswith("</details>"), source[:80]
        code = handout.solution_code(cell)
        assert code.splitlines()[0].startswith("# Solution"), code.splitlines()[0]
        assert "Correct" not in source.split("```python")[0], "the summary line gives the answer away"
        assert "expect_error" not in code, "tests of the checkers belong in tests/teaching/test_lessons_*.py"
        assert cell["metadata"].get("expect", [""])[-1].startswith("Correct"), "a solution's check says Correct"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_exercise_cells_print_no_hint_before_it_is_asked_for(notebook: Path):
    """What Run All prints under an exercise is the checker's first answer: the problem, never the fix."""
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] == "code" and not handout.is_solution(cell):
            assert "show_hint=True" not in "".join(cell["source"]), "a cell asks for the hint on Run All"
            assert not any("Hint:" in line for line in cell["metadata"].get("expect", []))


SOURCES = NOTEBOOK_DIR / "sources"
PAIRING = "ipynb,sources//py:percent"


def _cells(nb) -> list[tuple[str, str, dict]]:
    return [(cell["cell_type"], "".join(cell["source"]), dict(cell.get("metadata", {}))) for cell in nb["cells"]]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_matches_its_paired_source(notebook: Path):
    import jupytext

    source = SOURCES / f"{notebook.stem}.py"
    assert source.exists(), f"{source} is missing: run jupytext --sync notebooks/{notebook.name}"
    nb = json.loads(notebook.read_text())
    assert nb["metadata"].get("jupytext", {}).get("formats") == PAIRING, f"{notebook.name} is not paired"
    paired = jupytext.read(source)
    assert _cells(paired) == _cells(nb), (f"{notebook.name} and {source.name} differ: run "
                                          f"jupytext --sync notebooks/{notebook.name} (the newer file wins)")


def expected_outputs(notebook: Path) -> dict[int, str]:
    """``{cell index: text}`` for every code cell with ``expect`` metadata."""
    cells = json.loads(notebook.read_text())["cells"]
    return {index: "\n".join(cell["metadata"]["expect"]) + "\n" for index, cell in enumerate(cells)
            if "expect" in cell.get("metadata", {})}


def with_expected_outputs(notebook: Path, folder: Path) -> tuple[Path, int]:
    """Copy ``notebook`` into ``folder``, its solutions turned into code cells where they stand, with its
    checked cells' expected text as stored output."""
    nb = json.loads(notebook.read_text())
    nb["cells"] = handout.solutions_as_code(nb["cells"])
    expected = expected_outputs(notebook)
    for index, cell in enumerate(nb["cells"]):
        if index in expected:
            cell["metadata"].setdefault("tags", []).append("nbval-check-output")
            cell["execution_count"] = index + 1  # nbval compares only cells that were run
            cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": expected[index]}]
    copy = folder / notebook.name
    copy.write_text(json.dumps(nb, indent=1))
    return copy, len(expected)


def test_checked_cells_get_their_expected_text(tmp_path: Path):
    checked = 0
    for notebook in NOTEBOOKS:
        copy, count = with_expected_outputs(notebook, tmp_path)
        cells = json.loads(copy.read_text())["cells"]
        tagged = [c for c in cells if "nbval-check-output" in c["metadata"].get("tags", [])]
        assert len(tagged) == count
        assert all(c["outputs"][0]["text"].endswith("\n") for c in tagged)
        checked += count
    assert checked >= len(LESSONS), "every lesson should check at least one printed result"


#: an IPython startup file for the lesson's kernel: appends the world size of every program that
#: ``real.Cluster.run`` ran to completion to the file ``SIMCOMM_TEST_CLUSTER_RUNS`` names
_RECORD_CLUSTER_RUNS = """\
import os
import real

def _recorded(run, path=os.environ["SIMCOMM_TEST_CLUSTER_RUNS"]):
    def recorded_run(self, *args, **kwargs):
        results = run(self, *args, **kwargs)
        with open(path, "a") as out:
            out.write(f"{self.world_size}\\n")
        return results
    return recorded_run

real.Cluster.run = _recorded(real.Cluster.run)
"""


def _run_nbval(notebook: Path, backend: str, folder: Path) -> tuple[subprocess.CompletedProcess, float]:
    notebook, _ = with_expected_outputs(notebook, folder)
    env = dict(os.environ, SIMCOMM_BACKEND=backend, PYTHONDONTWRITEBYTECODE="1")
    if backend == "real":        # count the programs the lesson runs on real worker processes
        startup = folder / "ipython" / "profile_default" / "startup"
        startup.mkdir(parents=True)
        (startup / "00_record_cluster_runs.py").write_text(_RECORD_CLUSTER_RUNS)
        env.update(IPYTHONDIR=str(folder / "ipython"), SIMCOMM_TEST_CLUSTER_RUNS=str(folder / "cluster_runs"))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
               "--nbval-current-env", "--nbval-cell-timeout=300", str(notebook)]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    return result, time.perf_counter() - start


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sim", pytest.param("real", marks=pytest.mark.real)])
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_lesson_runs(notebook: Path, backend: str, record_property, tmp_path: Path):
    result, seconds = _run_nbval(notebook, backend, tmp_path)
    record_property("seconds", round(seconds, 1))
    print(f"{notebook.stem} [SIMCOMM_BACKEND={backend}]: {seconds:.1f} s")
    if result.returncode != 0:
        pytest.fail(f"nbval failed on {notebook.name} with SIMCOMM_BACKEND={backend}:\n"
                    + result.stdout[-8000:] + result.stderr[-2000:], pytrace=False)
    if backend == "real":
        runs = (tmp_path / "cluster_runs").read_text().split() if (tmp_path / "cluster_runs").exists() else []
        print(f"{notebook.stem}: {len(runs)} programs on real.Cluster workers (world sizes {sorted(set(runs))})")
        assert runs, (f"{notebook.name} with SIMCOMM_BACKEND=real ran no program on real worker processes "
                      "(real.Cluster.run): it must run on the backend configured_backend() returns")
