"""Python's warnings state per virtual rank (:mod:`simcomm.sim.rank_warnings`): each rank's
filters, ``catch_warnings`` records and registry of shown warnings are its own, as each torchrun
process's are. The oracle is torchrun: tests/scripts/rank_warnings.py prints what each rank saw,
written out here per rank for the fast tests and run under torchrun (gloo) in the slow one."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist

from simcomm import World
from simcomm.run import run_script
from tests.launchers import TORCHRUN, launch_ok
from tests.sim.test_run import tagged_lines

SCRIPT = Path(__file__).parents[1] / "scripts" / "rank_warnings.py"
ONCE = "UserWarning: shown once by each process"
EXPECTED = {0: ["rank 0 recorded ['first of rank 0', 'second of rank 0']", "rank 0 raised filtered on rank 0"],
            1: ["rank 1 recorded ['first of rank 1', 'second of rank 1']", "rank 1 passed"]}


def _printed(tagged: dict[int, list[str]]) -> tuple[dict[int, list[str]], dict[int, int]]:
    """Each rank's printed lines (stdout's) and how many times it showed the "default" warning."""
    printed = {rank: [line for line in found if line.startswith("rank ")] for rank, found in tagged.items()}
    shown = {rank: sum(ONCE in line for line in found) for rank, found in tagged.items()}
    return printed, shown


def _shown_on_stderr(message, category, filename, lineno, file=None, line=None):
    """A warning shown as Python shows it (pytest records warnings instead)."""
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def test_each_rank_records_filters_and_shows_its_own_warnings(capsys):
    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.simplefilter("default")
        warnings.showwarning = _shown_on_stderr
        result = run_script(SCRIPT, 2, [])
    out = capsys.readouterr()
    assert result.returncode == 0, result.summary() + out.err
    printed, shown = _printed(tagged_lines(out.out + out.err))
    assert printed == EXPECTED
    assert shown == {0: 1, 1: 1}


def _tell():
    warnings.warn("from a module every rank shares", UserWarning)   # this module's registry


def test_a_default_warning_from_a_shared_module_is_shown_once_by_each_rank(capsys):
    def program(comm):
        for _ in range(3):
            _tell()
            dist.barrier()

    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.simplefilter("default")
        warnings.showwarning = _shown_on_stderr
        World(3).run(program)
    assert capsys.readouterr().err.count("UserWarning: from a module every rank shares") == 3


def test_the_callers_warnings_state_is_as_before_the_run():
    filters, show, impl = warnings.filters, warnings.showwarning, warnings._showwarnmsg_impl
    before = list(filters)

    def program(comm):
        warnings.filterwarnings("ignore", message="rank's own")      # in place, into the live list
        if comm.rank == 0:
            warnings.showwarning = lambda *args, **kwargs: None
        dist.barrier()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            dist.barrier()
            warnings.warn(f"rank {comm.rank}")
        return [str(w.message) for w in seen], [f[0] for f in warnings.filters[:1]]

    assert World(2).run(program) == [([f"rank {rank}"], ["ignore"]) for rank in range(2)]
    World(1).run(lambda comm: warnings.simplefilter("error"))      # one rank, no handoff
    assert warnings.filters is filters and warnings.filters == before
    assert warnings.showwarning is show and warnings._showwarnmsg_impl is impl
    assert warnings._filters_mutated.__module__ == "_warnings" and warnings._showwarnmsg.__module__ == "warnings"


@pytest.mark.slow
@pytest.mark.real
@pytest.mark.skipif(not TORCHRUN.exists(), reason=f"no torchrun at {TORCHRUN}")
def test_the_script_prints_under_simcomm_run_what_it_prints_under_torchrun(tmp_path):
    outputs = []
    for launcher in ([sys.executable, "-m", "simcomm.run"], [str(TORCHRUN), "--standalone", "--tee", "3"]):
        text = launch_ok([*launcher, "--nproc-per-node", "2", str(SCRIPT)], tmp_path,
                         reference=launcher[0] == str(TORCHRUN), timeout=300)
        outputs.append(_printed(tagged_lines(text)))
    assert outputs[0] == outputs[1] == (EXPECTED, {0: 1, 1: 1})
