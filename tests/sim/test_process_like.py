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
from tests.launchers import rank_reports, torchrun_lines

SCRIPTS = Path(__file__).parents[1] / "scripts"
ROOT = Path(__file__).parents[2]


def report(text: str) -> dict[int, str]:
    """Each rank's ``rankN: ...`` line, tagged (simcomm.run) or not (torchrun)."""
    return rank_reports(text)


def fields(line: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in line.split() if "=" in item and not item.startswith("draws"))


def on_virtual_ranks(script: str, capsys, nproc: int = 2, *args: str):
    result = run_script(SCRIPTS / script, nproc, list(args))
    out = capsys.readouterr()
    return result, report(out.out + out.err)


def under_torchrun(script: str, nproc: int = 2, *args: str, cwd: Path | None = None, env: dict | None = None):
    """The script under ``torchrun --standalone`` on ``nproc`` gloo processes."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for _attempt in range(3):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(nproc), str(SCRIPTS / script), *args], capture_output=True, text=True,
                              timeout=240, cwd=cwd or ROOT, env=environment)
        lines = report(done.stdout + done.stderr)
        # the reference side: on a loaded machine a torchrun run now and then exits 0 without one
        # worker's report line reaching the pipe, or a gloo process aborts in its teardown after its
        # last line; such a run says nothing about the script (every script here ends with 0), so
        # it is rerun
        if done.returncode == 0 and len(lines) == nproc:
            break
    print("torchrun stdout:", done.stdout[-1500:], "stderr:", done.stderr[-1500:], sep="\n")   # shown on failure
    return done, lines


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


# -- threads a rank starts ------------------------------------------------------------------------

def _thread_lines_agree(lines):
    for rank in range(2):
        assert fields(lines[rank]) == {"reduced": "[3.0,", "env_rank": str(rank), "group_rank": str(rank),
                                       "world": "2"}, lines


def test_a_thread_a_rank_starts_communicates_and_prints_as_the_rank(capsys):
    result, lines = on_virtual_ranks("thread_collective.py", capsys)
    assert result.returncode == 0, result.summary()
    _thread_lines_agree(lines)
    out = run_script(SCRIPTS / "thread_collective.py", 2)
    text = capsys.readouterr()
    assert out.returncode == 0
    for rank in range(2):                  # the thread's print carries its rank's tag
        assert f"[rank {rank}] rank{rank}: printed_by_thread" in text.out + text.err


@torchrun
def test_a_thread_a_rank_starts_communicates_as_the_rank_under_torchrun():
    done, lines = under_torchrun("thread_collective.py")
    assert done.returncode == 0, done.stderr[-2000:]
    _thread_lines_agree(lines)


def test_threads_of_a_rank_on_a_world_run_share_its_communicator_and_the_rank_waits_for_them():
    import concurrent.futures
    import threading

    import simcomm

    reduced = {}

    def program(comm):
        def reduce_in_thread():
            reduced[comm.rank] = comm.all_reduce(torch.full((2,), float(comm.rank + 1))).tolist()

        with concurrent.futures.ThreadPoolExecutor(1) as pool:       # a pool's thread is the rank's too
            gathered = pool.submit(lambda: [t.item() for t in comm.all_gather(torch.tensor([comm.rank]))]).result()
        # not joined: the rank ends once its non-daemon threads have, as a process exits
        threading.Thread(target=reduce_in_thread).start()
        return gathered

    assert simcomm.World(3).run(program) == [[0, 1, 2]] * 3
    assert reduced == {rank: [6.0, 6.0] for rank in range(3)}


def test_two_threads_of_a_rank_communicating_at_once_is_a_named_error():
    import threading

    import simcomm
    from simcomm.errors import RankError, WrongThreadError

    def program(comm):
        import time
        if comm.rank == 0:
            threading.Thread(target=comm.barrier, name="helper").start()   # waits: rank 1 is asleep
            time.sleep(0.3)
            comm.all_reduce(torch.ones(1))       # the main thread too, meanwhile
        else:
            time.sleep(1.0)
            comm.barrier()

    with pytest.raises(RankError) as info:
        simcomm.World(2).run(program, timeout=20)
    assert isinstance(info.value.__cause__, WrongThreadError)
    assert "another thread of rank 0 waits in a communication call" in str(info.value.__cause__)


def test_a_thread_of_another_rank_is_refused():
    import threading

    import simcomm
    from simcomm.errors import RankError, WrongThreadError

    comms = {}

    def program(comm):
        comms[comm.rank] = comm
        comm.barrier()
        if comm.rank == 1:
            errors = []

            def use_rank_0():
                try:
                    comms[0].barrier()
                except WrongThreadError as error:
                    errors.append(error)
            thread = threading.Thread(target=use_rank_0)
            thread.start()
            thread.join()
            raise errors[0]
        comm.barrier()

    with pytest.raises(RankError) as info:
        simcomm.World(2).run(program, timeout=20)
    assert isinstance(info.value.__cause__, WrongThreadError)


# -- the working directory ------------------------------------------------------------------------

def _cwd_lines_agree(lines):
    for rank in range(2):
        assert fields(lines[rank]) == {"state": f"{rank}.0", "folder": f"work{rank}", "siblings": "work0,work1",
                                       "nested": "False"}, lines


@pytest.mark.parametrize("relative", [True, False], ids=["relative script path", "absolute script path"])
def test_each_rank_has_its_own_working_directory_and_the_callers_is_put_back(relative, tmp_path, monkeypatch, capsys):
    script = tmp_path / "rank_cwd.py"
    script.write_text((SCRIPTS / "rank_cwd.py").read_text())
    monkeypatch.chdir(tmp_path)
    result = run_script("rank_cwd.py" if relative else script, 2)
    out = capsys.readouterr()
    assert result.returncode == 0, result.summary() + out.err
    _cwd_lines_agree(report(out.out + out.err))
    assert os.getcwd() == str(tmp_path)                      # the caller's, after the run
    assert sorted(path.name for path in tmp_path.iterdir()) == ["rank_cwd.py", "work0", "work1"]


def test_a_rank_thread_that_changes_directory_leaves_the_other_ranks_and_the_caller_where_they_were(tmp_path):
    import simcomm

    (tmp_path / "a").mkdir()
    here = os.getcwd()

    def program(comm):
        if comm.rank == 0:
            os.chdir(tmp_path / "a")
        comm.barrier()
        seen = os.getcwd()
        comm.barrier()
        return seen, os.path.exists("b.txt") if comm.rank == 0 else None

    (tmp_path / "a" / "b.txt").write_text("x")
    assert simcomm.World(3).run(program) == [(str(tmp_path / "a"), True), (here, None), (here, None)]
    assert os.getcwd() == here


@torchrun
def test_each_rank_has_its_own_working_directory_under_torchrun(tmp_path):
    done, lines = under_torchrun("rank_cwd.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    _cwd_lines_agree(lines)


# -- the process id -------------------------------------------------------------------------------

def _pid_lines_agree(lines):
    for rank in range(2):
        assert fields(lines[rank]) == {"files": "2", "sum": "1.0", "distinct": "True", "stable": "True",
                                       "alive": "True"}, lines


def test_each_rank_has_a_pid_of_its_own_so_pid_named_files_do_not_collide(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    result, lines = on_virtual_ranks("rank_pid.py", capsys)
    assert result.returncode == 0, result.summary()
    _pid_lines_agree(lines)
    assert list(tmp_path.iterdir()) == []
    import simcomm
    pids = simcomm.World(2).run(lambda comm: (os.getpid(), os.path.isdir(f"/proc/{os.getpid()}")))
    assert len({pid for pid, _ in pids}) == 2 and all(alive for _, alive in pids)
    assert os.getpid() not in {pid for pid, _ in pids}       # the caller keeps the process's own


@torchrun
def test_each_rank_has_a_pid_of_its_own_under_torchrun(tmp_path):
    done, lines = under_torchrun("rank_pid.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    _pid_lines_agree(lines)


# -- the C environment and child processes --------------------------------------------------------

def _env_lines_agree(lines):
    for rank in range(2):
        assert fields(lines[rank]) == {"c_rank": str(rank), "c_setting": f"v{rank}", "child_rank": str(rank),
                                       "child_setting": f"v{rank}", "child_unset": "-",
                                       "shell": f"{rank}-v{rank}"}, lines


def test_c_getenv_child_processes_and_shells_see_the_ranks_environment(monkeypatch, capsys):
    monkeypatch.setenv("SIMCOMM_TEST_UNSET_ME", "1")
    monkeypatch.delenv("MY_SETTING", raising=False)
    result, lines = on_virtual_ranks("rank_env_child.py", capsys)
    assert result.returncode == 0, result.summary()
    _env_lines_agree(lines)
    # after the run the C environment is the process's again
    import ctypes
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    assert libc.getenv(b"RANK") == (os.environ["RANK"].encode() if "RANK" in os.environ else None)
    assert libc.getenv(b"MY_SETTING") is None and libc.getenv(b"SIMCOMM_TEST_UNSET_ME") == b"1"


@torchrun
def test_c_getenv_child_processes_and_shells_see_the_ranks_environment_under_torchrun():
    done, lines = under_torchrun("rank_env_child.py", env={"SIMCOMM_TEST_UNSET_ME": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    _env_lines_agree(lines)


@torchrun
@pytest.mark.parametrize("launcher", ["simcomm.run", "torchrun"])
def test_torch_compile_works_on_each_rank(launcher, tmp_path):
    """Inductor sets a variable in os.environ that its compiled C++ module reads with getenv."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "PYTHONPATH": str(ROOT)}
    if launcher == "torchrun":           # rerun while torchrun loses a worker's line (tests/launchers.py)
        lines = torchrun_lines(SCRIPTS / "compiled_step.py", 2, report, cwd=tmp_path, env=env)
    else:
        done = subprocess.run([sys.executable, "-m", "simcomm.run", "--nproc-per-node", "2",
                               str(SCRIPTS / "compiled_step.py")],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = report(done.stdout + done.stderr)
    assert all(fields(lines[rank]) == {"matches": "True", "reduced": "50.0539"} for rank in range(2)), lines


# -- logging --------------------------------------------------------------------------------------

def _log_lines(text: str) -> list[str]:
    return sorted(match.group(0) for match in re.finditer(r"rank\d: log=\[r\d\] \S+", text))


EXPECTED_LOG = ["rank0: log=[r0] info_shown=True", "rank0: log=[r0] step=1", "rank1: log=[r1] step=1"]


def test_each_rank_configures_its_own_logging_and_the_callers_is_kept(capsys, monkeypatch):
    import logging
    monkeypatch.setattr(logging.root, "handlers", [])     # a fresh process's: pytest's own set aside
    before = logging.root.handlers, logging.root.level
    run_script(SCRIPTS / "rank_logging.py", 2)
    out = capsys.readouterr()
    assert _log_lines(out.out + out.err) == EXPECTED_LOG, out
    assert logging.root.handlers is before[0] and before == ([], logging.root.level)


@torchrun
def test_each_rank_configures_its_own_logging_under_torchrun():
    done, _ = under_torchrun("rank_logging.py")
    assert done.returncode == 0, done.stderr[-2000:]
    assert _log_lines(done.stdout + done.stderr) == EXPECTED_LOG, done.stdout


# -- once-per-process settings --------------------------------------------------------------------

def _settings_lines_agree(lines):
    for rank in range(2):
        assert fields(lines[rank]) == {"method": "spawn", "second": "refused", "handler_mine": "True",
                                       "previous_default": "True"}, lines


def test_each_rank_sets_its_start_method_and_signal_handler_once(capsys):
    import multiprocessing
    import signal
    before = multiprocessing.get_start_method(allow_none=True), signal.getsignal(signal.SIGTERM)
    result, lines = on_virtual_ranks("process_settings.py", capsys)
    assert result.returncode == 0, result.summary()
    _settings_lines_agree(lines)
    assert (multiprocessing.get_start_method(allow_none=True), signal.getsignal(signal.SIGTERM)) == before


@torchrun
def test_each_rank_sets_its_start_method_and_signal_handler_once_under_torchrun():
    done, lines = under_torchrun("process_settings.py")
    assert done.returncode == 0, done.stderr[-2000:]
    _settings_lines_agree(lines)


# -- stdout and stderr ----------------------------------------------------------------------------

def _stream_lines(text: str) -> list[str]:
    return sorted(re.sub(r"^\[rank \d+\] ", "", line) for line in text.splitlines() if re.search(r"rank\d: ", line))


EXPECTED_STREAMS = [f"rank{rank}: {rest}" for rank in range(2) for rest in
                    ("errors=strict encoding_ok=True fileno_int=True writable=True", "via_buffer=True")]


def test_the_tagged_stdout_is_a_full_text_stream():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONIOENCODING": "utf-8"}
    done = subprocess.run([sys.executable, "-m", "simcomm.run", "--nproc-per-node", "2",
                           str(SCRIPTS / "rank_streams.py")], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _stream_lines(done.stdout) == EXPECTED_STREAMS, done.stdout
    assert "[rank 1] rank1: via_buffer=True" in done.stdout.splitlines()     # bytes are tagged too


@torchrun
def test_stdout_is_a_full_text_stream_under_torchrun():
    done, _ = under_torchrun("rank_streams.py", env={"PYTHONIOENCODING": "utf-8"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert _stream_lines(done.stdout) == EXPECTED_STREAMS, done.stdout


# -- the threads a rank waits for as it ends ------------------------------------------------------

_LINGERING = '''
import sys, threading, time
from concurrent.futures import ThreadPoolExecutor
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
how = sys.argv[1]
if how == "executor":
    pool = ThreadPoolExecutor(2)             # never shut down: a process's exit stops its workers
    pool.submit(time.sleep, 0.01).result()
elif rank == 0:
    forever = threading.Event()
    threading.Thread(target=forever.wait, name="waits-forever").start()     # not a daemon
dist.barrier()
if how == "fails" and rank == 0:
    raise RuntimeError("rank 0 fails")
print(f"rank{rank}: done", flush=True)
'''


@pytest.mark.parametrize("how", ["fails", "returns", "executor"])
def test_a_rank_does_not_hang_on_a_thread_that_never_ends(how, tmp_path, capsys, monkeypatch):
    from simcomm.sim import scheduler
    monkeypatch.setattr(scheduler, "RANK_THREAD_GRACE_S", 0.5)
    script = tmp_path / "lingering.py"
    script.write_text(_LINGERING)
    result = run_script(script, 2, [how], timeout=60)
    out = capsys.readouterr()
    lines = report(out.out + out.err)
    if how == "fails":      # the failure is reported, not held up by the thread
        assert result.exit_codes == [1, 0] and "rank 0 fails" in repr(result), result.summary()
        assert lines.get(1) == "done", lines
    else:
        assert result.returncode == 0, result.summary() + out.err
        assert lines == {0: "done", 1: "done"}, lines
        if how == "returns":
            assert "a thread it started, 'waits-forever', is still running" in out.err, out.err
        else:
            assert "still running" not in out.err, out.err


# -- processes a rank starts ----------------------------------------------------------------------

def _children_lines_agree(lines):
    for rank in range(2):
        assert fields(lines[rank]) == {"total": "120.0", "summed": "240.0", "child_exitcode": "7",
                                       "child_pid_differs": "True"}, lines


def test_children_a_rank_forks_are_processes_whose_exits_end_only_them(capsys):
    result = run_script(SCRIPTS / "dataloader_workers.py", 2)
    out = capsys.readouterr()
    assert result.returncode == 0, result.summary()
    _children_lines_agree(report(out.out + out.err))
    # a worker's os._exit at its end is the real one: nothing of the rank's program runs in it again
    assert "Exception ignored" not in out.err and "_RankEnded" not in out.err, out.err[-2000:]


def test_dataloader_workers_of_shape_only_ranks_load_real_batches(capsys):
    # the worker leaves the rank's fake mode (its dataset and collate run on real data) and the
    # rank rebuilds the batch it receives as the real tensor it is: the same total as torchrun's;
    # what the all-reduce wrote has no value (nan with scalar_reads="nan")
    result = run_script(SCRIPTS / "dataloader_workers.py", 2, tensors="shape", scalar_reads="nan")
    out = capsys.readouterr()
    assert result.returncode == 0, result.summary()
    lines = report(out.out + out.err)
    for rank in range(2):
        assert fields(lines[rank]) == {"total": "120.0", "summed": "nan", "child_exitcode": "7",
                                       "child_pid_differs": "True"}, lines
    assert "Attempted to set the storage" not in out.err, out.err[-2000:]


@torchrun
def test_children_a_rank_forks_are_processes_under_torchrun():
    done, lines = under_torchrun("dataloader_workers.py")
    assert done.returncode == 0, done.stderr[-2000:]
    _children_lines_agree(lines)
