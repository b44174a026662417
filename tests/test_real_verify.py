"""python -m real.verify: passes on gloo, fails when a wrong backward rule is injected, works under torchrun."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from real.verify import all_cases

pytestmark = pytest.mark.real

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _verify(args: list[str], tmp_path, *, torchrun: bool = False, env: dict | None = None):
    report = tmp_path / "verify.json"
    if torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "-m", "real.verify", "--backend", "gloo", "--json", str(report), *args]
    else:
        command = [sys.executable, "-m", "real.verify", "--nproc", "2", "--backend", "gloo",
                   "--json", str(report), *args]
    environment = {**os.environ, **(env or {})}
    environment.pop("SIMCOMM_VERIFY_FAULT", None) if env is None else None
    done = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=240)
    data = json.loads(report.read_text()) if report.exists() else None
    return done, data


@pytest.mark.timeout(260)
def test_verify_passes_every_case_on_gloo(tmp_path):
    done, data = _verify([], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert data["passed"] and data["world_size"] == 2 and data["backend"] == "gloo"
    assert [row["case"] for row in data["cases"]] == [case.name for case in all_cases()]
    assert all(row["passed"] and row["fwd_err"] <= 1e-9 for row in data["cases"])
    assert "max fwd err" in done.stdout and f"{len(data['cases'])}/{len(data['cases'])} cases passed" in done.stdout


@pytest.mark.timeout(260)
def test_verify_fails_with_an_injected_wrong_rule(tmp_path):
    cases = ["all_gather[dim=0]", "all_gather[dim=-1]", "all_reduce[sum]"]
    done, data = _verify(["--inject-fault", "all_gather_backward", "--cases", *cases], tmp_path)
    assert done.returncode != 0, done.stdout + done.stderr
    verdicts = {row["case"]: row["passed"] for row in data["cases"]}
    assert verdicts == {"all_gather[dim=0]": False, "all_gather[dim=-1]": False, "all_reduce[sum]": True}
    assert "FAIL" in done.stdout and not data["passed"]


@pytest.mark.timeout(260)
def test_verify_under_torchrun_and_its_fault_env_var(tmp_path):
    cases = ["all_reduce[max]", "reduce_scatter[dim=0,product]", "ulysses_attention", "2d_tp_x_dp[subgroups]"]
    done, data = _verify(["--cases", *cases], tmp_path, torchrun=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert data["passed"] and [row["case"] for row in data["cases"]] == cases
    done, data = _verify(["--cases", *cases], tmp_path, torchrun=True,
                         env={"SIMCOMM_VERIFY_FAULT": "all_reduce_backward"})
    assert done.returncode != 0
    assert {row["case"] for row in data["cases"] if not row["passed"]} == {"all_reduce[max]"}


def test_unknown_case_is_rejected(tmp_path):
    done = subprocess.run([sys.executable, "-m", "real.verify", "--cases", "no_such_case"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown case(s) ['no_such_case']" in done.stderr
