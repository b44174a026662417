"""SIGINT below Python: a run leaves the caller's process as it found it, and a rank starts with
SIGINT as a torchrun worker does.

``signal.getsignal`` reads Python's table only. What decides whether Ctrl-C reaches a notebook's
kernel is below it: the disposition the kernel keeps (``/proc/self/status`` SigIgn, the handler
``sigaction`` reports) and the main thread's signal mask (its SigBlk). ``sigint_state`` reads
those; every test here compares them before and after a run that returns, fails, is interrupted
with Ctrl-C, or whose ranks ignore and block SIGINT and run a shell command (C ``system()``
ignores SIGINT in the whole process while its child runs).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import simcomm
from simcomm.run import run_script
from tests.launchers import ROOT, TORCHRUN, launch, sigint_state

#: a rank that ignores SIGINT, blocks it on its own thread and runs a shell command
UNRULY = ("import os, signal\n"
          "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
          "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n"
          "assert os.system('true') == 0\n"
          "print('ignored', signal.getsignal(signal.SIGINT) == signal.SIG_IGN)\n")

#: rank 1 interrupts itself. Each line is one write: under PYTHONUNBUFFERED a print of two values
#: is several writes, and two torchrun workers' pieces interleave in the pipe
INTERRUPTED = ("import os, signal, sys\n"
               "sys.stdout.write(f'python handler {signal.getsignal(signal.SIGINT) is signal.default_int_handler}\\n')\n"
               "sys.stdout.flush()\n"
               "if os.environ['RANK'] == '1':\n"
               "    signal.raise_signal(signal.SIGINT)\n"
               "sys.stdout.write('alive\\n')\n"
               "sys.stdout.flush()\n")


def _caller():
    return signal.getsignal(signal.SIGINT), sigint_state()


def test_the_state_read_sees_an_ignored_and_a_blocked_sigint():
    # the check below would pass on a reader that sees nothing: it must see both changes
    before = sigint_state()
    assert before["ignored"] is False and before["blocked_in_main_thread"] is False
    assert before["c_handler"] not in ("SIG_IGN", "SIG_DFL", None)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        assert sigint_state()["ignored"] is True and sigint_state()["c_handler"] == "SIG_IGN"
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        assert sigint_state()["blocked_in_main_thread"] is True
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    assert sigint_state() == before


def _returns(comm):
    return comm.all_reduce(torch.ones(1)).item()


def _fails(comm):
    if comm.rank == 1:
        raise ValueError("rank 1 fails")
    comm.barrier()


def _unruly(comm):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    assert os.system("true") == 0
    return signal.getsignal(signal.SIGINT) == signal.SIG_IGN


@pytest.mark.parametrize("program", [_returns, _fails, _unruly], ids=["returns", "fails", "unruly"])
def test_world_run_leaves_the_callers_sigint_as_it_found_it(program):
    before = _caller()
    try:
        result = simcomm.World(2).run(program)
    except simcomm.RankError:
        assert program is _fails
    else:
        assert result == ([2.0, 2.0] if program is _returns else [True, True])
    assert _caller() == before


@pytest.mark.parametrize("script", [UNRULY, "raise SystemExit(3)\n", INTERRUPTED],
                         ids=["unruly", "exits_3", "rank_interrupts_itself"])
def test_run_script_leaves_the_callers_sigint_as_it_found_it(tmp_path, capsys, script):
    path = tmp_path / "script.py"
    path.write_text(script)
    before = _caller()
    result = run_script(path, 2)
    assert result.exit_codes == {UNRULY: [0, 0], INTERRUPTED: [0, -2]}.get(script, [3, 3]), result.summary()
    assert _caller() == before
    if script is UNRULY:
        assert capsys.readouterr().out.count("ignored True") == 2


def test_ctrl_c_during_a_run_leaves_the_callers_sigint_as_it_found_it():
    def program(comm):
        if comm.rank == 0:
            time.sleep(5)
        comm.barrier()

    before = _caller()
    main = threading.main_thread().ident
    timer = threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        simcomm.World(2).run(program)
    timer.join()
    assert _caller() == before


def test_a_rank_starts_with_pythons_sigint_handler_where_the_caller_ignores_sigint(tmp_path, capsys):
    # a process started as a background job of a non-interactive shell ignores SIGINT; torchrun's
    # agent catches SIGINT itself, so its workers start with Python's handler (the torchrun side
    # is the slow test below): rank 1's raise_signal ends it with -2, as it ends a worker
    path = tmp_path / "interrupted.py"
    path.write_text(INTERRUPTED)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        ignoring = _caller()
        result = run_script(path, 2)
        assert _caller() == ignoring, "the caller's SIGINT stays ignored: it is the caller's choice"
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert result.exit_codes == [0, -2], result.summary()
    assert capsys.readouterr().out.count("python handler True") == 2


def test_a_rank_that_ignores_sigint_itself_is_not_ended_by_it(tmp_path, capsys):
    path = tmp_path / "ignores.py"
    path.write_text("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n" + INTERRUPTED)
    result = run_script(path, 2)
    assert result.exit_codes == [0, 0], result.summary()
    assert capsys.readouterr().out.count("alive") == 2


#: start a command with SIGINT ignored, as a background job of a non-interactive shell is
IGNORING_SIGINT = [sys.executable, "-c", "import os, signal, sys\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                   "os.execv(sys.argv[1], sys.argv[1:])"]
LAUNCHERS = {"torchrun": [str(TORCHRUN)], "simcomm.run": [sys.executable, "-m", "simcomm.run"]}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_worker_of_a_launcher_started_with_sigint_ignored_is_ended_by_sigint(tmp_path, launcher):
    path = tmp_path / "interrupted.py"
    path.write_text(INTERRUPTED)
    done = launch(IGNORING_SIGINT + LAUNCHERS[launcher] + ["--standalone", "--nproc-per-node", "2", str(path)],
                  tmp_path, reference=launcher == "torchrun")
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert output.count("python handler True") == 2, output
    assert "exitcode: -2" in output if launcher == "torchrun" else "exitcode -2 (SIGINT" in output, output


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_launcher_started_with_sigint_ignored_stops_on_ctrl_c(tmp_path, launcher):
    path = tmp_path / "waits.py"
    path.write_text("import time\nprint('ready', flush=True)\ntime.sleep(120)\n")
    process = subprocess.Popen(IGNORING_SIGINT + LAUNCHERS[launcher] + ["--nproc-per-node", "1", str(path)],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                               start_new_session=True)
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if "ready" in line:
                break
        assert lines and "ready" in lines[-1], "".join(lines)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) != 0       # the script would sleep 120 s
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


#: what a worker has for three signals its launcher's process ignores
INHERITED = ("import signal\n"
             "print('inherited', *(signal.getsignal(s).name for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)))\n")


def test_a_rank_inherits_an_ignored_signal_unless_torchruns_agent_catches_it():
    # torchrun's agent catches SIGTERM, SIGINT, SIGHUP and SIGQUIT before it starts its workers, so
    # they start with them at their default; another ignored signal a worker inherits ignored
    # (the torchrun side: the slow test below)
    signals = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
    saved = [signal.getsignal(each) for each in signals]
    try:
        for each in signals:
            signal.signal(each, signal.SIG_IGN)
        seen = simcomm.World(2).run(lambda comm: [signal.getsignal(each) for each in signals])
        assert [signal.getsignal(each) for each in signals] == [signal.SIG_IGN] * 3
    finally:
        for each, handler in zip(signals, saved):
            signal.signal(each, handler)
    assert seen == [[signal.SIG_DFL, signal.SIG_DFL, signal.SIG_IGN]] * 2


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_worker_inherits_an_ignored_signal_unless_torchruns_agent_catches_it(tmp_path, launcher):
    path = tmp_path / "inherited.py"
    path.write_text(INHERITED)
    ignoring = [sys.executable, "-c", "import os, signal, sys\n"
                "for each in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):\n"
                "    signal.signal(each, signal.SIG_IGN)\n"
                "os.execv(sys.argv[1], sys.argv[1:])"]
    done = launch(ignoring + LAUNCHERS[launcher] + ["--standalone", "--nproc-per-node", "1", str(path)],
                  tmp_path, reference=launcher == "torchrun")
    assert "inherited SIG_DFL SIG_DFL SIG_IGN" in done.stdout, done.stdout + done.stderr
