"""What a torchrun script sees of its launch under ``python -m simcomm.run``, beside torchrun's
(gloo): ``__file__``, the environment, init_process_group's lifecycle, the backend's name, a
process-group timeout; and the caller of :func:`run_script` finds its own state unchanged.

Oracle: torchrun on this machine (the slow tests run the same script under both launchers)
and torch's own behaviour in one process.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import simcomm
from simcomm.run import run_script

ROOT = Path(__file__).parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"
needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists(), reason=f"no torchrun at {TORCHRUN}")

#: the variables torchrun's agent sets for its workers (torch 2.13, checked with a script that
#: prints os.environ under `torchrun --nproc-per-node 2`)
TORCHRUN_VARIABLES = (
    "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "OMP_NUM_THREADS", "RANK", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "WORLD_SIZE")

LIFECYCLE = '''\
import json, os, sys
import torch.distributed as dist
here = os.path.dirname(__file__)
os.chdir(os.path.join(here, "out"))                      # a script that writes into its output folder
config = json.load(open(os.path.join(here, "config.json")))   # ... and reads what lies beside it
print("file", os.path.isabs(__file__), os.path.basename(__file__), "argv0", sys.argv[0], "config", config["lr"])
print("before", dist.is_initialized())
try:
    dist.get_rank()
except ValueError as error:
    print("get_rank ValueError", str(error)[:40])
dist.init_process_group("gloo")
print("after", dist.is_initialized(), "backend", dist.get_backend())
try:
    dist.init_process_group("gloo")
except ValueError as error:
    print("second ValueError", error)
dist.monitored_barrier()
print("monitored_barrier passed")
names = {name: os.environ[name] for name in %r}
print("agent", names["TORCHELASTIC_USE_AGENT_STORE"], names["TORCHELASTIC_SIGNALS_TO_HANDLE"],
      os.path.basename(names["TORCHELASTIC_ERROR_FILE"]),
      os.path.isdir(os.path.dirname(names["TORCHELASTIC_ERROR_FILE"])))
dist.destroy_process_group()
''' % (TORCHRUN_VARIABLES,)

EXPECTED = [
    "file True lifecycle.py argv0 lifecycle.py config 0.5",
    "before False",
    "get_rank ValueError Default process group has not been initi",
    "after True backend gloo",
    "second ValueError trying to initialize the default process group twice!",
    "monitored_barrier passed",
    "agent True SIGTERM,SIGINT,SIGHUP,SIGQUIT error.json True",
]


@pytest.fixture
def lifecycle(tmp_path):
    (tmp_path / "lifecycle.py").write_text(LIFECYCLE)
    (tmp_path / "config.json").write_text('{"lr": 0.5}')
    (tmp_path / "out").mkdir()
    return tmp_path


def _rank_lines(text: str, rank: int) -> list[str]:
    lines = []
    for line in text.splitlines():
        for prefix in (f"[rank {rank}] ", f"[default{rank}]:"):
            if line.startswith(prefix):
                lines.append(line[len(prefix):])
    return lines


def test_a_script_sees_torchruns_file_environment_and_init_lifecycle(lifecycle, capsys, monkeypatch):
    monkeypatch.chdir(lifecycle)
    result = run_script("lifecycle.py", 2)          # relative, as typed on a command line
    out = capsys.readouterr().out
    assert result.returncode == 0, result.summary()
    for rank in range(2):
        assert _rank_lines(out, rank) == EXPECTED
    assert os.getcwd() == str(lifecycle)           # the script's chdir did not stay


def test_world_run_programs_find_the_group_standing_and_init_joins_it():
    def program(comm):
        import torch.distributed as dist
        standing = dist.is_initialized()
        dist.init_process_group("gloo")
        dist.init_process_group("gloo")           # joins again: the group is the run's
        return standing, dist.get_backend()

    assert simcomm.World(2).run(program) == [(True, "simcomm")] * 2


def test_a_process_group_timeout_fires_naming_each_ranks_line(tmp_path, capsys):
    script = tmp_path / "slow_peer.py"
    script.write_text(
        "import time\nfrom datetime import timedelta\nimport torch.distributed as dist\n"
        "dist.init_process_group('gloo', timeout=timedelta(seconds=1))\n"
        "if dist.get_rank() == 1:\n"
        "    end = time.monotonic() + 60\n"
        "    while time.monotonic() < end:\n"
        "        pass\n"
        "dist.barrier()\n")
    result = run_script(script, 2)
    assert isinstance(result.error, simcomm.RunTimeoutError), result.summary()
    message = str(result.error)
    assert "rank 0 waited" in message and "timeout=1 s its init_process_group gave" in message
    assert "Timed out waiting 1000ms" in message
    assert f"{script}:9 in <module>" in message
    assert f"{script}:7 in <module>" in message or f"{script}:8 in <module>" in message
    assert result.returncode == 1


def test_a_bad_process_group_timeout_is_refused_naming_the_rank(tmp_path, capsys):
    script = tmp_path / "bad_timeout.py"
    script.write_text("from datetime import timedelta\nimport torch.distributed as dist\n"
                      "dist.init_process_group('gloo', timeout=timedelta(seconds=-1))\n")
    result = run_script(script, 2)
    assert isinstance(result.error, simcomm.RankError)
    assert "init_process_group on rank 0: timeout=" in str(result.error)


def test_run_script_leaves_the_caller_as_it_found_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    script = tmp_path / "messy.py"
    script.write_text(
        "import os, random, sys, numpy, torch\n"
        f"os.chdir({str(tmp_path / 'elsewhere')!r})\n"
        "torch.set_default_dtype(torch.float64)\n"
        "sys.argv.append('--extra')\n"
        "os.environ['SIMCOMM_TEST_LEFTOVER'] = '1'\n"
        "random.seed(1); numpy.random.seed(1); torch.manual_seed(1)\n"
        "print('done', torch.ones(1).dtype)\n")
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    before = (os.getcwd(), torch.get_default_dtype(), list(sys.argv), dict(os.environ),
              random.getstate(), np.random.get_state()[1].tolist(), torch.random.get_rng_state(),
              list(sys.path), torch.get_num_threads())
    result = run_script(script, 2)
    assert result.returncode == 0, result.summary()
    assert capsys.readouterr().out.count("done torch.float64") == 2
    after = (os.getcwd(), torch.get_default_dtype(), list(sys.argv), dict(os.environ),
             random.getstate(), np.random.get_state()[1].tolist(), torch.random.get_rng_state(),
             list(sys.path), torch.get_num_threads())
    for name, was, now in zip(("cwd", "dtype", "argv", "environ", "random", "numpy", "torch", "path",
                               "threads"), before, after):
        assert (torch.equal(was, now) if isinstance(was, torch.Tensor) else was == now), name


# -- the same script under torchrun ---------------------------------------------------------------

@pytest.mark.real
@needs_torchrun
def test_the_lifecycle_script_prints_the_same_under_torchrun(lifecycle):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for launcher in ([sys.executable, "-m", "simcomm.run"], [str(TORCHRUN), "--tee", "3"]):
        done = subprocess.run([*launcher, "--nproc-per-node", "2", "lifecycle.py"], capture_output=True,
                              text=True, timeout=300, cwd=lifecycle, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        for rank in range(2):
            assert _rank_lines(done.stdout + done.stderr, rank) == EXPECTED, (launcher, done.stdout)


@pytest.mark.real
@needs_torchrun
def test_the_environment_has_every_variable_torchrun_sets(tmp_path):
    script = tmp_path / "env_names.py"
    script.write_text("import os, json\nprint('names', json.dumps(sorted(os.environ)))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    seen = []
    for launcher in ([sys.executable, "-m", "simcomm.run"], [str(TORCHRUN), "--tee", "3"]):
        done = subprocess.run([*launcher, "--nproc-per-node", "2", str(script)], capture_output=True,
                              text=True, timeout=300, cwd=tmp_path, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        line = next(line for line in _rank_lines(done.stdout, 1) if line.startswith("names "))
        import json
        seen.append(set(json.loads(line[len("names "):])) - set(env))
    # torch sets TORCHINDUCTOR_CACHE_DIR itself when torch._dynamo is imported, which the simulator
    # does (a worker that imports it gets it too); every variable torchrun sets is there, no other
    assert seen[0] - {"TORCHINDUCTOR_CACHE_DIR"} == seen[1] == set(TORCHRUN_VARIABLES), seen
