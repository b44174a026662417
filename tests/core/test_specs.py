"""simcomm.specs: one row per transport primitive, read by every module that needs its facts.

* every method of the ``Transport`` protocol has a row, and every row a method;
* the simulator's mismatch rule and checked mode's are the row's: a mismatch in each agreed
  field is caught on both, and both name the calls with the same fields;
* the bytes per peer a trace records are the row's, and they are the cost model's: nccl-tests'
  size times its busbw factor is the busiest link's bytes, and an uneven all_to_all_single's
  size is its busiest rank's bytes;
* the checks can fail: a row that drifts from either side is reported.
"""
from __future__ import annotations

import dataclasses
import datetime
import inspect
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import simcomm
from real.checked import CheckedTransport
from real.checked_calls import EXTRACTORS
from real.checked_store import Checker
from simcomm import ops
from simcomm.model import cost
from simcomm.sim import transport as sim_transport
from simcomm.sim.rendezvous import format_args
from simcomm.specs import COST_SPECS, SPECS, CollectiveSpec
from simcomm.trace import peer_bytes
from simcomm.transport import Transport

COLLECTIVES = [name for name, spec in SPECS.items() if spec.kind == "collective"]


def _protocol_methods() -> set[str]:
    return {name for name, value in vars(Transport).items() if inspect.isfunction(value) and not name.startswith("_")}


def test_every_transport_method_has_a_row_and_every_row_a_method():
    assert _protocol_methods() == set(SPECS)
    for name, spec in SPECS.items():
        assert spec.name == name
        assert spec.kind in ("collective", "p2p", "compute")
        assert spec.tensor in ("whole", "rows", "none")
        if spec.algorithms:
            assert spec.busbw is not None and spec.nccl_size in ("buffer", "output", "input"), name
        if spec.dual is not None:
            assert SPECS[spec.dual].dual == name, f"{name}'s dual {spec.dual} does not name it back"


def test_the_names_modules_read_are_the_rows():
    assert ops.COLLECTIVE_OPS == tuple(COLLECTIVES)
    assert set(ops.TRACE_OPS) == {name for name, spec in SPECS.items() if spec.traced}
    assert set(cost.ALGORITHMS) == set(ops.COST_OPS) == set(COST_SPECS)
    for name, spec in SPECS.items():
        for alias in spec.aliases:
            assert ops.canonical_op(alias) == spec.priced_as
    for name, spec in COST_SPECS.items():
        assert cost.ALGORITHMS[name] == spec.algorithms
        assert cost.busbw_factor(name, 8) == spec.busbw(8)


# -- the agreement rule: one row, read by the simulator and by checked mode ---------------------

X = torch.ones(4)
M = torch.ones(4, 2)
#: op -> (rank 0's transport arguments, rank 1's), differing in one field the row says is agreed
MISMATCHES = {
    "all_reduce": ((X, "sum"), (X, "max")),
    "all_gather": ((X, 0), (torch.ones(2), 0)),
    "reduce_scatter": ((X, 0, "sum"), (X, 0, "max")),
    "all_to_all": ((M, 0, 1), (M, 1, 0)),
    "all_to_all_single": ((M, [2, 2], [2, 2]), (torch.ones(4, 3), [2, 2], [2, 2])),
    "broadcast": ((X, 0), (torch.ones(4, dtype=torch.float64), 0)),
    "reduce": ((X, 0, "sum"), (X, 1, "sum")),
    "gather": ((X, 0, 0), (X, 1, 0)),
    "scatter": ((X, 0, 0), (None, 1, 0)),
    "subgroup": ((((0,), (1,)),), (((0, 1),),)),
}
#: the fields shown beside the agreed ones (checked mode's only): its description is longer
SHOWN_MORE = {"scatter", "all_to_all_single"}


def test_every_collective_with_fields_has_a_mismatch_case():
    assert set(MISMATCHES) == {name for name in COLLECTIVES if SPECS[name].agreed or SPECS[name].tensor != "none"}


def _sim_error(op: str) -> str:
    def program(comm):
        getattr(comm.transport, op)(*MISMATCHES[op][comm.rank])

    with pytest.raises(simcomm.CollectiveMismatchError) as caught:
        simcomm.World(2).run(program)
    return str(caught.value)


class _FakeTransport:
    """A transport that moves nothing (checked mode's checks run before the inner call)."""

    def __init__(self, rank: int, ranks: tuple[int, ...]):
        self.rank, self.ranks, self.world_size = rank, ranks, len(ranks)
        self.device = torch.device("cpu")

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: SimpleNamespace(ranks=self.ranks, rank=self.rank, world_size=2)


def _checked_error(op: str) -> str:
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=10))
    outcomes: list = [None, None]

    def body(rank: int) -> None:
        transport = CheckedTransport(_FakeTransport(rank, (0, 1)), Checker(store, rank, 2))
        try:
            getattr(transport, op)(*MISMATCHES[op][rank])
        except Exception as error:  # collected for the assertions
            outcomes[rank] = error

    threads = [threading.Thread(target=body, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(isinstance(out, simcomm.CollectiveMismatchError) for out in outcomes), outcomes
    return str(outcomes[0])


def _row_call(op: str, args: tuple, spec: CollectiveSpec | None = None) -> str:
    """``op(field=value, ...)`` of the fields the row says the ranks agree on, for these arguments."""
    spec = spec or SPECS[op]
    bound = inspect.signature(getattr(Transport, op)).bind(None, *args).arguments
    tensor = bound.get("tensor")
    values = [bound[name] for name in spec.agreed]
    fields = spec.agreed_fields(tensor.shape, tensor.dtype, *values) if spec.tensor == "whole" else \
        spec.agreed_fields(None, None, *values)
    return f"{op}({format_args(fields)})"


@pytest.mark.parametrize("op", sorted(MISMATCHES))
def test_a_mismatch_in_an_agreed_field_is_caught_by_both_rules(op):
    sim, checked = _sim_error(op), _checked_error(op)
    if op in SHOWN_MORE:
        return                   # both caught it; checked mode shows more than the agreed fields
    for args in MISMATCHES[op]:  # both name each rank's call by the row's fields, the same words
        call = _row_call(op, args)
        assert f"called {call} at" in sim, (call, sim)
        assert f"called {call} at" in checked, (call, checked)


def _rule_drift(op: str, spec: CollectiveSpec) -> list[str]:
    """Where the simulator's or checked mode's fields for ``op`` differ from ``spec``'s."""
    problems = []
    args = MISMATCHES[op][0]
    expected = _row_call(op, args, spec)
    tensor = args[0] if isinstance(args[0], torch.Tensor) else None
    sim = sim_transport._AGREED[op]
    bound = inspect.signature(getattr(Transport, op)).bind(None, *args).arguments
    values = [bound[name] for name in SPECS[op].agreed]
    sim_fields = sim(tensor.shape, tensor.dtype, *values) if tensor is not None else sim(None, None, *values)
    if f"{op}({format_args(sim_fields)})" != expected:
        problems.append(f"simulator: {format_args(sim_fields)}")
    checked = EXTRACTORS[op](*args)[0].compared
    if f"{op}({format_args(checked)})" != expected:
        problems.append(f"checked: {format_args(checked)}")
    return problems


@pytest.mark.parametrize("op", sorted(set(MISMATCHES) - SHOWN_MORE))
def test_both_rules_read_the_row(op):
    assert _rule_drift(op, SPECS[op]) == []


def test_a_send_and_its_recv_agree_on_the_rows_fields_on_both_rules():
    assert SPECS["send"].agreed_fields((2,), torch.float32) == SPECS["recv"].agreed_fields((2,), torch.float32)
    assert sim_transport._PAIRED((2,), torch.float32) == EXTRACTORS["recv"]((2,), torch.float32, 0)[0].compared
    assert EXTRACTORS["send"](torch.ones(2), 1)[0].compared == EXTRACTORS["recv"]((2,), torch.float32, 0)[0].compared

    def program(comm):
        if comm.rank == 0:
            comm.transport.send(torch.ones(2), 1)
        else:
            comm.transport.recv((2,), torch.float64, 0)

    with pytest.raises(simcomm.CollectiveMismatchError, match="send/recv mismatch"):
        simcomm.World(2).run(program)


def test_a_row_that_drifts_from_the_rules_is_reported():
    """Can fail: a row that agrees on one more (or one less) field than both sides compare."""
    spec = SPECS["reduce_scatter"]
    assert _rule_drift("reduce_scatter", dataclasses.replace(spec, agreed=spec.agreed[:1])) != []
    assert _rule_drift("reduce_scatter", dataclasses.replace(spec, tensor="none")) != []


# -- bytes per peer: the trace's and the cost model's are the row's ----------------------------

N, B = 4, 48                      # ranks, bytes of each rank's input


def _busiest_link(spec: CollectiveSpec) -> int:
    """The bytes the row's direct exchange puts on the busiest link of the algorithm NCCL runs,
    with every rank's input ``B`` bytes (scatter: the root's). A chain (broadcast, reduce: each
    link carries the buffer once) loads a non-root rank's link; the others load the busiest rank's."""
    ranks = tuple(range(N))
    totals = []
    for rank in ranks:
        sent, received = spec.peer_bytes(B, ranks, rank, root=0, out_nbytes=B // N)
        totals.append(max(sum(sent.values()), sum(received.values())))
    if spec.priced_as == "send_recv":
        return max(totals)
    chain = spec.busbw(N) == 1.0
    return min(totals) if chain else max(totals)


def _cost_link(name: str) -> float:
    return cost.nccl_size(name, B, N) * cost.busbw_factor(name, N)


@pytest.mark.parametrize("name", sorted(set(COST_SPECS) - {"all_to_all_single"}))
def test_the_rows_bytes_are_the_cost_models_busiest_link(name):
    assert _busiest_link(COST_SPECS[name]) == _cost_link(name)


def test_all_to_all_single_is_sized_from_the_traces_bytes_per_peer():
    inputs = {0: [1, 2, 3, 2], 1: [0, 0, 4, 4], 2: [2, 2, 2, 2], 3: [3, 3, 0, 2]}   # rows rank i sends j

    def program(comm):
        me = comm.rank
        expects = [inputs[j][me] for j in range(N)]
        return comm.transport.all_to_all_single(torch.ones(sum(inputs[me]), 3), expects, inputs[me])

    world = simcomm.World(N)
    world.run(program)
    events = [e for e in world.trace.events if e.op == "all_to_all_single"]
    assert len(events) == N
    for event in events:              # the trace's bytes are the row's
        assert (event.sent, event.received) == SPECS["all_to_all_single"].peer_bytes(
            event.nbytes, event.group, event.rank, args=event.args, row_bytes=12)
    busiest = max(max(sum(e.sent.values()), sum(e.received.values())) for e in events)
    assert cost.all_to_all_single_size(events) == round(busiest * N / (N - 1))


def test_every_traced_call_records_its_rows_bytes():
    def program(comm):
        x = torch.ones(4)
        comm.transport.all_reduce(x, "sum")
        comm.transport.all_gather(x, 0)
        comm.transport.reduce_scatter(x, 0, "sum")
        comm.transport.all_to_all(x, 0, 0)
        comm.transport.broadcast(x, 1)
        comm.transport.reduce(x, 1, "sum")
        comm.transport.gather(x, 1, 0)
        comm.transport.scatter(torch.ones(8) if comm.rank == 1 else None, 1, 0)
        comm.transport.barrier()
        if comm.rank == 0:
            comm.transport.send(x, 1)
        else:
            comm.transport.recv((4,), torch.float32, 0)

    world = simcomm.World(2)
    world.run(program)
    seen = set()
    for event in world.trace.events:
        seen.add(event.op)
        spec = SPECS[event.op]
        out = 4 * 4 if event.op == "scatter" and event.rank != 1 else None
        assert (event.sent, event.received) == spec.peer_bytes(
            event.nbytes, event.group, event.rank, event.root, args=event.args, out_nbytes=out), event.op
    assert seen == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "gather",
                    "scatter", "barrier", "send", "recv"}


def test_a_row_whose_bytes_drift_from_the_cost_model_is_reported():
    """Can fail: a row that moves twice the bytes NCCL's busbw accounts for."""
    spec = COST_SPECS["all_gather"]
    doubled = dataclasses.replace(spec, peers=lambda *args: tuple(
        {peer: 2 * size for peer, size in side.items()} for side in spec.peers(*args)))
    assert _busiest_link(doubled) != _cost_link("all_gather")
    assert peer_bytes("all_gather", B, (0, 1), 0) == spec.peer_bytes(B, (0, 1), 0)
