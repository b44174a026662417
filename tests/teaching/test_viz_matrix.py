"""comm_matrix_figure: bytes from rank i to rank j, checked against the ops' definitions by hand."""
import numpy as np
import pytest
import torch

import simcomm
from simcomm.viz import comm_matrix_figure


def traced(world_size, program):
    world = simcomm.World(world_size)
    world.run(program)
    return world.trace


def test_all_gather_sends_every_rank_b_bytes_to_every_other_rank():
    world_size, numel = 4, 6  # float32: b = 24 bytes per rank
    trace = traced(world_size, lambda comm: comm.all_gather(torch.ones(numel), dim=0))
    b = numel * 4
    by_hand = [[0 if i == j else b for j in range(world_size)] for i in range(world_size)]
    fig = comm_matrix_figure(trace)
    assert np.array_equal(fig.data[0].z, by_hand)
    assert fig.data[0].visible is True
    assert "96 B" not in fig.data[0].text[0][0]  # the diagonal is blank
    assert fig.data[0].text[0][1] == "24 B"
    assert "288 B in all" in fig.layout.title.text  # 4 ranks x 3 peers x 24 B


def test_selector_has_one_entry_per_op_that_moved_bytes():
    world_size, numel = 4, 8  # b = 32 bytes per rank

    def program(comm):
        x = torch.ones(numel)
        comm.all_gather(x, dim=0)
        comm.all_reduce(x)
        comm.broadcast(x, src=2)
        comm.barrier()

    fig = comm_matrix_figure(traced(world_size, program))
    menu = fig.layout.updatemenus[0]
    assert [b.label for b in menu.buttons] == ["all ops", "all_gather", "all_reduce", "broadcast"]
    b = numel * 4
    # by definition: all-reduce = reduce-scatter + all-gather, 2b/n to each peer; broadcast: src sends b to each
    all_reduce = [[0 if i == j else 2 * b // world_size for j in range(4)] for i in range(4)]
    broadcast = [[b if i == 2 and j != 2 else 0 for j in range(4)] for i in range(4)]
    all_gather = [[0 if i == j else b for j in range(4)] for i in range(4)]
    by_name = {trace.name: np.asarray(trace.z) for trace in fig.data}
    assert np.array_equal(by_name["all_reduce"], all_reduce)
    assert np.array_equal(by_name["broadcast"], broadcast)
    assert np.array_equal(by_name["all ops"], np.add(np.add(all_reduce, broadcast), all_gather))
    for k, button in enumerate(menu.buttons):
        assert button.method == "update"
        assert button.args[0]["visible"] == [i == k for i in range(4)]
        assert button.label in button.args[1]["title.text"]


def test_errors():
    with pytest.raises(ValueError, match="comm_matrix_figure: the trace has no events"):
        comm_matrix_figure(simcomm.Trace())
    with pytest.raises(ValueError, match="comm_matrix_figure: trace must be a simcomm.Trace, got list"):
        comm_matrix_figure([])


def test_fonts_are_projector_sized_and_survive_html_export():
    trace = traced(8, lambda comm: comm.all_reduce(torch.ones(256)))
    fig = comm_matrix_figure(trace)
    sizes = [fig.layout.font.size, fig.layout.title.font.size, fig.layout.xaxis.tickfont.size,
             fig.layout.yaxis.tickfont.size, fig.data[0].textfont.size, fig.layout.updatemenus[0].font.size,
             *(a.font.size for a in fig.layout.annotations)]
    assert min(sizes) >= 14, sizes
    assert "<sup>" not in fig.layout.title.text
    assert fig.data[0].texttemplate == "%{text}"             # 8 ranks: every cell shows its bytes
    html = fig.to_html(full_html=False, include_plotlyjs=False)
    assert '"type":"heatmap"' in html and "256 B" in html    # 2 x 1 KiB / 8 to each peer


def test_the_ring_schedule_sends_only_to_the_next_rank():
    """The same trace counted as NCCL's ring moves it: an all-reduce of b bytes on n ranks sends
    2(n-1)/n x b to the next rank only; a broadcast from rank 2 runs 2 -> 3 -> 0 -> 1."""
    world_size, numel = 4, 8                       # b = 32 bytes
    b = numel * 4

    def program(comm):
        x = torch.ones(numel)
        comm.all_reduce(x)
        comm.broadcast(x, src=2)
        comm.all_gather(x, dim=0)

    trace = traced(world_size, program)
    fig = comm_matrix_figure(trace, schedule="ring")
    by_name = {t.name: np.asarray(t.z) for t in fig.data}
    ring = [[2 * 3 * b // 4 if j == (i + 1) % 4 else 0 for j in range(4)] for i in range(4)]
    assert np.array_equal(by_name["all_reduce"], ring)
    chain = [[b if (i, j) in ((2, 3), (3, 0), (0, 1)) else 0 for j in range(4)] for i in range(4)]
    assert np.array_equal(by_name["broadcast"], chain)
    gather = [[3 * b if j == (i + 1) % 4 else 0 for j in range(4)] for i in range(4)]
    assert np.array_equal(by_name["all_gather"], gather)
    # the ring moves as many bytes as the direct definition for all-reduce and all-gather
    direct = {t.name: np.asarray(t.z) for t in comm_matrix_figure(trace).data}
    for op in ("all_reduce", "all_gather"):
        assert direct[op].sum() == by_name[op].sum()
    assert "NCCL's ring" in fig.layout.title.text and "direct exchange" in comm_matrix_figure(trace).layout.title.text
    with pytest.raises(ValueError, match="schedule must be 'direct' or 'ring', got 'tree'"):
        comm_matrix_figure(trace, schedule="tree")
