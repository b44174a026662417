"""The simulator under misuse: communicators outside their run or thread, timeouts, odd arguments.

Every test here bounds its own wait (a thread with a join timeout), so a
regression shows as a failure, not as a hung test session.
"""
from __future__ import annotations

import math
import signal
import threading
import time

import pytest
import torch

import simcomm
from simcomm import RankError, RunTimeoutError
from simcomm.errors import CommunicatorClosedError, SimcommError, WrongThreadError
from simcomm.errors import Aborted

from ..foreign_thread import ForeignThread


def rank_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("simcomm-rank") and t.is_alive()]


def wait_for_stuck_threads(within: float = 8.0) -> None:
    """Let rank threads that could not be stopped finish their sleep (so later tests start clean)."""
    deadline = time.monotonic() + within
    while rank_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rank_threads() == [], "a stuck rank thread did not end after its sleep"


def call_bounded(function, *, within: float = 10.0):
    """Run ``function`` on a helper thread; return what it returned or raised, or fail if it
    has not ended within ``within`` seconds (the defect these tests guard against is a hang)."""
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = function()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(within)
    assert not thread.is_alive(), f"the call did not return within {within} s (it hangs)"
    return outcome


# -- a communicator after its run --------------------------------------------------------------

def test_backward_of_a_returned_output_after_the_run_raises_at_once():
    outs = simcomm.World(4).run(lambda comm: comm.all_gather(torch.ones(2, requires_grad=True), 0))
    outcome = call_bounded(lambda: outs[0].sum().backward())
    error = outcome.get("error")
    assert isinstance(error, CommunicatorClosedError), outcome
    message = str(error)
    assert "reduce_scatter on rank 0" in message and "has ended" in message and ".detach()" in message


def test_communicator_kept_from_a_finished_run_raises_at_once():
    kept = []
    simcomm.World(2).run(lambda comm: kept.append(comm))
    outcome = call_bounded(lambda: kept[1].all_reduce(torch.ones(3)))
    assert isinstance(outcome.get("error"), CommunicatorClosedError), outcome
    assert "all_reduce on rank 1" in str(outcome["error"])
    outcome = call_bounded(lambda: kept[0].send(torch.ones(1), dst=1))
    assert isinstance(outcome.get("error"), CommunicatorClosedError), outcome


def test_communicator_kept_from_a_failed_run_raises_a_public_error():
    kept = []

    def program(comm):
        kept.append(comm)
        if comm.rank == 1:
            raise KeyError("boom")
        comm.barrier()

    with pytest.raises(RankError):
        simcomm.World(2).run(program)
    outcome = call_bounded(lambda: kept[0].all_reduce(torch.ones(1)))
    error = outcome.get("error")
    assert isinstance(error, Exception) and isinstance(error, SimcommError), outcome
    assert isinstance(error, CommunicatorClosedError)


# -- a communicator on a thread that is not its rank's ---------------------------------------------

def test_communicator_used_from_a_thread_no_rank_started_is_a_clear_error_naming_rank_and_op():
    helper = ForeignThread("my-helper")     # started here, before the run: no rank's thread

    def program(comm):
        outcome = helper.call(lambda: comm.all_reduce(torch.ones(2)))
        return type(outcome.get("error")).__name__

    try:
        outcome = call_bounded(lambda: simcomm.World(2).run(program))
    finally:
        helper.close()
    error = outcome.get("error")
    assert isinstance(error, RankError), outcome
    assert isinstance(error.__cause__, WrongThreadError)
    message = str(error.__cause__)
    assert "all_reduce on rank 0" in message and "'my-helper'" in message
    assert "must be used on its rank's thread" in message
    assert rank_threads() == []


def test_communicator_used_from_a_thread_the_rank_started_is_the_ranks():
    def program(comm):
        seen = {}
        thread = threading.Thread(target=lambda: seen.update(out=comm.all_reduce(torch.full((2,), comm.rank + 1.0))),
                                  name="my-helper")
        thread.start()
        thread.join(5)
        assert not thread.is_alive(), "the helper thread hangs"
        return seen["out"]

    outcome = call_bounded(lambda: simcomm.World(2).run(program))
    assert [out.tolist() for out in outcome["value"]] == [[3.0, 3.0]] * 2, outcome


def test_communicator_of_another_rank_used_on_a_rank_thread():
    comms = {}

    def program(comm):
        comms[comm.rank] = comm
        comm.barrier()
        if comm.rank == 0:
            comms[1].all_reduce(torch.ones(1))
        comm.barrier()

    outcome = call_bounded(lambda: simcomm.World(2).run(program))
    error = outcome.get("error")
    assert isinstance(error, RankError) and error.rank == 0, outcome
    assert isinstance(error.__cause__, WrongThreadError)
    assert "communicator of rank 1 was used from thread 'simcomm-rank-0'" in str(error.__cause__)


# -- timeouts -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_timeout_raises_promptly_names_where_ranks_are_and_which_could_not_be_stopped():
    # a wait in a C call (here a lock's) holds the turn and cannot be interrupted
    def program(comm):
        if comm.rank == 1:
            threading.Event().wait(2.5)
        comm.barrier()

    start = time.perf_counter()
    with pytest.raises(RunTimeoutError) as info:
        simcomm.World(3).run(program, timeout=0.5)
    elapsed = time.perf_counter() - start
    message = str(info.value) + "\n".join(getattr(info.value, "__notes__", []))
    assert elapsed < 0.5 + simcomm.sim.world.STOP_GRACE_S + 1.0, f"took {elapsed:.2f} s"
    assert "rank 1 computes at" in message and "in program" in message
    assert "rank 0 waits in barrier" in message
    assert "rank 2 never started" in message and "<unknown location>" not in message
    assert "could not be stopped" in message and "rank 1 at" in message
    # the waiting thread never holds up the next run
    start = time.perf_counter()
    assert simcomm.World(3).run(lambda comm: comm.all_reduce(torch.ones(1)).item()) == [3.0] * 3
    assert time.perf_counter() - start < 2.0
    wait_for_stuck_threads()


def test_timeout_stops_a_sleeping_rank_promptly_and_the_others_ran_meanwhile():
    # time.sleep hands the turn on, as a sleeping process leaves the CPU (simcomm.sim.waiting):
    # rank 2 runs meanwhile, and the sleeper is stopped within the timeout's grace
    def program(comm):
        if comm.rank == 1:
            time.sleep(2.5)
        comm.barrier()

    start = time.perf_counter()
    with pytest.raises(RunTimeoutError) as info:
        simcomm.World(3).run(program, timeout=0.5)
    elapsed = time.perf_counter() - start
    message = str(info.value) + "\n".join(getattr(info.value, "__notes__", []))
    assert elapsed < 0.5 + 1.0, f"took {elapsed:.2f} s"
    assert "rank 1 sleeps in time.sleep(2.5) at" in message and "in program" in message
    assert "rank 0 waits in barrier" in message and "rank 2 waits in barrier" in message
    assert "could not be stopped" not in message
    assert rank_threads() == []


def test_timeout_stops_a_spinning_rank():
    def program(comm):
        if comm.rank == 0:
            while True:
                pass
        comm.barrier()

    start = time.perf_counter()
    with pytest.raises(RunTimeoutError) as info:
        simcomm.World(2).run(program, timeout=0.3)
    assert time.perf_counter() - start < 0.3 + simcomm.sim.world.STOP_GRACE_S + 1.0
    assert not getattr(info.value, "__notes__", None), "a spinning rank can be stopped"
    assert rank_threads() == []


def test_ctrl_c_reaches_the_caller_promptly_and_stops_a_sleeping_rank():
    # time.sleep on a rank hands the turn on and sleeps in short pieces: Ctrl-C stops it at once
    def program(comm):
        if comm.rank == 0:
            time.sleep(2.5)
        comm.barrier()

    main = threading.main_thread().ident
    timer = threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT))
    start = time.perf_counter()
    timer.start()
    with pytest.raises(KeyboardInterrupt) as info:
        simcomm.World(2).run(program)
    elapsed = time.perf_counter() - start
    timer.join()
    assert elapsed < 0.3 + 1.0, f"took {elapsed:.2f} s"
    assert not getattr(info.value, "__notes__", None), "a sleeping rank can be stopped"
    assert rank_threads() == []
    assert simcomm.World(2).run(lambda comm: comm.all_reduce(torch.ones(1)).item()) == [2.0, 2.0]


def test_timeout_ends_the_run_when_the_interrupt_lands_while_the_rank_holds_the_lock():
    # The interrupt that stops the rank holding the turn may land anywhere, also just after
    # its thread took the scheduler's lock (lock_for); that thread then unwinds holding the
    # lock. This program does so on purpose: the run still ends with the timeout's error in
    # time, and nothing is left running.
    def program(comm):
        if comm.rank == 0:
            try:
                while True:
                    pass
            except Aborted:
                comm.transport.state.lock.acquire()   # taken, never released by the program
                raise
        comm.barrier()

    outcome = call_bounded(lambda: simcomm.World(4).run(program, timeout=0.2), within=20.0)
    assert isinstance(outcome.get("error"), RunTimeoutError), outcome
    assert not getattr(outcome["error"], "__notes__", None), "every rank could be stopped"
    assert simcomm.World(4).run(lambda comm: comm.all_reduce(torch.ones(1)).item()) == [4.0] * 4
    assert rank_threads() == []


@pytest.mark.slow
def test_timeout_of_a_collective_loop_raises_every_time():
    # 8 ranks in an endless all_reduce loop, stopped by the timeout over and over: every run
    # raises RunTimeoutError and returns (the interrupt once landed inside the scheduler's
    # lock and the run hung in about one run of 60). benchmarks/timeout_loop.py: 1000 runs.
    def program(comm):
        x = torch.ones(4)
        while True:
            x = comm.all_reduce(x) / comm.world_size

    world = simcomm.World(8)
    outcomes: dict[str, int] = {}
    for _ in range(300):
        outcome = call_bounded(lambda: world.run(program, timeout=0.01), within=20.0)
        name = type(outcome.get("error")).__name__
        outcomes[name] = outcomes.get(name, 0) + 1
    assert outcomes == {"RunTimeoutError": 300}
    assert rank_threads() == []


def test_timeout_message_groups_ranks_that_never_started():
    def program(comm):
        deadline = time.monotonic() + 10
        while comm.rank == 0 and time.monotonic() < deadline:   # rank 0 keeps the turn
            pass

    with pytest.raises(RunTimeoutError) as info:
        simcomm.World(500, trace=False).run(program, timeout=0.3)
    message = str(info.value)
    assert "ranks [1-499] (499 ranks) never started" in message
    assert "rank 0 computes at" in message and len(message) < 1000
    # the interrupted rank unwinds as soon as it gets a core (on a loaded machine that can be after
    # the error is raised); it would spin for 10 s had the interrupt not reached it
    wait_for_stuck_threads(within=8.0)


def test_timeout_inf_is_no_timeout_and_nan_or_negative_is_rejected():
    world = simcomm.World(2)
    assert world.run(lambda comm: comm.all_reduce(torch.ones(1)).item(), timeout=math.inf) == [2.0, 2.0]
    for bad in (math.nan, -1.0):
        with pytest.raises(ValueError, match="timeout="):
            world.run(lambda comm: None, timeout=bad)
    with pytest.raises(TypeError, match="timeout="):
        world.run(lambda comm: None, timeout="1")
    assert rank_threads() == []


# -- the deadlock message at scale -----------------------------------------------------------------

def test_deadlock_message_groups_ranks_waiting_in_the_same_place():
    world_size = 4000

    def program(comm):
        if comm.rank != 3:
            comm.all_reduce(torch.ones(1))

    with pytest.raises(simcomm.DeadlockError) as info:
        simcomm.World(world_size, trace=False).run(program)
    message = str(info.value)
    assert len(message) < 4000, f"{len(message)} characters"
    assert "ranks [0-2, 4-3999] (3999 ranks) wait in all_reduce(step 0, group [0-3999])" in message
    assert "for ranks [3]" in message and "rank 3 has finished its program" in message


def test_deadlock_message_of_a_send_ring_is_short():
    def program(comm):
        comm.send(torch.ones(2))     # every rank sends first: nobody receives
        comm.recv((2,), torch.float32)

    with pytest.raises(simcomm.DeadlockError) as info:
        simcomm.World(1000, trace=False).run(program)
    message = str(info.value)
    assert len(message) < 2000, f"{len(message)} characters"
    assert "ranks [0-999] (1000 ranks) wait in send (float32 (2,)), each to rank r+1 (mod 1000)" in message


def test_format_ranks_is_short_for_any_list():
    from simcomm.reports import format_ranks
    assert format_ranks([3]) == "[3]"
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "[0-2, 5, 7, 8]"
    assert len(format_ranks(range(0, 100000, 2))) < 120


# -- arguments are each rank's own ------------------------------------------------------------------

def test_each_rank_gets_its_own_copy_of_tensor_arguments():
    x = torch.zeros(4)
    nested = {"a": [torch.zeros(2)], "b": (torch.zeros(1),)}

    def program(comm, x, nested):
        x[comm.rank] = 1.0 + comm.rank          # in place, on this rank's copy only
        nested["a"][0].add_(comm.rank)
        comm.barrier()
        return x.clone(), nested["a"][0].clone()

    outs = simcomm.World(4).run(program, x, nested=nested)
    for rank, (mine, inner) in enumerate(outs):
        expected = torch.zeros(4)
        expected[rank] = 1.0 + rank
        assert torch.equal(mine, expected), (rank, mine)
        assert torch.equal(inner, torch.full((2,), float(rank)))
    assert torch.equal(x, torch.zeros(4)) and torch.equal(nested["a"][0], torch.zeros(2))


@pytest.mark.parametrize("tensors", ["real", "shape"])
def test_each_rank_gets_its_own_copy_of_mutable_arguments(tensors):
    # a real process unpickles its own list, dict and object: a rank's edit is its own
    class Box:
        def __init__(self):
            self.items = []

    seen, config, box = [], {"steps": 1}, Box()

    def program(comm, seen, config, box):
        seen.append(comm.rank)
        config["steps"] += comm.rank
        box.items.append(comm.rank)
        comm.barrier()
        return list(seen), dict(config), list(box.items)

    outs = simcomm.World(4, tensors=tensors).run(program, seen, config, box)
    assert outs == [([r], {"steps": 1 + r}, [r]) for r in range(4)]
    assert seen == [] and config == {"steps": 1} and box.items == []


def test_argument_copies_keep_leaves_dtypes_and_shared_storage():
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    base = torch.arange(6.0)
    view = base[2:4]

    def program(comm, w, base, view):
        (w * (comm.rank + 1)).sum().backward()
        base[2] = -1.0                           # the view shares this rank's storage, as after unpickling
        return w.is_leaf, w.dtype, w.grad.clone(), view[0].item()

    outs = simcomm.World(2).run(program, w, base, view)
    for rank, (leaf, dtype, grad, seen) in enumerate(outs):
        assert leaf and dtype == torch.float64
        assert torch.equal(grad, torch.full((3,), float(rank + 1), dtype=torch.float64))
        assert seen == -1.0
    assert w.grad is None and base[2].item() == 2.0


def test_modules_are_copied_per_rank():
    model = torch.nn.Linear(2, 1)

    def program(comm, model):
        model(torch.ones(1, 2)).sum().backward()
        with torch.no_grad():
            model.weight.add_(comm.rank)
        return model.weight.clone(), model.weight.grad.clone()

    before = model.weight.detach().clone()
    outs = simcomm.World(2).run(program, model)
    for rank, (weight, grad) in enumerate(outs):
        assert torch.equal(weight, before + rank)
        assert torch.equal(grad, torch.ones(1, 2))      # not accumulated over ranks
    assert torch.equal(model.weight.detach(), before) and model.weight.grad is None


def test_non_leaf_argument_that_requires_grad_is_rejected_naming_it():
    w = torch.ones(2, requires_grad=True) * 2
    with pytest.raises(ValueError, match=r"argument args\[1\]\['w'\] requires grad and is not a leaf"):
        simcomm.World(2).run(lambda comm, x, params: None, torch.ones(1), {"w": w})


# -- errors that cannot be printed ---------------------------------------------------------------

class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no str for you")


def test_rank_error_survives_an_exception_whose_str_raises():
    def program(comm):
        if comm.rank == 1:
            raise _Unprintable()
        comm.barrier()

    with pytest.raises(RankError) as info:
        simcomm.World(2).run(program)
    assert info.value.rank == 1 and isinstance(info.value.__cause__, _Unprintable)
    assert "rank 1 raised _Unprintable" in str(info.value)


# -- autograd on the rank's own thread -----------------------------------------------------------

def test_rank_threads_run_backward_on_their_own_thread():
    outs = simcomm.World(2).run(lambda comm: torch._C._is_multithreading_enabled())
    assert outs == [False, False]
    assert torch._C._is_multithreading_enabled()   # the caller's setting is untouched
