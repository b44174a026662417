"""The real workers' robustness: a program that destroys its default group, starts processes, a
parent killed mid-run, os.fork() after a Cluster exists, and large results.

Where a program can run on both backends, it runs on the simulator too and the outcomes are
compared; the oracle for values is the same computation in one process.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import real
import real.pickling
import simcomm

pytestmark = pytest.mark.real

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(script: str, timeout: float = 240.0, **kwargs) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter that imports this checkout."""
    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=timeout, env=env, **kwargs)


def _gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for a reaper counts as gone: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return any(line.startswith("State:") and line.split()[1] in ("Z", "X") for line in status)
    except (FileNotFoundError, ProcessLookupError):
        return True


# -- 8. destroy_process_group at the end of a program --

def _ends_with_destroy(comm):
    x = torch.arange(3.0) + 10 * dist.get_rank()
    dist.all_reduce(x)
    x = comm.subgroup([[0], [1]]).all_reduce(x)            # a group of one: x unchanged
    dist.destroy_process_group()
    return x, dist.is_initialized()


def _uses_the_default_group(comm):
    y = torch.ones(2) * (comm.rank + 1)
    dist.all_reduce(y)
    pair = dist.new_group([0, 1])
    dist.all_reduce(y, group=pair)                            # 2 * (1 + 2) = 6 on both ranks
    alone = comm.subgroup([[0], [1]]).all_reduce(torch.ones(1))
    return y, dist.is_initialized(), dist.get_world_size(), comm.all_reduce(torch.full((1,), comm.rank + 1.0) * alone)


def _destroys_on_rank_0_only(comm):
    x = torch.ones(1) * (comm.rank + 1)
    dist.all_reduce(x)
    if comm.rank == 0:
        dist.destroy_process_group()
    return x


@pytest.mark.timeout(240)
def test_a_program_ending_with_destroy_process_group_leaves_the_next_run_a_fresh_group():
    expected_x = torch.arange(3.0) * 2 + 10                # sum over ranks 0 and 1, computed here
    world = simcomm.World(2)
    with real.Cluster(2, backend="gloo", timeout=60) as cluster:
        for backend, run in (("sim", world.run), ("real", cluster.run)):
            for _ in range(2):                              # twice: the second run had a fresh group
                outs = run(_ends_with_destroy)
                for x, initialized in outs:
                    assert torch.equal(x, expected_x) and initialized is False, backend
            for y, initialized, world_size, z in run(_uses_the_default_group):
                assert torch.equal(y, torch.full((2,), 6.0)) and initialized and world_size == 2, backend
                assert torch.equal(z, torch.full((1,), 3.0)), backend
        pids = cluster.pids
        assert [x.item() for x in cluster.run(_destroys_on_rank_0_only)] == [3.0, 3.0]
        for y, initialized, world_size, z in cluster.run(_uses_the_default_group):
            assert torch.equal(y, torch.full((2,), 6.0)) and initialized and world_size == 2
        assert cluster.pids != pids                         # one rank destroyed it: fresh workers
    assert [x.item() for x in world.run(_destroys_on_rank_0_only)] == [3.0, 3.0]
    assert world.run(_uses_the_default_group)[0][2] == 2


# -- 14. a program may start processes --

def _loads_with_two_workers(comm):
    from torch.utils.data import DataLoader

    data = [torch.tensor([float(i), float(comm.rank)]) for i in range(8)]
    loader = DataLoader(data, batch_size=2, num_workers=2)
    batches = [batch for batch in loader]
    return torch.cat(batches), len(batches), __import__("multiprocessing").get_start_method()


@pytest.mark.timeout(240)
def test_a_dataloader_with_worker_processes_runs_inside_a_program():
    expected = [torch.tensor([[float(i), float(rank)] for i in range(8)]) for rank in range(2)]
    outs_sim = simcomm.World(2).run(_loads_with_two_workers)
    with real.Cluster(2, backend="gloo", timeout=120) as cluster:
        outs_real = cluster.run(_loads_with_two_workers)
        children = cluster.run(lambda comm: len(__import__("multiprocessing").active_children()))
    for outs in (outs_sim, outs_real):
        assert all(torch.equal(out[0], want) and out[1] == 4 for out, want in zip(outs, expected))
    assert children == [0, 0]                              # the loader's workers ended with it
    assert [out[2] for out in outs_real] == [out[2] for out in outs_sim]   # this process's start method


def _starts_a_sleeper(comm):
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid


def _starts_a_sleeper_then_hangs(comm, folder):
    with open(os.path.join(folder, f"sleeper{comm.rank}"), "w") as f:
        f.write(str(_starts_a_sleeper(comm)))
    time.sleep(600)


@pytest.mark.timeout(240)
def test_workers_are_not_daemonic_and_what_their_programs_leave_running_goes_with_them(tmp_path):
    with real.Cluster(2, backend="gloo", timeout=120) as cluster:
        assert cluster.run(lambda comm: __import__("multiprocessing").current_process().daemon) == [False] * 2
        assert cluster.run(lambda comm: os.getpgrp() == os.getpid()) == [True, True]   # a group of its own
        left_running = cluster.run(_starts_a_sleeper)
        assert not any(_gone(pid) for pid in left_running)
    deadline = time.monotonic() + 5                        # closed: the workers' groups are killed
    while not all(_gone(pid) for pid in left_running) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(pid) for pid in left_running)
    with real.Cluster(2, backend="gloo", timeout=120) as cluster:
        with pytest.raises(simcomm.RunTimeoutError):      # a run that times out kills the workers
            cluster.run(_starts_a_sleeper_then_hangs, str(tmp_path), timeout=15)
    sleepers = [int((tmp_path / f"sleeper{rank}").read_text()) for rank in range(2)]
    deadline = time.monotonic() + 5
    while not all(_gone(pid) for pid in sleepers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(pid) for pid in sleepers)


# -- 15. a parent killed with SIGKILL during a run --

_KILLED_MID_RUN = """
import os, sys, time, torch, real
from torch.utils.data import DataLoader

class Pids(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, index):
        return os.getpid()

def program(comm, folder):
    loader = iter(DataLoader(Pids(), num_workers=1, batch_size=1))   # a process of the program's
    child = int(next(loader))
    with open(os.path.join(folder, f"rank{comm.rank}.json"), "w") as f:
        f.write(f"[{os.getpid()}, {child}]")
    if comm.rank == 0:
        time.sleep(600)                         # waiting, the GIL released
    total = 0
    while True:                                 # busy in Python, the GIL held
        total += 1

cluster = real.Cluster(2, backend="gloo", timeout=None)
cluster.run(lambda comm: None)
print(cluster.pids, flush=True)
cluster.run(program, sys.argv[1])
"""


@pytest.mark.timeout(240)
def test_workers_stop_within_a_second_or_two_of_a_sigkilled_parent_whatever_they_run(tmp_path):
    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    parent = subprocess.Popen([sys.executable, "-c", _KILLED_MID_RUN, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        workers = json.loads(parent.stdout.readline())
        deadline = time.monotonic() + 120
        files = [tmp_path / f"rank{rank}.json" for rank in range(2)]
        while not all(f.exists() and f.read_text().endswith("]") for f in files):
            assert time.monotonic() < deadline and parent.poll() is None, "the program did not start"
            time.sleep(0.1)
        pids = [json.loads(f.read_text()) for f in files]
        assert [worker for worker, _ in pids] == workers
        children = [child for _, child in pids]
        assert not any(_gone(pid) for pid in workers + children)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    killed = time.monotonic()
    while not all(_gone(pid) for pid in workers) and time.monotonic() - killed < 10:
        time.sleep(0.05)
    assert all(_gone(pid) for pid in workers)
    assert time.monotonic() - killed < 2.0                 # about a second, on a loaded machine
    while not all(_gone(pid) for pid in children) and time.monotonic() - killed < 15:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in children)             # the DataLoader's process died too


# -- 16. os.fork() after a Cluster exists --

_FORKS = """
import json, os, sys, torch, real

def program(comm, x):
    return comm.all_reduce(x * (comm.rank + 1))

cluster = real.Cluster(2, backend="gloo", timeout=120)
assert cluster.run(program, torch.ones(1))[0].item() == 3.0
read, write = os.pipe()
pid = os.fork()
if pid == 0:                                   # the child
    os.close(read)
    report = {}
    try:
        cluster.run(program, torch.ones(1))
        report["parents"] = "ran"
    except real.WorkerError as error:
        report["parents"] = str(error)
    cluster.close()                            # does nothing to the parent's workers
    with real.Cluster(2, backend="gloo", timeout=120) as own:
        report["own"] = [t.item() for t in own.run(program, torch.ones(1) * 2)]
        report["own_parent"] = own.run(lambda comm: os.getppid())
    os.write(write, json.dumps(report).encode())
    os._exit(0)
os.close(write)
_, status = os.waitpid(pid, 0)
with os.fdopen(read) as f:
    report = json.loads(f.read() or "{}")
report["child_status"] = status
report["after"] = [t.item() for t in cluster.run(program, torch.ones(1))]
report["pids_alive"] = all(os.path.exists(f"/proc/{p}") for p in cluster.pids)
cluster.close()
print(json.dumps(report))
"""


@pytest.mark.timeout(300)
def test_after_os_fork_the_parents_cluster_names_the_fork_and_a_new_one_works():
    done = _python(_FORKS)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["child_status"] == 0
    assert "fork" in report["parents"] and "os.fork()" in report["parents"]
    assert "Make a new real.Cluster" in report["parents"]
    assert report["own"] == [6.0, 6.0]                     # 2 * (1 + 2)
    assert report["after"] == [3.0, 3.0] and report["pids_alive"]   # the parent's Cluster unharmed


# -- 17. large results travel through shared memory --

def _large_result(comm, numel):
    big = torch.arange(numel, dtype=torch.float32) + comm.rank
    return {"big": big, "view": big[5:9], "t": big.view(-1, 4).t(), "small": torch.ones(3) * comm.rank,
            "half": big.to(torch.bfloat16), "int": torch.arange(numel, dtype=torch.int64)[::3]}


@pytest.mark.timeout(240)
def test_large_results_come_back_equal_to_the_simulators_and_keep_their_views(gloo_cluster):
    numel = 3 << 20                                        # 12 MiB of float32 per rank
    outs_real = gloo_cluster(2).run(_large_result, numel)
    outs_sim = simcomm.World(2).run(_large_result, numel)
    for rank in range(2):
        want = _large_result(type("Rank", (), {"rank": rank})(), numel)   # computed here, no workers
        for got in (outs_real[rank], outs_sim[rank]):
            for key, tensor in want.items():
                assert got[key].dtype == tensor.dtype and got[key].stride() == tensor.stride(), key
                assert torch.equal(got[key], tensor), key
        real_out = outs_real[rank]
        assert real_out["view"].untyped_storage().data_ptr() == real_out["big"].untyped_storage().data_ptr()
        real_out["big"][5] = -1.0                          # still a view of it
        assert real_out["view"][0].item() == -1.0
        assert real_out["big"].untyped_storage().nbytes() == 4 * numel


def test_dumps_shared_keeps_large_storages_out_of_the_pickle():
    big, small = torch.randn(1 << 20), torch.randn(8)
    blob, fd, shared = real.pickling.dumps_shared([big, big[3:], small])
    try:
        assert fd is not None and len(blob) < 4096 and shared.layout == ((0, 4 << 20),)
        mapping = real.pickling.map_shared(fd, shared)
    finally:
        os.close(fd)
    out = real.pickling.loads_shared(blob, mapping, shared)
    del mapping                                            # the tensors keep the mapping alive
    assert torch.equal(out[0], big) and torch.equal(out[1], big[3:]) and torch.equal(out[2], small)
    assert out[1].untyped_storage().data_ptr() == out[0].untyped_storage().data_ptr()
    blob, fd, shared = real.pickling.dumps_shared([small])
    assert fd is None and shared is None and torch.equal(real.pickling.loads_shared(blob, None, None)[0], small)


_LEFT_OPEN = """
import real
cluster = real.Cluster(2, backend="gloo")
cluster.run(lambda comm: None)
print(cluster.pids, flush=True)
"""


@pytest.mark.timeout(240)
def test_an_interpreter_exits_promptly_and_takes_the_workers_of_a_cluster_never_closed():
    done = _python(_LEFT_OPEN, timeout=200)               # non-daemonic workers must not block the exit
    assert done.returncode == 0, done.stderr
    pids = json.loads(done.stdout.strip().splitlines()[-1])
    deadline = time.monotonic() + 5
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(pid) for pid in pids)
