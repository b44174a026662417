"""The scheduler's hand-off: the compiled waiter and hand-off (simcomm/sim/_handoff.c), and the
Python locks it replaces, give the same runs.

Every wait here is bounded (a thread joined with a timeout), so a regression fails, not hangs.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from simcomm.sim import scheduler

compiled = pytest.mark.skipif(scheduler.HANDOFF != "semaphore", reason="the compiled hand-off is not built here")


def test_the_compiled_hand_off_is_built_where_a_c_compiler_is():
    if not sys.platform.startswith("linux") or shutil.which("cc") is None:
        pytest.skip("no C compiler on Linux here: the scheduler keeps Python locks")
    if os.environ.get("SIMCOMM_HANDOFF") == "lock":
        pytest.skip("SIMCOMM_HANDOFF=lock picks Python locks")
    assert scheduler.HANDOFF == "semaphore", "pip install -e . should have built simcomm/sim/_handoff.c"


def _join(thread: threading.Thread, within: float = 5.0) -> None:
    thread.join(within)
    assert not thread.is_alive(), f"the thread did not end within {within} s"


@pytest.mark.parametrize("kind", ["semaphore", "lock"])
def test_a_waiter_blocks_until_another_thread_releases_it(kind):
    if kind == "semaphore" and scheduler.HANDOFF != "semaphore":
        pytest.skip("the compiled hand-off is not built here")
    new_waiter = scheduler.new_waiter if kind == "semaphore" else scheduler._locked
    waiter, woke = new_waiter(), threading.Event()

    def sleeper():
        waiter.acquire()
        woke.set()

    thread = threading.Thread(target=sleeper)
    thread.start()
    assert not woke.wait(0.2), "acquire() returned before any release()"
    waiter.release()
    assert woke.wait(5.0)
    _join(thread)


@compiled
def test_handoff_wakes_the_other_and_waits_for_its_own_release():
    from simcomm.sim._handoff import Waiter, handoff
    first, second, order = Waiter(), Waiter(), []

    def other():
        second.acquire()
        order.append("other ran")
        first.release()

    thread = threading.Thread(target=other)
    thread.start()
    time.sleep(0.05)
    handoff(second, first)        # wakes `other`, returns once `other` released `first`
    order.append("back")
    _join(thread)
    assert order == ["other ran", "back"]
    # a release before the wait is kept: the wait returns at once
    first.release()
    assert first.acquire() is True


@compiled
def test_handoff_refuses_what_is_not_a_waiter():
    from simcomm.sim._handoff import Waiter, handoff
    with pytest.raises(TypeError, match="two Waiters"):
        handoff(Waiter(), object())
    with pytest.raises(TypeError, match="two Waiters"):
        handoff(Waiter())
    with pytest.raises(TypeError):
        Waiter(1)


_PROGRAM = r"""
import json, torch, simcomm
from simcomm.sim.scheduler import HANDOFF

def program(comm):
    x = torch.randn(6, dtype=torch.float64)            # each rank's own random stream
    y = comm.all_reduce(x)
    handle = comm.all_gather(x * (comm.rank + 1), 0, async_op=True)
    while not handle.is_completed():                   # polls hand the turn on
        pass
    g = handle.wait()
    peer = (comm.rank + 1) % comm.world_size
    if comm.rank % 2 == 0:
        comm.send(y, peer)
    else:
        y = comm.recv(y.shape, y.dtype)
    return [float(y.sum()), float(g.sum()), float(torch.rand(()))]

world = simcomm.World(4)
outs = world.run(program)
order = [(e.rank, e.op) for e in world.trace.events]
print(json.dumps({"handoff": HANDOFF, "outs": outs, "order": order}))
"""


def _run_with(handoff: str | None, script: str = _PROGRAM) -> dict:
    """``script``'s last line of output (JSON) in a fresh process using ``handoff`` (None: the
    compiled one)."""
    env = dict(os.environ)
    env.pop("SIMCOMM_HANDOFF", None)
    if handoff is not None:
        env["SIMCOMM_HANDOFF"] = handoff
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@compiled
def test_a_run_is_the_same_with_either_hand_off():
    """Values, random draws and the order the ranks ran in (the trace) are equal: the hand-off
    changes how a rank is woken, not who runs when."""
    with_semaphores, with_locks = _run_with(None), _run_with("lock")
    assert with_semaphores["handoff"] == "semaphore" and with_locks["handoff"] == "lock"
    assert with_semaphores["outs"] == with_locks["outs"]
    assert with_semaphores["order"] == with_locks["order"]
    assert len(with_locks["order"]) >= 4 * 3


_MISUSE = r"""
import json, threading, time, torch, simcomm
from simcomm.sim.scheduler import HANDOFF

def deadlock(comm):
    if comm.rank == 0:
        comm.recv((2,), torch.float32, src=1)      # nobody sends
    comm.barrier()

def raises(comm):
    comm.all_reduce(torch.ones(2))
    if comm.rank == 2:
        raise ValueError("rank 2 fails")
    comm.all_reduce(torch.ones(2))

def mismatch(comm):
    comm.all_reduce(torch.ones(2 if comm.rank else 3))

def spins(comm):
    comm.all_reduce(torch.ones(2))
    deadline = time.monotonic() + 5
    while comm.rank == 1 and time.monotonic() < deadline:
        pass
    comm.all_reduce(torch.ones(2))

seen = []
for program, kwargs in ((deadlock, {}), (raises, {}), (mismatch, {}), (spins, {"timeout": 0.3})):
    started = time.monotonic()
    try:
        simcomm.World(4).run(program, **kwargs)
        seen.append(["returned", 0.0])
    except Exception as error:
        seen.append([type(error).__name__, time.monotonic() - started])
deadline = time.monotonic() + 8
while any(t.name.startswith("simcomm-rank") for t in threading.enumerate()) and time.monotonic() < deadline:
    time.sleep(0.05)
left = [t.name for t in threading.enumerate() if t.name.startswith("simcomm-rank")]
print(json.dumps({"handoff": HANDOFF, "seen": seen, "left": left}))
"""


@compiled
def test_errors_reach_every_rank_with_either_hand_off():
    """A deadlock, a rank's error, a mismatch and a timeout end the run with the same error
    either way, at once (a timeout within its limit), and no rank thread is left: an abort
    wakes the ranks blocked in the hand-off."""
    results = {handoff: _run_with(handoff, _MISUSE) for handoff in (None, "lock")}
    for result in results.values():
        names = [name for name, _ in result["seen"]]
        assert names == ["DeadlockError", "RankError", "CollectiveMismatchError", "RunTimeoutError"], result
        assert all(seconds < 5 for _, seconds in result["seen"]), result
        assert result["left"] == [], result
    assert results[None]["handoff"] == "semaphore" and results["lock"]["handoff"] == "lock"
