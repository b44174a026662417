"""Waiting without a collective on virtual ranks (simcomm.sim.waiting, RunState.pause): a rank that
sleeps or waits for a key of a script's own store hands the turn on, as a sleeping process leaves the
CPU, so file- and store-based synchronisation completes; a wait nobody can end is a DeadlockError
naming each rank's line. Scripts in tests/scripts/ run with ``simcomm.run`` (fast tier) and under
``torchrun`` on gloo (slow tier), with the same outcome."""
from __future__ import annotations

import datetime
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import simcomm
from simcomm.errors import DeadlockError, RankError, RunTimeoutError
from simcomm.run import run_script

from ..launchers import TORCHRUN, launch, rank_reports

SCRIPTS = Path(__file__).parents[1] / "scripts"


def report(text: str) -> dict[int, str]:
    """Each rank's ``rankN: ...`` line, tagged (simcomm.run) or not (torchrun)."""
    return rank_reports(text)


def on_virtual_ranks(script: str, capsys, *args: str, timeout: float = 60):
    result = run_script(SCRIPTS / script, 2, list(args), timeout=timeout, virtual_gpus=False)
    out = capsys.readouterr()
    return result, report(out.out + out.err), out.out + out.err


def under_torchrun(script: str, cwd: Path, *args: str):
    """The script under torchrun on 2 gloo processes; run again while two workers' lines run together
    or one is lost (torchrun's own output, on a loaded machine), as tests/launchers.py does."""
    for _attempt in range(3):
        done = launch([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(SCRIPTS / script), *args],
                      cwd, reference=True, timeout=240)
        lines = report(done.stdout + done.stderr)
        if len(lines) == 2 and not any(re.search(r"rank\d+:", line) for line in lines.values()):
            break
    return done, lines


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# -- polling a file with time.sleep ---------------------------------------------------------------

POLL_FILE = {0: "read=total=499500 polled=True", 1: "wrote=ready.txt read=ok-from-0"}


def test_ranks_meet_through_files_they_poll_with_sleep(tmp_path, capsys):
    result, lines, text = on_virtual_ranks("poll_file.py", capsys, str(tmp_path))
    assert result.returncode == 0, result.summary()
    assert lines == POLL_FILE, text
    assert result.wall_s < 5, "the ranks waited for the run's timeout"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_ranks_meet_through_files_they_poll_with_sleep_under_torchrun(tmp_path):
    done, lines = under_torchrun("poll_file.py", tmp_path, str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert lines == POLL_FILE


# -- a script's own stores ------------------------------------------------------------------------

OWN_TCPSTORE = {0: "got=from-rank-1 arrived=2 go=1 total=2", 1: "got=- arrived=2 go=1 total=2"}
OWN_FILESTORE = {0: "question=from-rank-1", 1: "reply=from-rank-0"}


def test_a_scripts_own_tcpstore_server_and_client_meet(capsys):
    result, lines, text = on_virtual_ranks("own_tcpstore.py", capsys)
    assert result.returncode == 0, result.summary()
    assert lines == OWN_TCPSTORE, text
    assert result.wall_s < 10, "a store wait held the turn until a timeout"


@pytest.mark.slow
def test_a_scripts_own_tcpstore_server_and_client_meet_under_torchrun(tmp_path):
    done, lines = under_torchrun("own_tcpstore.py", tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert lines == OWN_TCPSTORE


def test_a_scripts_own_filestore_passes_keys_both_ways(tmp_path, capsys):
    result, lines, text = on_virtual_ranks("own_filestore.py", capsys, str(tmp_path))
    assert result.returncode == 0, result.summary()
    assert lines == OWN_FILESTORE, text


@pytest.mark.slow
def test_a_scripts_own_filestore_passes_keys_both_ways_under_torchrun(tmp_path):
    done, lines = under_torchrun("own_filestore.py", tmp_path, str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert lines == OWN_FILESTORE


def test_a_tcpstore_server_created_after_its_clients_is_waited_for():
    # rank 1 makes the server, after rank 0's client was made: the client waits, handing the turn on
    port = free_port()

    def program(comm):
        if comm.rank == 0:
            store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=20))
            store.set("from", "client")
            value = store.get("reply").decode()
        else:
            time.sleep(0.1)
            store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=datetime.timedelta(seconds=20))
            value = store.get("from").decode()
            store.set("reply", "server")
        comm.barrier()           # the server outlives its client's last call
        return value

    started = time.monotonic()
    assert simcomm.World(2).run(program, timeout=30) == ["server", "client"]
    assert time.monotonic() - started < 10


def test_torch_elastics_store_barrier_and_synchronize_over_a_scripts_own_tcpstore():
    from torch.distributed.elastic.utils import store as elastic_store
    port = free_port()

    def program(comm):
        store = dist.TCPStore("127.0.0.1", port, 3, is_master=comm.rank == 0,
                              timeout=datetime.timedelta(seconds=20))
        if comm.rank == 2:
            time.sleep(0.2)                  # the last to arrive
        elastic_store.barrier(store, 3, key_prefix="barrier")
        values = elastic_store.synchronize(store, f"r{comm.rank}".encode(), comm.rank, 3, key_prefix="sync")
        comm.barrier()
        return [value.decode() for value in values]

    assert simcomm.World(3).run(program, timeout=30) == [["r0", "r1", "r2"]] * 3


def test_store_waits_and_multi_get_of_a_hashstore_and_a_prefixstore():
    store = dist.HashStore()

    def program(comm):
        mine = dist.PrefixStore("job", store)
        if comm.rank == 0:
            values = mine.multi_get(["a", "b"])
            mine.wait(["a", "b"], datetime.timedelta(seconds=5))
            return [value.decode() for value in values]
        mine.set("a", "1")
        time.sleep(0.05)
        mine.set("b", "2")
        return None

    assert simcomm.World(2).run(program, timeout=30) == [["1", "2"], None]
    # off rank threads, the calls are torch's own: a missing key times out as in torch
    store.set_timeout(datetime.timedelta(milliseconds=50))
    with pytest.raises(dist.DistStoreError):
        store.get("missing")


def test_a_store_wait_times_out_as_torch_does_while_another_rank_works():
    def program(comm):
        store = dist.HashStore()
        if comm.rank == 0:
            store.wait(["never"], datetime.timedelta(milliseconds=100))
        else:
            started = time.monotonic()
            while time.monotonic() - started < 0.3:
                time.sleep(0.01)         # rank 1 polls the clock: not a wait nobody ends
        return True

    with pytest.raises(RankError) as info:
        simcomm.World(2).run(program, timeout=30)
    assert info.value.rank == 0 and isinstance(info.value.__cause__, dist.DistStoreError)
    assert "wait timeout after 100ms, keys: never" in str(info.value.__cause__)


# -- a wait nobody can end ----------------------------------------------------------------------

def test_a_store_key_nobody_sets_is_a_deadlock_within_a_second():
    port = free_port()

    def program(comm):
        store = dist.TCPStore("127.0.0.1", port, 3, is_master=comm.rank == 0)
        if comm.rank == 2:
            comm.barrier()      # ranks 0 and 1 never come
        return store.get("never set")

    started = time.monotonic()
    with pytest.raises(DeadlockError) as info:
        simcomm.World(3).run(program, timeout=60)
    assert time.monotonic() - started < 1.5
    message = str(info.value)
    assert "rank 0 waits in TCPStore.get for key 'never set' at" in message
    assert "rank 1 waits in TCPStore.get for key 'never set' at" in message
    assert "rank 2 waits in barrier" in message and "test_waiting.py" in message


def test_a_tcpstore_server_whose_clients_never_come_is_a_deadlock():
    port = free_port()

    def program(comm):
        if comm.rank == 1:
            comm.barrier()
        dist.TCPStore("127.0.0.1", port, 2, is_master=comm.rank == 0)

    with pytest.raises(DeadlockError) as info:
        simcomm.World(2).run(program, timeout=60)
    assert f"rank 0 waits in TCPStore(is_master=True) for 1 of 1 clients on port {port}" in str(info.value)


def test_every_rank_polling_a_file_nobody_writes_is_a_deadlock_naming_the_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SIMCOMM_IDLE_S", "1")
    result, lines, text = on_virtual_ranks("poll_forever.py", capsys, "30")
    assert isinstance(result.error, DeadlockError), result.summary()
    assert result.returncode == 1 and result.wall_s < 5
    assert "SIMCOMM_IDLE_S=1" in str(result.error)
    for rank in range(2):
        assert f"rank {rank} polls with time.sleep(0.05) at {SCRIPTS / 'poll_forever.py'}:12 in <module>" \
            in str(result.error)


def test_a_poll_that_gives_up_before_the_idle_limit_fails_as_under_torchrun(capsys, monkeypatch):
    monkeypatch.setenv("SIMCOMM_IDLE_S", "30")
    result, lines, text = on_virtual_ranks("poll_forever.py", capsys, "0.5")
    assert result.returncode == 1 and result.exit_codes == [1, 1], result.summary()
    assert isinstance(result.error, RankError) and isinstance(result.error.__cause__, TimeoutError)
    # which rank gives up first depends on the clock, as under torchrun
    assert re.fullmatch(r"rank [01]: nobody wrote the flag within 0.5 s", str(result.error.__cause__))
    assert result.wall_s < 5


@pytest.mark.slow
def test_a_poll_that_gives_up_fails_under_torchrun(tmp_path):
    # both workers raise at about the same time: their tracebacks go to one pipe a piece at a time
    # ("TimeoutError", ": " and the message are separate writes) and can interleave, so the type
    # and the message are looked for apart; the message is one write
    done = launch([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(SCRIPTS / "poll_forever.py"), "0.5"],
                  tmp_path, reference=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "TimeoutError" in output and re.search(r"rank [01]: nobody wrote the flag within 0\.5 s", output), output


def test_ranks_polling_for_a_rank_that_failed_end_with_its_failure_at_once(monkeypatch):
    # as torchrun's agent stops the other workers when one fails; not after the idle limit
    monkeypatch.setenv("SIMCOMM_IDLE_S", "30")

    def program(comm):
        if comm.rank == 1:
            raise RuntimeError("rank 1 fails before writing the flag")
        while not Path("/nonexistent/flag").exists():
            time.sleep(0.05)

    started = time.monotonic()
    with pytest.raises(RankError) as info:
        simcomm.World(3, peers_run_on=True).run(program, timeout=60)
    assert info.value.rank == 1 and "fails before writing the flag" in str(info.value.__cause__)
    assert time.monotonic() - started < 5


def test_one_long_sleep_is_never_cut_short_by_the_idle_rule(monkeypatch):
    monkeypatch.setenv("SIMCOMM_IDLE_S", "0.3")

    def program(comm):
        if comm.rank == 1:
            time.sleep(0.8)
        comm.barrier()
        return comm.rank

    assert simcomm.World(3).run(program, timeout=30) == [0, 1, 2]


def test_ranks_that_work_between_short_sleeps_are_not_cut_short(monkeypatch):
    # longer than the idle limit, nobody communicates, and every rank sleeps often: but they work
    monkeypatch.setenv("SIMCOMM_IDLE_S", "1")

    def program(comm):
        end = time.monotonic() + 2.5
        while time.monotonic() < end:
            busy = time.monotonic()
            while time.monotonic() - busy < 0.05:
                pass
            time.sleep(0.001)
        comm.barrier()
        return comm.rank

    assert simcomm.World(2).run(program, timeout=30) == [0, 1]


def test_ranks_spinning_on_sleep_zero_for_a_file_nobody_writes_are_a_deadlock(monkeypatch):
    monkeypatch.setenv("SIMCOMM_IDLE_S", "0.5")

    def program(comm):
        while not Path("/nonexistent/flag").exists():
            time.sleep(0)

    started = time.monotonic()
    with pytest.raises(DeadlockError, match=r"rank 1 polls with time.sleep\(0\) at .*test_waiting.py:\d+ in program"):
        simcomm.World(2).run(program, timeout=30)
    assert time.monotonic() - started < 5


def test_the_idle_limit_must_be_a_positive_number(monkeypatch):
    monkeypatch.setenv("SIMCOMM_IDLE_S", "soon")
    with pytest.raises(ValueError, match="SIMCOMM_IDLE_S='soon' must be a positive number"):
        simcomm.World(2).run(lambda comm: None)


# -- what stays as it was -----------------------------------------------------------------------

def test_sleep_zero_lets_the_ready_ranks_run_once():
    order = []

    def program(comm):
        order.append((comm.rank, "before"))
        time.sleep(0)
        order.append((comm.rank, "after"))

    simcomm.World(3).run(program)
    assert order[:3] == [(0, "before"), (1, "before"), (2, "before")]
    assert sorted(order[3:]) == [(0, "after"), (1, "after"), (2, "after")]


def test_sleep_is_pythons_own_off_rank_threads_and_on_a_ranks_own_threads():
    assert time.sleep.__doc__ and time.sleep(0) is None
    with pytest.raises(ValueError):
        time.sleep(-1)
    slept = []

    def program(comm):
        def helper():
            started = time.monotonic()
            time.sleep(0.05)                     # a thread the rank started: a plain sleep
            slept.append(time.monotonic() - started)
        thread = threading.Thread(target=helper)
        thread.start()
        thread.join()
        with pytest.raises(TypeError):
            time.sleep("1")
        return comm.rank

    assert simcomm.World(2).run(program) == [0, 1]
    assert len(slept) == 2 and min(slept) >= 0.05


def test_a_rank_polling_its_own_thread_that_communicates_as_the_rank():
    # the rank's thread keeps the turn in a plain sleep while a thread it started communicates
    def program(comm):
        out = {}

        def worker():
            total = torch.ones(2) * (comm.rank + 1)
            dist.all_reduce(total)
            out["total"] = total.tolist()
        thread = threading.Thread(target=worker)
        thread.start()
        while thread.is_alive():
            time.sleep(0.01)
        comm.barrier()
        return out["total"]

    for world in (2, 4):
        expected = float(sum(range(1, world + 1)))
        assert simcomm.World(world).run(program, timeout=30) == [[expected, expected]] * world


def test_a_sleeping_rank_lets_a_slow_rank_finish_and_the_timeout_names_the_sleeper():
    def program(comm):
        if comm.rank == 0:
            time.sleep(30)
        comm.barrier()

    started = time.monotonic()
    with pytest.raises(RunTimeoutError) as info:
        simcomm.World(2).run(program, timeout=0.5)
    assert time.monotonic() - started < 2
    assert "rank 0 sleeps in time.sleep(30) at" in str(info.value)
    assert "rank 1 waits in barrier" in str(info.value)
