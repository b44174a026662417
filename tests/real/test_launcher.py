"""real.run and real.Cluster: programs by value, errors within the timeout, nothing left behind."""
from __future__ import annotations

import json
import math
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

import real
import real.startup
import real.worker
import simcomm

pytestmark = pytest.mark.real


def _children() -> list[int]:
    """Live (not zombie) processes whose parent is this test process, read from /proc."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if int(fields.get("PPid", "0")) == me and not fields.get("State", "").strip().startswith("Z"):
            found.append(int(entry))
    return found


def _listening(port: int, address: str | None = None) -> bool:
    """Whether a socket of this machine listens on ``port`` (IPv4 or IPv6; at ``address``, the
    hex form /proc/net/tcp uses, when given)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.readlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            host, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port and address in (None, host):
                return True
    return False


def _listening_addresses(pid: int) -> list[str]:
    """``host:port`` (hex, as /proc/net/tcp writes them) of the sockets process ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    found.append(fields[1])
    return found


def _assert_nothing_left(pids: list[int], port: int | None) -> None:
    assert not set(pids) & {child.pid for child in multiprocessing.active_children()}
    assert not set(pids) & set(_children())
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
    if port is not None:
        assert not _listening(port)


@pytest.mark.timeout(120)
def test_run_ships_a_closure_and_returns_cpu_tensors():
    scale = torch.tensor([2.0, 3.0])            # captured by the closure, travels by value

    def program(comm, offset, *, power):
        x = (scale * (comm.rank + offset)) ** power
        return {"sum": comm.all_reduce(x), "rank": comm.rank, "nested": [x.requires_grad_()]}

    outs = real.run(program, 1.0, world_size=2, backend="gloo", power=2)
    assert isinstance(outs, list) and len(outs) == 2
    total = (scale * 1.0) ** 2 + (scale * 2.0) ** 2
    for rank, out in enumerate(outs):
        assert out["rank"] == rank and torch.equal(out["sum"], total)
        assert out["sum"].device.type == "cpu" and not out["nested"][0].requires_grad
    assert len(outs.trace.filter(op="all_reduce")) == 2
    _assert_nothing_left([], None)


def _raises_on_rank_one(comm):
    if comm.rank == 1:
        raise KeyError("no such shard on purpose")
    return comm.all_reduce(torch.ones(3))              # rank 0 waits here for rank 1, forever


def _hangs_on_rank_one(comm):
    comm.barrier()
    if comm.rank == 1:
        time.sleep(600)
    return comm.rank


def _dies_on_rank_zero(comm):
    if comm.rank == 0:
        os._exit(3)
    return comm.all_reduce(torch.ones(1))


def _same_error_everywhere(comm):
    return comm.reduce_scatter(torch.ones(3), dim=0)


@pytest.fixture(scope="module")
def cluster(gloo_cluster):
    running = gloo_cluster(2, timeout=30)
    running.run(lambda comm: None)                      # workers up before the timed tests
    return running


@pytest.mark.timeout(60)
def test_raising_rank_gives_rank_error_with_its_traceback(cluster):
    pids, port = cluster.pids, cluster._store.port
    start = time.monotonic()
    with pytest.raises(simcomm.RankError) as info:
        cluster.run(_raises_on_rank_one)
    assert time.monotonic() - start < 10
    error = info.value
    assert error.rank == 1 and isinstance(error.__cause__, KeyError)
    assert "no such shard on purpose" in str(error)
    assert "_raises_on_rank_one" in str(error) and "real/test_launcher.py" in str(error)
    assert 'raise KeyError("no such shard on purpose")' in str(error)   # the source line of rank 1
    _assert_nothing_left(pids, port)


@pytest.mark.timeout(60)
def test_hanging_rank_times_out_naming_it_and_cluster_recovers(cluster):
    cluster.run(lambda comm: None)
    pids, port = cluster.pids, cluster._store.port
    start = time.monotonic()
    with pytest.raises(simcomm.RunTimeoutError) as info:
        cluster.run(_hangs_on_rank_one, timeout=2.0)
    elapsed = time.monotonic() - start
    assert 2.0 <= elapsed < 10
    message = str(info.value)
    assert "ranks still waiting: [1]" in message and "finished: [0]" in message
    assert "_hangs_on_rank_one" in message                             # where rank 1 is stuck
    _assert_nothing_left(pids, port)
    assert list(cluster.run(lambda comm: comm.all_reduce(torch.ones(1)).item())) == [2.0, 2.0]


@pytest.mark.timeout(60)
def test_dead_worker_and_errors_on_every_rank(cluster):
    cluster.run(lambda comm: None)
    pids = cluster.pids
    with pytest.raises(real.WorkerError, match="rank 0 exited with code 3"):
        cluster.run(_dies_on_rank_zero)
    _assert_nothing_left(pids, None)


@pytest.mark.timeout(60)
def test_same_error_on_every_rank_keeps_the_workers(cluster):
    cluster.run(lambda comm: comm.barrier())
    pids = cluster.pids
    with pytest.raises(simcomm.RankError) as info:
        cluster.run(_same_error_everywhere)
    assert isinstance(info.value.__cause__, ValueError)
    assert "reduce_scatter" in str(info.value) and "not divisible by the world size 2" in str(info.value)
    assert info.value.rank in (0, 1) and len(info.value.others) == 1
    assert cluster.pids == pids                          # every collective completed: workers reused
    assert list(cluster.run(lambda comm: comm.all_reduce(torch.ones(1)).item())) == [2.0, 2.0]
    assert cluster.pids == pids


@pytest.mark.timeout(60)
def test_further_runs_cost_milliseconds(cluster):
    cluster.run(lambda comm: None)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        outs = cluster.run(lambda comm, x: comm.all_reduce(x), torch.ones(4))
        times.append(time.perf_counter() - start)
        assert torch.equal(outs[1], torch.full((4,), 2.0))
    assert statistics.median(times) < 0.3, times


def _prints(comm):
    print(f"rank {comm.rank} says hi")
    print("no newline at the end", end="")
    return comm.rank


@pytest.mark.timeout(60)
def test_prints_come_back_tagged_with_the_rank(cluster, capsys):
    assert cluster.run(_prints) == [0, 1]
    assert capsys.readouterr().out == (
        "[rank 0] rank 0 says hi\n[rank 0] no newline at the end\n"
        "[rank 1] rank 1 says hi\n[rank 1] no newline at the end\n")


@pytest.mark.timeout(60)
def test_close_leaves_nothing_and_a_later_run_starts_fresh_workers(cluster):
    c = cluster                                          # the module's cluster, closed last
    assert c.run(lambda comm: comm.world_size) == [2, 2]
    pids, port = c.pids, c._store.port
    assert _listening(port) and _listening(port, "0100007F")           # the store: loopback only
    assert not _listening(port, "00000000") and not _listening(port, "00000000000000000000000000000000")
    c.run(lambda comm: comm.subgroup([[0], [1]]).barrier())              # gloo's own sockets too
    for pid in pids:
        addresses = _listening_addresses(pid)
        assert addresses and all(a.startswith("0100007F:") for a in addresses), addresses
    c.close()
    _assert_nothing_left(pids, port)
    assert c.run(lambda comm: comm.rank) == [0, 1]              # re-running after close works
    assert not set(c.pids) & set(pids)
    c.close()
    _assert_nothing_left(c.pids, None)


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size=0"):
        real.Cluster(0)
    with pytest.raises(ValueError, match="backend='mpi'"):
        real.Cluster(2, backend="mpi")
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="needs one GPU per local rank"):
            real.Cluster(64, backend="nccl")


# -- concurrency, threads and dead workers --------------------------------------------------

def _echo(comm, value):
    return comm.all_reduce(torch.tensor([float(value)])).item() / comm.world_size


@pytest.mark.timeout(120)
def test_runs_from_several_threads_each_get_their_own_results(cluster):
    cluster.run(lambda comm: None)
    got: dict[int, list] = {}

    def caller(value: int) -> None:
        got[value] = [cluster.run(_echo, value) for _ in range(4)]

    threads = [threading.Thread(target=caller, args=(value,)) for value in (10, 20, 30)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(100)
    assert got == {value: [[float(value)] * 2] * 4 for value in (10, 20, 30)}


@pytest.mark.timeout(120)
def test_workers_outlive_the_thread_that_started_them(cluster):
    cluster.close()                                      # the next run starts fresh workers ...
    started: list = []
    thread = threading.Thread(target=lambda: started.append((cluster.run(_echo, 3), cluster.pids)))
    thread.start()                                       # ... from a short-lived thread
    thread.join(100)
    assert started and started[0][0] == [3.0, 3.0]
    time.sleep(0.5)
    assert all(os.path.exists(f"/proc/{pid}") for pid in started[0][1])
    assert cluster.run(_echo, 4) == [4.0, 4.0] and cluster.pids == started[0][1]


@pytest.mark.timeout(120)
def test_a_worker_that_died_between_runs_is_replaced(cluster):
    cluster.run(lambda comm: None)
    pids = cluster.pids
    os.kill(pids[1], signal.SIGKILL)
    for _ in range(100):
        if not cluster._workers[1].process.is_alive():
            break
        time.sleep(0.05)
    with pytest.warns(RuntimeWarning, match="rank 1 exited with code -9 between runs"):
        assert cluster.run(_echo, 5) == [5.0, 5.0]
    assert not set(cluster.pids) & set(pids)


@pytest.mark.timeout(120)
def test_gloo_listens_on_loopback_whatever_the_environment_says(monkeypatch):
    external = [name for name in os.listdir("/sys/class/net") if name != "lo"] if os.path.isdir(
        "/sys/class/net") else []
    if not external:
        pytest.skip("no network interface besides loopback")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", external[0])
    with real.Cluster(2, backend="gloo", timeout=30) as c:
        c.run(lambda comm: comm.subgroup([[0], [1]]).barrier())
        for pid in c.pids:
            addresses = _listening_addresses(pid)
            assert addresses and all(a.startswith("0100007F:") for a in addresses), addresses


@pytest.mark.timeout(60)
def test_timeout_inf_means_none_and_nan_or_negative_are_refused(cluster):
    assert cluster.run(_echo, 1, timeout=math.inf) == [1.0, 1.0]
    for bad in (math.nan, -1.0, 0):
        with pytest.raises(ValueError, match=f"timeout={bad}"):
            cluster.run(_echo, 1, timeout=bad)
        with pytest.raises(ValueError, match=f"timeout={bad}"):
            real.Cluster(2, backend="gloo", timeout=bad)


# -- results and exceptions that do not travel well -----------------------------------------

@pytest.mark.timeout(60)
def test_a_result_that_cannot_be_unpickled_here_names_its_rank(cluster):
    parent = os.getpid()

    def rebuild(pid):
        if os.getpid() == pid:
            raise LookupError("this object cannot be rebuilt in the parent")
        return "rebuilt"

    class Stubborn:
        def __reduce__(self):
            return rebuild, (parent,)

    cluster.run(lambda comm: None)
    pids = cluster.pids
    with pytest.raises(real.ResultError, match="result of rank 1 could not be unpickled") as info:
        cluster.run(lambda comm: Stubborn() if comm.rank == 1 else comm.rank)
    assert isinstance(info.value.__cause__, LookupError)
    assert cluster.pids == pids and cluster.run(_echo, 2) == [2.0, 2.0]


class _BadStr(Exception):
    def __str__(self):
        raise RuntimeError("no text for this one")


def _raises_bad_str(comm):
    raise _BadStr()


@pytest.mark.timeout(60)
def test_an_exception_whose_str_raises_is_reported(cluster):
    with pytest.raises(simcomm.RankError) as info:
        cluster.run(_raises_bad_str)
    assert isinstance(info.value.__cause__, real.RemoteError)
    assert "_BadStr" in str(info.value) and "_raises_bad_str" in str(info.value.__cause__.__cause__)
    assert cluster.run(_echo, 2) == [2.0, 2.0]


# -- random numbers and start-up -------------------------------------------------------------

def _draws(comm, reseed):
    first = torch.rand(3)
    torch.manual_seed(reseed)                         # does not leak into the next run
    return first


@pytest.mark.timeout(60)
def test_every_run_draws_from_the_seed_virtual_ranks_start_from(cluster, monkeypatch):
    """Rank r starts every run from torch.manual_seed(S + r), S the run seed, as virtual rank r does."""
    from simcomm.fresh_state import DEFAULT_RUN_SEED, SEED_VARIABLE

    for run_seed, variable in ((DEFAULT_RUN_SEED, None), (41, "41")):
        if variable is None:
            monkeypatch.delenv(SEED_VARIABLE, raising=False)
        else:
            monkeypatch.setenv(SEED_VARIABLE, variable)
        expected = [torch.rand(3, generator=torch.Generator().manual_seed(run_seed + rank)) for rank in range(2)]
        for reseed in (1, 2):
            outs = cluster.run(_draws, reseed)
            assert all(torch.equal(out, want) for out, want in zip(outs, expected, strict=True)), (outs, expected)
        assert torch.equal(simcomm.World(2).run(_draws, 3)[1], expected[1])     # sim == real


@pytest.mark.timeout(60)
def test_a_slow_start_is_announced_on_stderr_in_interactive_use(cluster, capsys, monkeypatch):
    context, _ = real.startup.worker_context("forkserver")
    monkeypatch.setattr(real.startup, "worker_context", lambda method: (context, " (slow on purpose)"))
    cluster.close()
    assert cluster.run(_echo, 1) == [1.0, 1.0]                 # not interactive: nothing written
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    cluster.close()
    assert cluster.run(_echo, 1) == [1.0, 1.0]
    captured = capsys.readouterr()
    assert captured.err == "real.Cluster: starting 2 gloo worker processes (slow on purpose)\n"
    assert captured.out == ""


_KILLED_PARENT = """
import sys, time, torch, real
cluster = real.Cluster(2, backend="gloo")
cluster.run(lambda comm: None)
print(cluster.pids, cluster._tmpdir, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_kill_9_of_the_parent_takes_its_workers_and_its_folder_is_cleaned_later():
    parent = subprocess.Popen([sys.executable, "-c", _KILLED_PARENT], stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline()
        pids_text, tmpdir = line.rsplit(" ", 1)
        pids, tmpdir = json.loads(pids_text), tmpdir.strip()
        assert os.path.isdir(tmpdir) and all(os.path.exists(f"/proc/{pid}") for pid in pids)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    assert os.path.isdir(tmpdir)                          # a killed parent cannot remove its folder
    mine = tempfile.mkdtemp(prefix=f"simcomm-real-{os.getpid()}-")   # a live owner's folder stays
    try:
        removed = real.startup.clean_stale_tmpdirs()
        assert tmpdir in removed and not os.path.exists(tmpdir) and os.path.isdir(mine)
    finally:
        os.rmdir(mine)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.timeout(120)
def test_arguments_land_on_the_rank_device_and_cuda_starts_only_in_workers():
    outs = real.run(lambda comm, x: (str(x.device), str(comm.device), torch.rand(2, device=comm.device)),
                    torch.ones(2), world_size=1, backend="nccl")
    assert outs[0][0] == outs[0][1] == "cuda:0"
    assert not torch.cuda.is_initialized()               # the parent never touched CUDA
    from simcomm.fresh_state import run_seed
    generator = torch.Generator(device="cuda").manual_seed(run_seed())
    assert torch.equal(outs[0][2], torch.rand(2, device="cuda", generator=generator).cpu())


@pytest.mark.timeout(60)
def test_workers_are_forked_by_a_forkserver_not_by_this_process(cluster):
    parents = cluster.run(lambda comm: os.getppid())
    assert len(set(parents)) == 1 and parents[0] != os.getpid()   # no thread of ours owns them
