"""The Transport protocol is the contract: both transports implement it with exactly its signatures."""
from __future__ import annotations

import inspect

import pytest

from real.transport import DistTransport
from simcomm.sim.transport import SimTransport
from simcomm.transport import Transport

PRIMITIVES = [name for name, member in vars(Transport).items()
              if inspect.isfunction(member) and not name.startswith("_")]


def test_the_protocol_names_every_primitive_the_communicator_calls():
    assert {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "broadcast", "send", "recv",
            "batch_isend_irecv", "barrier", "subgroup", "compute", "reduce", "scatter",
            "all_to_all_single"} == set(PRIMITIVES)


@pytest.mark.parametrize("transport", [SimTransport, DistTransport], ids=lambda t: t.__name__)
@pytest.mark.parametrize("name", PRIMITIVES)
def test_each_transport_has_the_protocols_signature(transport, name: str):
    def parameters(function):
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]

    assert parameters(getattr(transport, name)) == parameters(getattr(Transport, name)), (
        f"{transport.__name__}.{name}{inspect.signature(getattr(transport, name))} differs from "
        f"Transport.{name}{inspect.signature(getattr(Transport, name))}")
