"""annotate computes one estimate per collective op, group and input size and gives it to every
event that shares them; the ops whose size depends on the whole call are estimated per call."""
from __future__ import annotations

import dataclasses

import pytest

from simcomm.model import cost
from simcomm.model.cost import PRESETS, annotate, estimate
from simcomm.trace import Trace, TraceEvent

PRESET = "h100-nvswitch"


def _event(op, rank, start, *, group=(0, 1), step=0, nbytes=4096, rows=None, **fields):
    return TraceEvent(op=op, group=group, rank=rank, step=step, phase="forward",
                      shape=(rows or nbytes // 4,), dtype="float32", nbytes=nbytes, start=start, end=start,
                      **fields)


def test_calls_of_one_op_group_and_size_share_the_estimate_of_their_own_values():
    # three steps of the same all-reduce, one of another size, one on another group: each event
    # gets the estimate of its own op, size and group, whichever event was estimated first
    events = [_event("all_reduce", rank, float(step), step=step, group=(0, 1) if step < 3 else (0, 2, 3, 1),
                     nbytes=1 << 20 if step != 1 else 1 << 10)
              for step in range(4) for rank in ((0, 1) if step < 3 else (0, 1, 2, 3))]
    annotate(Trace(events), PRESET)
    for event in events:
        assert event.modelled == estimate("all_reduce", event.nbytes, len(event.group), PRESET,
                                          ranks=event.group).time
    assert len({e.modelled for e in events}) == 3


def test_uneven_all_to_all_single_calls_of_equal_size_are_estimated_each_by_its_own_splits():
    # same op, group and per-rank bytes in both steps; step 1 sends 30 of 32 rows one way, so
    # its busiest rank moves more than step 0's even exchange
    even = {"input_split_sizes": [16, 16], "output_split_sizes": [16, 16]}
    splits = {(0, 0): even, (0, 1): even,
              (1, 0): {"input_split_sizes": [2, 30], "output_split_sizes": [2, 2]},
              (1, 1): {"input_split_sizes": [2, 2], "output_split_sizes": [30, 2]}}
    events = [_event("all_to_all_single", rank, float(step), step=step, nbytes=256, rows=32,
                     args=splits[step, rank]) for step in range(2) for rank in range(2)]
    annotate(Trace(events), PRESET)
    for step in range(2):
        call = [e for e in events if e.step == step]
        expected = estimate("all_to_all_single", cost.all_to_all_single_size(call), 2, PRESET).time
        assert [e.modelled for e in call] == [expected, expected]
    assert events[2].modelled > events[0].modelled


def test_scatter_calls_are_estimated_by_their_roots_buffer():
    # rank 1 passes 0 bytes (not the root): the call's size is the root's buffer, per call
    events = [_event("scatter", 0, 0.0, step=0, root=0, nbytes=8192),
              _event("scatter", 1, 0.0, step=0, root=0, nbytes=0),
              _event("scatter", 0, 1.0, step=1, root=0, nbytes=1 << 20),
              _event("scatter", 1, 1.0, step=1, root=0, nbytes=0)]
    annotate(Trace(events), PRESET)
    assert events[0].modelled == events[1].modelled == estimate("scatter", 8192, 2, PRESET).time
    assert events[2].modelled == events[3].modelled == estimate("scatter", 1 << 20, 2, PRESET).time


def test_compute_events_take_seconds_or_flops_and_name_what_is_missing():
    topology = dataclasses.replace(PRESETS[PRESET], compute_flops=2e15)
    events = [_event("compute", 0, 0.0, group=(0,), args={"seconds": 3}),
              _event("compute", 0, 1.0, group=(0,), args={"flops": 10**15})]
    annotate(Trace(events), topology)
    assert [e.modelled for e in events] == [3.0, 0.5] and type(events[0].modelled) is float
    with pytest.raises(ValueError, match="compute event of rank 0 has neither seconds nor flops"):
        annotate(Trace([_event("compute", 0, 0.0, group=(0,))]), topology)
    with pytest.raises(ValueError, match="declares flops=10 but topology"):
        annotate(Trace([_event("compute", 0, 0.0, group=(0,), args={"flops": 10})]),
                 dataclasses.replace(topology, compute_flops=0.0))
