"""Per-rank modules (:mod:`simcomm.sim.rank_modules`): a library's process-global state is per
rank on virtual ranks, as it is per process under torchrun.

The oracle is torchrun: each script in tests/scripts prints what its library's state says on
each rank; the fast tests compare with what each torchrun process prints (its own rank's
state, written out here per rank), the slow tests run the same script under torchrun (gloo).
"""
from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest
import torch

from simcomm import World
from simcomm.run import run_script
from simcomm.sim.rank_modules import RankModules, _is_python_code

SCRIPTS = Path(__file__).parents[1] / "scripts"
SIBLINGS = ("borg_state_lib", "process_group_manager", "rank_log", "registers_op_lib")


def lines(text: str) -> dict[int, list[str]]:
    """Each rank's tagged lines, ``[rank r] line`` (simcomm.run) or ``[defaultr]:line`` (torchrun)."""
    from tests.sim.test_run import tagged_lines
    return tagged_lines(text)


def run(script: str, nproc: int, capsys, *args: str, **kwargs) -> dict[int, list[str]]:
    for name in SIBLINGS:
        assert name not in sys.modules    # imported by the test process, it would be shared
    result = run_script(SCRIPTS / script, nproc, list(args), **kwargs)
    out = capsys.readouterr()
    assert result.returncode == 0, result.summary() + out.err
    for name in SIBLINGS:
        assert name not in sys.modules, name     # the run's modules leave with it
    return lines(out.out + out.err)


BORG = {rank: [f"process_index={rank} num_processes=2 main={rank == 0} steps=3 created=['first@{rank}'] "
               f"sum=3.0"] for rank in range(2)}
GRID = {0: ["rank=0 tp_rank=0 dp_rank=0 tp_ranks=[0, 1] dp_ranks=[0, 2] tp_sum=1 dp_sum=2"],
        1: ["rank=1 tp_rank=1 dp_rank=0 tp_ranks=[0, 1] dp_ranks=[1, 3] tp_sum=1 dp_sum=4"],
        2: ["rank=2 tp_rank=0 dp_rank=1 tp_ranks=[2, 3] dp_ranks=[0, 2] tp_sum=5 dp_sum=2"],
        3: ["rank=3 tp_rank=1 dp_rank=1 tp_ranks=[2, 3] dp_ranks=[1, 3] tp_sum=5 dp_sum=4"]}
LOG = {rank: [f"[train rank {rank}] sum=3 configured_for={rank}"] for rank in range(2)}


def test_a_borg_pattern_library_has_its_own_shared_dict_on_each_rank(capsys):
    assert run("borg_state.py", 2, capsys) == BORG


def test_a_process_group_manager_module_global_is_per_rank_through_every_import_form(capsys):
    assert run("pgm_grid.py", 4, capsys) == GRID


def test_a_logger_configured_by_rank_logs_each_ranks_own_rank(capsys):
    assert run("rank_log_script.py", 2, capsys) == LOG


def test_per_rank_modules_on_shape_only_ranks(capsys):
    assert run("borg_state.py", 2, capsys, "--no-sum", tensors="shape") == {
        rank: [line.replace(" sum=3.0", "") for line in BORG[rank]] for rank in range(2)}


def test_a_library_that_registers_an_op_at_import_is_shared_after_one_notice(capsys):
    result = run_script(SCRIPTS / "registers_op.py", 3, run_id=uuid.uuid4().hex)
    out = capsys.readouterr()
    assert result.returncode == 0, result.summary() + out.err
    tagged = lines(out.out + out.err)
    assert {rank: [line for line in tagged[rank] if line.startswith("scaled")] for rank in range(3)} == {
        rank: ["scaled_sum=18"] for rank in range(3)}
    notices = [line for line in out.out.splitlines() + out.err.splitlines() if "own import of module" in line]
    assert len(notices) == 1 and "rank 1's own import of module 'registers_op_lib' raised RuntimeError" in notices[0]
    assert "Rank 1 and later ranks use the first rank's 'registers_op_lib'" in notices[0]
    assert "registers_op_lib" not in sys.modules


# -- World programs --------------------------------------------------------------------------------

@pytest.fixture
def library(tmp_path, monkeypatch):
    """A module ``counter_lib_<id>`` in a folder on sys.path, not imported yet: a per-process counter."""
    name = f"counter_lib_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import threading\nCOUNT = []\ndef add(rank):\n    COUNT.append(rank)\n    return list(COUNT)\n")
    package = tmp_path / f"{name}_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from .state import STATE\n")
    (package / "state.py").write_text("STATE = {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for module in [key for key in sys.modules if key.startswith(name)]:
        del sys.modules[module]


def test_a_module_a_world_program_imports_is_per_rank_and_leaves_after_the_run(library):
    def program(comm):
        import importlib
        counter = importlib.import_module(library)
        package = importlib.import_module(f"{library}_pkg")
        state = importlib.import_module(f"{library}_pkg.state")
        package.STATE.setdefault("rank", comm.rank)
        seen = counter.add(comm.rank)
        comm.barrier()
        seen = counter.add(comm.rank)
        return seen, package.STATE["rank"], state.STATE is package.STATE

    meta_path = list(sys.meta_path)
    results = World(3).run(program)
    assert results == [([rank, rank], rank, True) for rank in range(3)]
    assert library not in sys.modules and f"{library}_pkg" not in sys.modules
    assert sys.meta_path == meta_path


def test_a_module_the_caller_imported_before_the_run_is_shared_as_documented(library):
    import importlib
    counter = importlib.import_module(library)

    def program(comm):
        module = importlib.import_module(library)
        module.add(comm.rank)
        comm.barrier()
        return list(module.COUNT)

    assert World(2).run(program) == [[0, 1], [0, 1]]
    assert counter.COUNT == [0, 1] and sys.modules[library] is counter


def test_torch_and_stdlib_imports_during_a_run_stay_shared():
    def program(comm):
        import torch.distributed.checkpoint as dcp
        import json
        return id(dcp), id(json)

    results = World(2).run(program)
    assert results[0] == results[1]


def test_a_c_extension_is_not_copied():
    import _socket
    import json
    assert _is_python_code(json) and not _is_python_code(_socket) and not _is_python_code(sys)


def test_a_program_that_imports_nothing_new_gives_no_rank_a_module():
    modules = RankModules(2)
    modules.start()
    try:
        for rank in (0, 1, 0):
            modules.take_turn(rank)
            modules.hand_off(rank)
        assert not modules.any and modules.mine == [None, None]
    finally:
        modules.end()


# -- the same scripts under torchrun (gloo processes) ---------------------------------------------

from tests.launchers import TORCHRUN, launch_ok


@pytest.mark.real
@pytest.mark.skipif(not TORCHRUN.exists(), reason=f"no torchrun at {TORCHRUN}")
@pytest.mark.parametrize("script, nproc, expected", [
    ("borg_state.py", 2, BORG), ("pgm_grid.py", 4, GRID), ("rank_log_script.py", 2, LOG),
    ("registers_op.py", 3, {rank: ["scaled_sum=18"] for rank in range(3)})])
def test_each_script_prints_under_simcomm_run_what_it_prints_under_torchrun(tmp_path, script, nproc, expected):
    outputs = []
    for launcher in ([sys.executable, "-m", "simcomm.run"], [str(TORCHRUN), "--standalone", "--tee", "3"]):
        text = launch_ok([*launcher, "--nproc-per-node", str(nproc), str(SCRIPTS / script)], tmp_path,
                         reference=launcher[0] == str(TORCHRUN), timeout=300)
        tagged = lines(text)
        outputs.append({rank: [line for line in tagged.get(rank, []) if "own import of module" not in line]
                        for rank in range(nproc)})
    assert outputs[0] == outputs[1] == expected


def test_get_device_module_of_cuda_is_torch_cuda_on_virtual_gpus_and_not_cached_after():
    import torch

    def program(comm):
        current = torch.accelerator.current_accelerator()
        return (torch.get_device_module("cuda") is torch.cuda, torch.get_device_module(current) is torch.cuda,
                torch.get_device_module("cuda:1") is torch.cuda, torch.get_device_module() is torch.cuda,
                torch.get_device_module("cpu") is torch.cpu)

    assert World(2, map_cuda=True).run(program) == [(True,) * 5] * 2
    assert torch.get_device_module("cuda") is torch.cuda and torch.get_device_module("cpu") is torch.cpu


def test_a_package_run_with_dash_m_is_per_rank_with_its_submodules(tmp_path, monkeypatch, capsys):
    name = f"rank_pkg_{uuid.uuid4().hex[:8]}"
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text("SEEN = []\n")
    (package / "main.py").write_text(
        "import os\nimport torch.distributed as dist\n"
        f"import {name}\nfrom {name} import SEEN\n"
        "dist.init_process_group('gloo')\nSEEN.append(int(os.environ['RANK']))\ndist.barrier()\n"
        f"print('seen', {name}.SEEN, SEEN is {name}.SEEN)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = run_script(f"{name}.main", 3, module=True)
    out = capsys.readouterr()
    assert result.returncode == 0, result.summary() + out.err
    assert lines(out.out + out.err) == {rank: [f"seen [{rank}] True"] for rank in range(3)}
    assert not [key for key in sys.modules if key.startswith(name)]
