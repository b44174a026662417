"""What each process of a torchrun run has to itself, on virtual ranks: each behaviour is a script
in tests/scripts/ run with ``simcomm.run`` (fast tier, in this process) and with ``torchrun`` on two
gloo processes (slow tier), and both must give the same outcome (docs/torchrun.md's table)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from simcomm.fresh_state import DEFAULT_RUN_SEED, SEED_VARIABLE
from simcomm.run import run_script

SCRIPTS = Path(__file__).parents[1] / "scripts"
ROOT = Path(__file__).parents[2]
_LINE = re.compile(r"(?:\[rank \d+\]:?\s*)?rank(\d+): (.*)")


def report(text: str) -> dict[int, str]:
    """Each rank's ``rankN: ...`` line, tagged (simcomm.run) or not (torchrun)."""
    lines = {}
    for raw in text.splitlines():
        match = _LINE.search(raw)
        if match:
            lines[int(match.group(1))] = match.group(2)
    return lines


def fields(line: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in line.split() if "=" in item and not item.startswith("draws"))


def on_virtual_ranks(script: str, capsys, nproc: int = 2, *args: str):
    result = run_script(SCRIPTS / script, nproc, list(args))
    out = capsys.readouterr()
    return result, report(out.out + out.err)


def under_torchrun(script: str, nproc: int = 2, *args: str, cwd: Path | None = None, env: dict | None = None):
    """The script under ``torchrun --standalone`` on ``nproc`` gloo processes."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), str(SCRIPTS / script), *args], capture_output=True, text=True,
                          timeout=240, cwd=cwd or ROOT, env=environment)
    return done, report(done.stdout + done.stderr)


torchrun = pytest.mark.slow


# -- unseeded random numbers ----------------------------------------------------------------------

def test_unseeded_ranks_draw_different_numbers_from_their_own_seeds(capsys, monkeypatch):
    monkeypatch.delenv(SEED_VARIABLE, raising=False)
    result, lines = on_virtual_ranks("unseeded_draws.py", capsys)
    assert result.returncode == 0, result.summary()
    for rank in range(2):
        got = fields(lines[rank])
        assert got == {"torch_differ": "True", "python_differ": "True", "numpy_differ": "True",
                       "seed": str(DEFAULT_RUN_SEED + rank)}, lines
    assert lines == on_virtual_ranks("unseeded_draws.py", capsys)[1]       # the same in every run
    monkeypatch.setenv(SEED_VARIABLE, "7")
    seeded = on_virtual_ranks("unseeded_draws.py", capsys)[1]
    assert [fields(seeded[rank])["seed"] for rank in range(2)] == ["7", "8"]
    draws = torch.tensor(eval(seeded[1].split("draws=")[1]), dtype=torch.float64)
    assert draws[0].item() == torch.rand(1, generator=torch.Generator().manual_seed(8)).item()


@torchrun
def test_unseeded_ranks_draw_different_numbers_under_torchrun():
    done, lines = under_torchrun("unseeded_draws.py")
    assert done.returncode == 0, done.stderr[-2000:]
    assert all(fields(lines[rank])["torch_differ"] == fields(lines[rank])["python_differ"] ==
               fields(lines[rank])["numpy_differ"] == "True" for rank in range(2)), lines
