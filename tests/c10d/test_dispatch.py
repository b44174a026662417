"""Dispatch modes see the c10d ops of dist.* calls on virtual ranks as on gloo (simcomm.c10d.dispatch)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.utils._python_dispatch import TorchDispatchMode

import simcomm
from simcomm.c10d import dispatch

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "comm_debug_counts.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import comm_debug_counts  # noqa: E402
import group_names  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _plain_gloo(world_size: int, script: str = SCRIPT) -> list[dict]:
    """The script on ``world_size`` plain gloo processes (no simcomm imported): the reference."""
    env = dict(os.environ, WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    procs = [subprocess.Popen([sys.executable, script], env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(world_size)]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-2000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1].removeprefix("names ")))
    return outs


@pytest.mark.real
def test_comm_debug_mode_counts_c10d_ops_as_on_gloo():
    reference = _plain_gloo(2)
    assert reference[0]["counts"]["c10d.allreduce_"] == 2          # the reference itself counts
    got = simcomm.World(2).run(comm_debug_counts.program)
    assert got == reference


@pytest.mark.real
def test_real_workers_count_as_plain_gloo(gloo_cluster):
    """real workers put simcomm's checked process group in place of gloo's: it counts the same."""
    reference = _plain_gloo(2)
    assert gloo_cluster(2).run(comm_debug_counts.program) == reference


@pytest.mark.real
def test_group_names_and_c10d_tables_are_as_on_plain_gloo(gloo_cluster):
    """A program reads the names torch gives its groups (a local-synchronization group's hashes the
    number of groups the rank belongs to) and c10d's tables: a worker's own gloo groups, its world
    and those behind comm.subgroup and the program's groups, are not among them, in any run."""
    reference = _plain_gloo(4, group_names.__file__)
    assert reference[0]["groups"] == 4 and reference[0]["local"] != reference[0]["pair"]   # the reference itself counts
    assert simcomm.World(4).run(group_names.program) == reference
    assert simcomm.World(4).run(group_names.program, subgroup=True) == reference
    cluster = gloo_cluster(4)
    for subgroup in (False, True, False):
        assert cluster.run(group_names.program, subgroup=subgroup) == reference, subgroup


def test_comm_debug_mode_counts_on_virtual_ranks():
    got = simcomm.World(3).run(comm_debug_counts.program)
    assert got[0]["counts"] == {"c10d.allreduce_": 2, "c10d.broadcast_": 1, "c10d.allgather_": 1,
                                "c10d._allgather_base_": 1, "c10d._reduce_scatter_base_": 1, "c10d.reduce_": 1}
    assert all(out == got[0] or out["counts"] == got[0]["counts"] for out in got)
    expected = sum(torch.arange(4.0) + rank for rank in range(3)) * 3      # all_reduce twice, 3 ranks
    assert got[1]["values"][0] == expected.tolist()


class _Log(TorchDispatchMode):
    """Records each op it sees and what the tensor holds before and after the op runs."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = args[0][0].clone() if func.namespace == "c10d" else None
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":
            self.seen.append((str(func), before.tolist(), args[0][0].tolist()))
        return out


def _logged(comm):
    t = torch.full((2,), float(dist.get_rank() + 1))
    with _Log() as log:
        dist.all_reduce(t)
    return log.seen


def test_a_mode_sees_the_op_run_inside_it():
    """The collective happens inside the op, as a backend kernel's would: before it, the
    mode sees the rank's own input; after it, the sum."""
    seen = simcomm.World(2).run(_logged)
    assert seen == [[("c10d.allreduce_.default", [1.0, 1.0], [3.0, 3.0])],
                    [("c10d.allreduce_.default", [2.0, 2.0], [3.0, 3.0])]]


class _Swallow(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            future = torch.futures.Future()
            future.set_result(args[0])
            work = _create_work_from_future(future)         # answered here, complete: never issued
            return args[0], dist.Work.boxed(work)
        return func(*args, **(kwargs or {}))


def _swallowed(comm):
    t = torch.ones(2)
    with _Swallow():
        dist.all_reduce(t)
    return comm.all_reduce(torch.ones(1))      # the next collective of the group: step 0


def test_an_op_a_mode_answers_is_not_issued():
    assert [out.tolist() for out in simcomm.World(2).run(_swallowed)] == [[2.0], [2.0]]


def _deadlocked(comm):
    from torch.distributed.tensor.debug import CommDebugMode
    with CommDebugMode():
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(2))


def test_a_deadlock_under_a_mode_is_still_reported():
    with pytest.raises(simcomm.DeadlockError):
        simcomm.World(2).run(_deadlocked, timeout=30)


def _no_mode(comm):
    before = dispatch.modes_active()
    dist.all_reduce(torch.ones(2))
    return before, dispatch.modes_active()


def test_without_a_mode_no_round_trip():
    assert simcomm.World(2).run(_no_mode) == [(0, 0), (0, 0)]
