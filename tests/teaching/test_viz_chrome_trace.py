"""Trace.to_chrome_trace: valid Chrome trace JSON (Perfetto), one track per rank, round trip through json."""
import json

import torch

import simcomm


def program(comm):
    x = torch.ones(4, requires_grad=True)
    y = comm.all_gather(x, dim=0)
    (y * 2).sum().backward()
    return x.grad


def test_chrome_trace_is_valid_and_round_trips(tmp_path):
    world = simcomm.World(4)
    world.run(program)
    path = tmp_path / "trace.json"
    data = world.trace.to_chrome_trace(path)
    loaded = json.loads(path.read_text())
    assert loaded == json.loads(json.dumps(data))
    events = loaded["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(world.trace.events) == 8  # forward all_gather + backward reduce_scatter, 4 ranks
    for event in complete:
        assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0
        assert isinstance(event["dur"], (int, float)) and event["dur"] >= 0
        assert event["pid"] == 0 and event["tid"] in range(4)
        assert event["cat"] in ("forward", "backward")
    assert sorted(e["tid"] for e in complete) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert {(e["name"], e["cat"]) for e in complete} == {("all_gather", "forward"), ("reduce_scatter", "backward")}
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {rank: f"rank {rank}" for rank in range(4)}
    gather = next(e for e in complete if e["name"] == "all_gather" and e["tid"] == 1)
    assert gather["args"]["sent"] == {"0": 16, "2": 16, "3": 16}
