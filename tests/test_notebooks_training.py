"""Lessons 06-08 under nbval, once per backend (sim and real/gloo), like tests/test_notebooks.py.

The notebooks are jupytext-paired with ``notebooks/sources/NN_name.py``; a cell whose printed
text is deterministic holds it, line by line, in its ``expect`` metadata. The committed notebooks
hold no outputs, so each run works on a temporary copy whose checked cells carry the expected
text as stored output and the ``nbval-check-output`` tag; nbval (``--nbval-lax
--nbval-current-env``) compares them, and the ``assert`` statements in the cells are the checks.
Each run must finish within ``SIMCOMM_LESSON_BUDGET_S`` seconds (default 60), kernel start
included.
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
TRAINING = ("06_data_parallel", "07_zero_and_fsdp", "08_pipeline_parallel")
NOTEBOOKS = [NOTEBOOK_DIR / f"{name}.ipynb" for name in TRAINING if (NOTEBOOK_DIR / f"{name}.ipynb").exists()]
BUDGET_S = float(os.environ.get("SIMCOMM_LESSON_BUDGET_S", "60"))


def with_expected_outputs(notebook: Path, folder: Path) -> Path:
    """A copy of ``notebook`` in ``folder`` whose ``expect`` cells hold that text as stored output."""
    nb = json.loads(notebook.read_text())
    for index, cell in enumerate(nb["cells"]):
        expect = cell.get("metadata", {}).get("expect")
        if expect:
            cell["metadata"].setdefault("tags", []).append("nbval-check-output")
            cell["execution_count"] = index + 1
            cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "\n".join(expect) + "\n"}]
    copy = folder / notebook.name
    copy.write_text(json.dumps(nb, indent=1))
    return copy


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_stripped_and_paired(notebook: Path):
    import jupytext

    nb = json.loads(notebook.read_text())
    assert nb["metadata"].get("jupytext", {}).get("formats") == "ipynb,sources//py:percent"
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None
    paired = jupytext.read(NOTEBOOK_DIR / "sources" / f"{notebook.stem}.py")
    assert [(c["cell_type"], "".join(c["source"]), dict(c["metadata"])) for c in paired["cells"]] == \
           [(c["cell_type"], "".join(c["source"]), dict(c["metadata"])) for c in nb["cells"]]
    text = ["".join(c["source"]) for c in nb["cells"]]
    assert "**Goal:**" in text[0] and any(t.startswith("## Takeaway") for t in text[-2:])
    assert sum(t.startswith("## Exercise") for t in text) >= 2
    for cell in nb["cells"]:
        if "solution" in cell["metadata"].get("tags", []):
            assert cell["metadata"]["jupyter"]["source_hidden"] is True
            assert "".join(cell["source"]).startswith("# Solution")
            assert cell["metadata"]["expect"][-1].startswith("Correct")


def _real_unavailable() -> str | None:
    probe = ("import torch, real\n"
             "outs = real.run(lambda comm: comm.all_reduce(torch.ones(2)), world_size=2)\n"
             "assert all(o.tolist() == [2.0, 2.0] for o in outs)\n")
    try:
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=180, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return "real.run(world_size=2) did not finish within 180 s"
    return None if result.returncode == 0 else "real.run failed: " + result.stderr.strip()[-300:]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sim", pytest.param("real", marks=pytest.mark.real)])
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_lesson_runs(notebook: Path, backend: str, record_property, tmp_path: Path):
    if backend == "real":
        reason = _real_unavailable()
        if reason:
            pytest.skip(f"SIMCOMM_BACKEND=real: {reason}")
    copy = with_expected_outputs(notebook, tmp_path)
    env = dict(os.environ, SIMCOMM_BACKEND=backend, PYTHONDONTWRITEBYTECODE="1")
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
