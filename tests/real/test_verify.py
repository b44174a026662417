"""python -m real.verify: passes on gloo, fails when a wrong backward rule is injected, works under torchrun."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from real.verify import all_cases, chosen_fault, main

pytestmark = pytest.mark.real

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _verify(args: list[str], tmp_path, *, torchrun: bool = False, env: dict | None = None):
    report = tmp_path / "verify.json"
    if torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "-m", "real.verify", "--backend", "gloo", "--json", str(report), *args]
    else:
        command = [sys.executable, "-m", "real.verify", "--nproc", "2", "--backend", "gloo",
                   "--json", str(report), *args]
    environment = {k: v for k, v in os.environ.items() if k != "SIMCOMM_VERIFY_FAULT"}
    environment.update(env or {})
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
def test_verify_under_torchrun(tmp_path):
    cases = ["all_reduce[max]", "reduce_scatter[dim=0,product]", "ulysses_attention", "2d_tp_x_dp[subgroups]"]
    done, data = _verify(["--cases", *cases], tmp_path, torchrun=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert data["passed"] and [row["case"] for row in data["cases"]] == cases


def test_fault_from_flag_or_environment(monkeypatch):
    monkeypatch.delenv("SIMCOMM_VERIFY_FAULT", raising=False)
    assert chosen_fault(None) is None
    assert chosen_fault("all_gather_backward") == "all_gather_backward"
    monkeypatch.setenv("SIMCOMM_VERIFY_FAULT", "all_reduce_backward")
    assert chosen_fault(None) == "all_reduce_backward"
    with pytest.raises(SystemExit, match="unknown fault 'nope'"):
        chosen_fault("nope")


def test_unknown_case_is_rejected(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--cases", "no_such_case"])
    assert info.value.code == 2 and "unknown case(s) ['no_such_case']" in capsys.readouterr().err


@pytest.mark.timeout(260)
def test_verify_catches_a_wrong_broadcast_and_all_to_all_single_backward(tmp_path):
    cases = ["broadcast[src=last]", "all_to_all_single[uneven]", "reduce[dst=first,sum]"]
    for fault, failing in (("broadcast_backward", "broadcast[src=last]"),
                           ("all_to_all_single_backward", "all_to_all_single[uneven]")):
        done, data = _verify(["--inject-fault", fault, "--cases", *cases], tmp_path)
        assert done.returncode != 0, done.stdout + done.stderr
        verdicts = {row["case"]: row["passed"] for row in data["cases"]}
        assert verdicts == {case: case != failing for case in cases}, (fault, verdicts)


def test_faults_use_the_rules_seam_and_restore_it():
    from real.faults import FAULTS, injected
    from simcomm import autograd

    functions = {name: cls.__dict__["backward"] for name, cls in vars(autograd).items()
                 if isinstance(cls, type) and issubclass(cls, autograd.torch.autograd.Function)}
    before = dict(autograd.BACKWARD_RULES)
    for fault, (rule, wrong) in FAULTS.items():
        with injected(fault):
            assert autograd.BACKWARD_RULES[rule] is wrong
            assert {name: cls.__dict__["backward"] for name, cls in vars(autograd).items()
                    if isinstance(cls, type) and issubclass(cls, autograd.torch.autograd.Function)} == functions
        assert autograd.BACKWARD_RULES == before
