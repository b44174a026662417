"""Memory per rank (simcomm.memory): live storage each virtual rank holds, by label, with peaks and marks.

The oracle is the arithmetic of the tensors a program holds: numel x element size."""
from __future__ import annotations

import pickle

import plotly.graph_objects as go
import pytest
import torch

import simcomm
from simcomm import memory
from simcomm.viz import memory_figure

F32 = 4


def run(world_size, program, *args, **kwargs) -> memory.MemoryReport:
    world = simcomm.World(world_size, memory=True)
    world.run(program, *args, **kwargs)
    return world.memory


def test_off_by_default_and_the_api_is_a_no_op_then():
    def program(comm):
        with memory.label("parameters"):
            x = torch.ones(10)
        memory.mark("m")
        assert memory.current_bytes() is None
        return memory.tag(x, "gradients") is x

    world = simcomm.World(2)
    assert world.run(program) == [True, True]
    assert world.memory is None


def test_labels_views_frees_and_peak_on_each_rank():
    def program(comm):
        with memory.label("parameters"):
            w = torch.zeros(100)                                # 400 B
        views = [w.view(10, 10), w[3:7], w.t() if w.dim() == 2 else w]   # no new storage
        memory.mark("params")
        with memory.label("activations"):
            a = torch.ones(50 * (comm.rank + 1))                # rank-dependent: 200 B x (rank + 1)
            with memory.label("inner"):
                b = torch.ones(25)                              # innermost label wins: 100 B
        memory.mark("acts")
        del a, b, views
        memory.mark("freed")
        return None

    report = run(3, program)
    assert report.marks == ["params", "acts", "freed"]
    for rank, rank_memory in enumerate(report.ranks):
        params, acts, freed = (rank_memory.at(m) for m in report.marks)
        assert params.bytes == {"parameters": 100 * F32}
        assert acts.bytes == {"parameters": 400, "activations": 50 * (rank + 1) * F32, "inner": 100}
        assert freed.bytes == {"parameters": 400} and freed.total == 400
        assert freed.peak == acts.total            # the peak since the previous mark
        assert rank_memory.peak == 400 + 200 * (rank + 1) + 100
        assert rank_memory.peak_bytes == acts.bytes
        assert rank_memory.current == 0            # w died with the program's frame


def test_autograd_on_the_rank_is_counted_under_the_active_label():
    def program(comm):
        with memory.label("parameters"):
            w = torch.randn(32, 16, requires_grad=True)
        x = torch.randn(8, 32)
        with memory.label("activations"):
            loss = torch.tanh(x @ w).sum()
        with memory.label("gradients"):
            loss.backward()
        del loss
        memory.mark("after backward")
        return None

    for snap in run(2, program).at("after backward"):
        assert snap["gradients"] == 32 * 16 * F32      # w.grad; backward's temporaries are freed
        assert snap["parameters"] == 32 * 16 * F32
        assert snap["other"] == 8 * 32 * F32           # x
        assert snap["activations"] == 0                # the graph was freed by backward


def test_tensor_from_python_data_resize_and_tag():
    def program(comm):
        a = torch.tensor([1.0, 2.0, 3.0])              # storage made before the dispatcher (lift_fresh)
        memory.mark("tensor")
        b = torch.empty(0)
        b.resize_(1000)
        memory.mark("resized")
        memory.tag(a, "inputs")
        memory.mark("tagged")
        b.resize_(10)                                  # storage does not shrink: resize_ keeps capacity
        memory.mark("shrunk")
        return None

    r0 = run(1, program)[0]
    assert r0.at("tensor").bytes == {"other": 12}
    assert r0.at("resized").bytes == {"other": 12 + 4000}
    assert r0.at("tagged").bytes == {"other": 4000, "inputs": 12}
    assert r0.at("shrunk").bytes == {"other": 4000, "inputs": 12}


def test_collective_outputs_count_on_the_rank_that_receives_them():
    def program(comm):
        x = torch.ones(64 * comm.world_size)            # the input: "other"
        memory.mark("input")
        full = comm.all_gather(torch.ones(100), dim=0)               # 100 * N floats
        memory.mark("all_gather")
        shard = comm.reduce_scatter(x, dim=0)                        # 64 floats: only my chunk
        memory.mark("reduce_scatter")
        on_root = comm.gather(torch.ones(10), dst=1, dim=0)          # only rank 1 holds 10 * N floats
        memory.mark("gather")
        with memory.label("parameters"):
            params = comm.broadcast(torch.ones(7), src=0)            # received under the active label
        memory.mark("broadcast")
        return [t.numel() if t is not None else 0 for t in (full, shard, on_root, params)]

    world_size = 4
    report = run(world_size, program)
    for rank, rank_memory in enumerate(report.ranks):
        base = rank_memory.at("input").bytes["other"]
        assert base == 64 * world_size * F32
        assert rank_memory.at("all_gather")["communication"] == 100 * world_size * F32
        assert rank_memory.at("reduce_scatter")["communication"] == (100 * world_size + 64) * F32
        gathered = 10 * world_size * F32 if rank == 1 else 0
        assert rank_memory.at("gather")["communication"] == (100 * world_size + 64) * F32 + gathered
        assert rank_memory.at("broadcast")["parameters"] == 7 * F32
        assert rank_memory.at("broadcast")["other"] == base              # collective inputs are freed
    # the rank that computed each collective is charged nothing for the others' outputs or its
    # temporaries: each peak is the largest sum of what the rank itself holds at one moment
    for rank, peak in enumerate(report.peak):
        x, full, shard, gathered = 64 * world_size * F32, 100 * world_size * F32, 64 * F32, 10 * world_size * F32
        moments = [x + 100 * F32 + full,                             # in all_gather: its input and output
                   x + full + shard,
                   x + full + shard + 10 * F32 + (gathered if rank == 1 else 0),
                   x + full + shard + (gathered if rank == 1 else 0) + 2 * 7 * F32]
        assert peak == max(moments), (rank, peak, moments)


def test_a_large_shared_output_counts_only_on_the_ranks_that_took_it():
    """All-gather outputs above the copy-at-once size: the last rank to arrive runs on
    while the others have not taken theirs yet; it holds its own output only."""
    import torch.distributed as dist

    def program(comm):
        out = torch.empty(comm.world_size * 65536)
        dist.all_gather_into_tensor(out, torch.ones(65536))
        memory.mark("gathered")
        return None

    for tensors in ("real", "shape"):
        report = run_mode(2, program, tensors)
        assert [s.bytes for s in report.at("gathered")] == [{"other": 2 * 65536 * F32}] * 2, tensors   # out


def run_mode(world_size, program, tensors):
    world = simcomm.World(world_size, memory=True, tensors=tensors)
    world.run(program)
    return world.memory


def test_a_received_message_counts_on_the_receiver_only():
    def program(comm):
        if comm.rank == 0:
            comm.send(torch.ones(1000), dst=1)
            kept = None
        else:
            kept = comm.recv((1000,), torch.float32, src=0)
        memory.mark("after")
        return None if kept is None else kept.sum().item()

    report = run(2, program)
    assert report[0].at("after").total == 0
    assert report[1].at("after").bytes == {"communication": 4000}


@pytest.mark.parametrize("recv_first", [False, True])
def test_a_nonblocking_message_counts_on_the_receiver_once_waited(recv_first):
    """isend/irecv: the sender keeps its own tensor (its in-flight copy goes to the
    receiver), the receiver holds what it received: 4000 B each, whichever is posted first."""
    def program(comm):
        if comm.rank == 0:
            kept = torch.ones(1000)
            if recv_first:
                comm.barrier()                                  # rank 1's irecv is posted
            handle = comm.isend(kept, 1)
            if not recv_first:
                comm.barrier()
            handle.wait()
        else:
            if not recv_first:
                comm.barrier()                                  # rank 0's isend is posted
            handle = comm.irecv((1000,), torch.float32, 0)
            if recv_first:
                comm.barrier()
            kept = handle.wait()
        comm.barrier()
        between = memory.current_bytes()
        comm.barrier()
        return between, kept.sum().item()

    outs = simcomm.World(2, memory=True).run(program)
    assert [between for between, _ in outs] == [4000, 4000]
    assert [total for _, total in outs] == [1000.0, 1000.0]


def test_storage_from_numpy_is_counted():
    import numpy as np

    def program(comm):
        a = torch.from_numpy(np.ones(250, dtype=np.float32))
        memory.mark("from_numpy")
        return a.sum().item()

    assert run(1, program)[0].at("from_numpy").bytes == {"other": 1000}


def test_a_storage_resized_directly_is_counted_at_its_new_size():
    def program(comm):
        t = torch.ones(1000)
        memory.mark("allocated")
        t.untyped_storage().resize_(0)                  # FSDP2's free_storage
        memory.mark("freed")
        t.untyped_storage().resize_(4000)               # FSDP2's alloc_storage
        memory.mark("reallocated")
        return None

    r0 = run(1, program)[0]
    assert [r0.at(m).total for m in ("allocated", "freed", "reallocated")] == [4000, 0, 4000]
    assert torch.UntypedStorage.__dict__.get("resize_") is None     # torch's own method again after the run


LAYERS, WIDTH, BATCH = 4, 256, 8


def fsdp2_adam_program(comm):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    with memory.label("parameters"):
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with memory.label("inputs"):
        x = torch.randn(BATCH, WIDTH)
    memory.mark("sharded")
    with memory.label("activations"):
        loss = model(x).pow(2).sum()
    memory.mark("forward")
    with memory.label("gradients"):
        loss.backward()
    memory.mark("backward")
    with memory.label("optimizer_state"):
        opt.step()
    memory.mark("step")
    # FSDP2's own bookkeeping: every parameter resharded, its unsharded storage freed
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
    states = [fsdp_param.sharded_state for layer in model
              for fsdp_param in layer._get_fsdp_state()._fsdp_param_group.fsdp_params]
    unsharded = [fsdp_param._unsharded_param.untyped_storage().nbytes() for layer in model
                 for fsdp_param in layer._get_fsdp_state()._fsdp_param_group.fsdp_params]
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return states == [ShardedState.SHARDED] * LAYERS, unsharded, local


@pytest.mark.parametrize("tensors", ["real", "shape"])
def test_fsdp2_bytes_per_rank_follow_its_sharding(tensors):
    """FSDP2 frees unsharded parameters with untyped_storage().resize_(0): after each phase a
    rank holds its shard of the parameters, of the gradients and of Adam's two moments,
    and no unsharded parameter; both modes count the same bytes."""
    world_size = 4
    world = simcomm.World(world_size, memory=True, tensors=tensors)
    outs = world.run(fsdp2_adam_program)
    layer_bytes = WIDTH * WIDTH * F32                     # psi: one unsharded layer
    shard = LAYERS * layer_bytes // world_size             # this rank's shard of the model
    activation = BATCH * WIDTH * F32
    for rank, (resharded, unsharded, local) in enumerate(outs):
        assert resharded and unsharded == [0] * LAYERS and local == shard
        rank_memory = world.memory[rank]
        params = rank_memory.at("sharded")["parameters"]
        assert shard <= params <= shard + 64 * LAYERS      # FSDP2 keeps a few bytes of metadata per group
        for mark in ("sharded", "forward", "backward", "step"):
            assert rank_memory.at(mark)["parameters"] == params, mark
        # forward: each layer's output is saved (3 as inputs of the next, 1 by pow), plus the loss
        assert rank_memory.at("forward").bytes == {"parameters": params, "inputs": activation,
                                                   "activations": LAYERS * activation + F32}
        assert rank_memory.at("backward").bytes == {"parameters": params, "inputs": activation,
                                                    "activations": F32, "gradients": shard}
        assert rank_memory.at("step").bytes == {"parameters": params, "inputs": activation,
                                                "activations": F32, "gradients": shard,
                                                "optimizer_state": 2 * shard + LAYERS * F32}


def test_fsdp2_memory_is_the_same_shape_only_and_real_valued():
    real = simcomm.World(4, memory=True)
    real.run(fsdp2_adam_program)
    fake = simcomm.World(4, memory=True, tensors="shape")
    fake.run(fsdp2_adam_program)
    for mark in (*real.memory.marks, "peak"):
        assert [s.bytes for s in fake.memory.at(mark)] == [s.bytes for s in real.memory.at(mark)], mark
    assert fake.memory.peak == real.memory.peak


def test_tag_of_another_ranks_storage_is_an_error():
    shared = {}

    def program(comm):
        if comm.rank == 0:
            shared["t"] = torch.ones(3)
        comm.barrier()
        if comm.rank == 1:
            memory.tag(shared["t"], "parameters")

    with pytest.raises(simcomm.RankError) as info:
        run(2, program)
    message = str(info.value.__cause__)
    assert "memory.tag" in message and "rank 1" in message and "held by rank 0" in message


@pytest.mark.parametrize("bad", ["", None, 3])
def test_bad_label_names_are_rejected(bad):
    with pytest.raises(ValueError, match="memory.label"):
        with memory.label(bad):
            pass
    with pytest.raises(ValueError, match="memory.mark"):
        memory.mark(bad)


def test_report_is_plain_data_and_round_trips():
    def program(comm):
        with memory.label("parameters"):
            w = torch.ones(10 + comm.rank)
        memory.mark("m")
        return w.sum()

    report = run(3, program)
    dicts = pickle.loads(pickle.dumps(report.to_dicts()))
    assert all(type(d) is dict for d in dicts)
    rebuilt = memory.MemoryReport.from_dicts(list(reversed(dicts)))
    assert rebuilt == report
    assert [s["parameters"] for s in rebuilt.at("m")] == [40, 44, 48]
    with pytest.raises(KeyError, match="no mark 'nope'"):
        report.at("nope")


def test_run_tracked_returns_the_result_and_a_plain_report():
    def program(size):
        with memory.label("parameters"):
            kept = torch.zeros(size)
        memory.mark("m")
        return kept.numel()

    result, report = memory.run_tracked(2, program, (25,))
    assert result == 25
    assert report["rank"] == 2 and report["marks"] == [["m", {"parameters": 100}, 100, 100]]
    assert memory.current_bytes() is None            # tracking ended with the call


def test_figure_stacks_each_label_per_rank_and_exports_to_html():
    def program(comm):
        with memory.label("parameters"):
            w = torch.zeros(256 * (comm.rank + 1))
        with memory.label("optimizer_state"):
            m = torch.zeros(512)
        memory.mark("step")
        return w.numel() + m.numel()

    report = run(2, program)
    fig = memory_figure(report, "step")
    assert isinstance(fig, go.Figure) and fig.layout.barmode == "stack"
    bars = {trace.name: list(trace.customdata) for trace in fig.data if trace.type == "bar"}
    assert bars == {"parameters": [1024, 2048], "optimizer state": [2048, 2048]}
    peak = [t for t in fig.data if t.type == "scatter"][0]
    assert list(peak.customdata) == report.peak
    assert fig.layout.font.size >= 14
    html = fig.to_html(include_plotlyjs=False)
    assert "optimizer state" in html and "rank 1" in html
    grouped = memory_figure({"a": report, "b": report})
    assert list(grouped.data[0].x[0]) == ["a", "a", "b", "b"]
    with pytest.raises(KeyError, match="no mark"):
        memory_figure(report, "missing")


def test_wrapper_subclasses_count_what_they_wrap_and_meta_tensors_count_nothing():
    from torch.testing._internal.two_tensor import TwoTensor

    def program():
        pair = TwoTensor(torch.zeros(10), torch.zeros(10))     # two plain storages of 40 B
        memory.mark("made")
        doubled = pair * 2                                      # two new inner storages, no wrapper bytes
        memory.mark("mul")
        shape_only = torch.empty(1000, device="meta")
        memory.mark("meta")
        return doubled, shape_only

    _, report = memory.run_tracked(0, program)
    assert [(name, total) for name, _, total, _ in report["marks"]] == [("made", 80), ("mul", 160), ("meta", 160)]


def _isend_then_recv(comm):
    """Rank 0 isends 1 KiB to rank 1, which has not posted its recv yet; bytes on each side."""
    base = memory.current_bytes()
    if comm.rank == 0:
        tensor = torch.ones(128, dtype=torch.float64)
        handle = comm.isend(tensor, 1)
        del tensor
        in_flight = memory.current_bytes() - base       # the send's copy, the program's tensor freed
        comm.barrier()
        comm.barrier()
        delivered = memory.current_bytes() - base       # delivered, not waited on: the copy is held
        handle.wait()
        return in_flight, delivered, memory.current_bytes() - base
    comm.barrier()
    got = comm.recv((128,), torch.float64, src=0)
    comm.barrier()
    return memory.current_bytes() - base, got.numel()


def test_an_isend_copy_counts_on_the_sender_until_its_wait_and_the_receiver_holds_its_own():
    outs = simcomm.World(2, memory=True).run(_isend_then_recv)
    assert outs[0] == (1024, 1024, 0)
    assert outs[1] == (1024, 128)