"""Point-to-point messages, barrier, and the trace every transport call leaves."""
from __future__ import annotations

import json

import torch

import simcomm
from simcomm.trace import peer_bytes


def test_send_recv_default_peers_form_a_ring():
    def program(comm):
        mine = torch.full((2,), float(comm.rank))
        if comm.rank % 2 == 0:      # even ranks send first, odd ranks receive first: no deadlock
            comm.send(mine)
            got = comm.recv((2,), torch.float32)
        else:
            got = comm.recv((2,), torch.float32)
            comm.send(mine)
        return got

    outs = simcomm.World(4).run(program)
    assert [o.tolist() for o in outs] == [[3.0, 3.0], [0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]


def test_a_pipeline_passes_activations_forward_and_gradients_back_by_hand():
    w = torch.tensor([2.0, 3.0, 5.0], dtype=torch.float64)

    def program(comm):
        weight = w[comm.rank].clone().requires_grad_()
        x = torch.ones(1, dtype=torch.float64) if comm.rank == 0 else comm.recv((1,), torch.float64)
        x = x.requires_grad_(comm.rank > 0)
        y = x * weight
        if comm.rank < comm.world_size - 1:
            comm.send(y.detach())
            grad = comm.recv((1,), torch.float64, src=comm.rank + 1)
            y.backward(grad)
        else:
            y.sum().backward()
        if comm.rank > 0:
            comm.send(x.grad, dst=comm.rank - 1)
        return weight.grad.item()

    # y = 2 * 3 * 5: d/dw0 = 15, d/dw1 = 10, d/dw2 = 6
    assert simcomm.World(3).run(program) == [15.0, 10.0, 6.0]


def test_messages_between_a_pair_arrive_in_order():
    def program(comm):
        if comm.rank == 0:
            for value in range(5):
                comm.send(torch.tensor([float(value)]), dst=1)
            return None
        return [comm.recv((1,), torch.float32, src=0).item() for _ in range(5)]

    assert simcomm.World(2).run(program)[1] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_trace_records_every_call_with_phase_step_and_bytes():
    world = simcomm.World(4)

    def program(comm):
        x = torch.ones(8, requires_grad=True)       # 32 bytes
        y = comm.all_gather(x)                       # step 0
        comm.barrier()                               # step 1
        y.sum().backward()                           # reduce_scatter, step 2, backward
        comm.compute(seconds=1e-3)

    world.run(program)
    trace = world.trace
    assert trace.ops() == [(0, "all_gather", "forward"), (1, "barrier", "forward"),
                           (2, "reduce_scatter", "backward"), (-1, "compute", "forward")]
    gather = trace.filter(op="all_gather", rank=2).events[0]
    assert gather.shape == (8,) and gather.out_shape == (32,) and gather.dtype == "float32"
    assert gather.sent == {0: 32, 1: 32, 3: 32} and gather.received == {0: 32, 1: 32, 3: 32}
    backward = trace.filter(op="reduce_scatter", rank=0).events[0]
    assert backward.phase == "backward" and backward.sent == {1: 32, 2: 32, 3: 32}  # 128 bytes / 4
    assert all(e.end >= e.start for e in trace)
    # all-gather of 32 bytes on 4 ranks: each rank sends 32 to each other rank;
    # the reduce-scatter of 128-byte gradients sends 128/4 = 32 to each other rank
    assert trace.comm_matrix() == [[0 if i == j else 64 for j in range(4)] for i in range(4)]
    assert trace.bytes_by_op() == {"all_gather": 4 * 3 * 32, "reduce_scatter": 4 * 3 * 32,
                                   "barrier": 0, "compute": 0}


def test_peer_bytes_follow_each_ops_definition():
    ranks = (0, 1, 2, 3)
    assert peer_bytes("all_reduce", 400, ranks, 1) == ({0: 200, 2: 200, 3: 200},) * 2
    assert peer_bytes("broadcast", 40, ranks, 2, root=2) == ({0: 40, 1: 40, 3: 40}, {})
    assert peer_bytes("broadcast", 40, ranks, 1, root=2) == ({}, {2: 40})
    assert peer_bytes("gather", 40, ranks, 1, root=0) == ({0: 40}, {})
    assert peer_bytes("send", 12, ranks, 1, root=3) == ({3: 12}, {})


def test_p2p_and_subgroup_calls_are_traced_with_global_ranks():
    world = simcomm.World(4)

    def program(comm):
        pair = comm.subgroup([[0, 2], [1, 3]])
        if pair.rank == 0:
            pair.send(torch.ones(3))
        else:
            pair.recv((3,), torch.float32)

    world.run(program)
    sends = world.trace.filter(op="send").events
    assert sorted((e.rank, e.sent) for e in sends) == [(0, {2: 12}), (1, {3: 12})]
    chrome = json.loads(json.dumps(world.trace.to_chrome_trace()))
    assert {e["tid"] for e in chrome["traceEvents"] if e["ph"] == "X"} == {0, 1, 2, 3}


def test_tracing_can_be_switched_off():
    world = simcomm.World(2, trace=False)
    world.run(lambda comm: comm.all_reduce(torch.ones(1)))
    assert len(world.trace) == 0


def test_an_event_built_from_a_kept_record_equals_one_built_by_the_dataclass():
    """Trace.events builds each event from the tuple a transport kept (TraceEvent.from_record): the
    same event as the dataclass's own constructor gives, the dtype's name, the bytes worked out
    from shape and dtype, the arguments as a dict, and a subclass through its own __init__."""
    import dataclasses

    from simcomm.trace import Record, TraceEvent

    def program(comm):
        comm.all_reduce(torch.ones(2, 3, dtype=torch.bfloat16))
        if comm.rank == 0:
            comm.send(torch.zeros(4), 1)
        else:
            comm.recv((4,), torch.float32, 0)
        return None

    world = simcomm.World(2)
    world.run(program)
    events = world.trace.events
    assert [e.op for e in events if e.rank == 0] == ["all_reduce", "send"]
    for event in events:
        fields = {f.name: getattr(event, f.name) for f in dataclasses.fields(TraceEvent)}
        built = TraceEvent(**fields)
        assert built == event and list(vars(built)) == list(vars(event))
        assert [type(v) for v in vars(built).values()] == [type(v) for v in vars(event).values()]
    assert {e.dtype for e in events} == {"bfloat16", "float32", None}     # a recv has no input

    class Tagged(TraceEvent):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.tag = "mine"

    record = Record("all_reduce", (0, 1), 0, 0, "forward", torch.Size([2]), torch.float16, None, 0.5, None,
                    (("op", "sum"),))
    record.end = 1.0
    plain, tagged = TraceEvent.from_record(record.kept()), Tagged.from_record(record.kept())
    assert type(tagged) is Tagged and tagged.tag == "mine"
    assert vars(plain) == {k: v for k, v in vars(tagged).items() if k != "tag"}
    assert plain.nbytes == 4 and plain.dtype == "float16" and plain.args == {"op": "sum"} and plain.shape == (2,)
