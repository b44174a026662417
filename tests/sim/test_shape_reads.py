"""Stand-ins for reads of floating-point values on shape-only ranks (simcomm.sim.shape_reads):
with ``scalar_reads="nan"`` a logged loss reads ``nan`` and the program runs on; integer and bool
reads, and every read without the option, stay the named ShapeOnlyError."""
from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import simcomm
from simcomm.errors import RankError, ShapeOnlyError
from simcomm.sim.shape_reads import READS_NOTICE


def _train(comm, steps: int = 3) -> list:
    """Two-rank data-parallel steps that log the loss every step, as training scripts do."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logged = []
    for _ in range(steps):
        loss = model(torch.randn(4, 16)).pow(2).mean()
        loss.backward()
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)
        optimizer.step()
        optimizer.zero_grad()
        logged.append((loss.item(), float(loss.detach()), f"{loss.detach():.4f}"))
    return logged


def test_a_logged_loss_reads_nan_and_the_loop_finishes():
    world = simcomm.World(2, tensors="shape", scalar_reads="nan")
    results = world.run(_train)
    for logged in results:
        assert len(logged) == 3
        for item, as_float, formatted in logged:
            assert math.isnan(item) and math.isnan(as_float) and formatted == "nan"
    # the collectives of every step ran: 2 gradients x 3 steps per rank
    assert sum(1 for event in world.trace.events if event.op == "all_reduce" and event.rank == 0) == 6


def test_without_the_option_the_read_is_the_named_error():
    with pytest.raises(RankError) as failure:
        simcomm.World(2, tensors="shape").run(_train)
    assert isinstance(failure.value.__cause__, ShapeOnlyError)
    assert "aten._local_scalar_dense" in str(failure.value.__cause__)
    assert "scalar_reads='nan' (python -m simcomm.run --scalar-reads nan)" in str(failure.value.__cause__)


@pytest.mark.parametrize("read", [
    lambda x: x.argmax().item(),                 # an index
    lambda x: bool((x > 0).any()),               # a branch
    lambda x: int(x.sum().to(torch.int64)),      # an integer count
    lambda x: x.nonzero().shape[0],              # a data-dependent shape
])
def test_integer_and_bool_reads_stay_errors(read):
    def program(comm):
        return read(torch.randn(8))

    with pytest.raises(RankError) as failure:
        simcomm.World(2, tensors="shape", scalar_reads="nan").run(program)
    assert isinstance(failure.value.__cause__, ShapeOnlyError)


def test_a_value_the_rank_has_is_read_as_it_is_and_a_complex_read_is_complex_nan():
    def program(comm):
        known = torch.linspace(0, 1, 5).sum().item()          # computed from constants: a value
        unknown = torch.randn(3, dtype=torch.complex64).sum().item()
        half = torch.randn(2, dtype=torch.bfloat16).mean().item()
        return known, unknown, half

    for known, unknown, half in simcomm.World(2, tensors="shape", scalar_reads="nan").run(program):
        assert known == 2.5
        assert isinstance(unknown, complex) and math.isnan(unknown.real) and math.isnan(unknown.imag)
        assert math.isnan(half)


def test_a_branch_on_a_stand_in_takes_nans_side():
    def program(comm):
        loss = torch.randn(4).abs().mean()
        best = float("inf")
        improved = loss.item() < best
        return improved, loss.item() > best, loss.item() == loss.item()

    assert simcomm.World(2, tensors="shape", scalar_reads="nan").run(program) == [(False, False, False)] * 2


def test_the_notice_is_printed_once_per_run(capfd):
    world = simcomm.World(2, tensors="shape", scalar_reads="nan")
    world.run(_train)
    assert capfd.readouterr().err.count(READS_NOTICE) == 1
    world.run(_train)
    assert capfd.readouterr().err.count(READS_NOTICE) == 1
    simcomm.World(2, tensors="shape").run(lambda comm: torch.randn(3).shape)
    assert READS_NOTICE not in capfd.readouterr().err


@pytest.mark.parametrize("kwargs, message", [
    ({"tensors": "shape", "scalar_reads": "zero"}, "scalar_reads='zero' must be one of ['error', 'nan']"),
    ({"scalar_reads": "nan"}, "scalar_reads='nan' needs tensors='shape'"),
    ({"tensors": "shape", "scalar_reads": None}, "scalar_reads=None must be one of"),
])
def test_bad_options_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        simcomm.World(2, **kwargs)


SCRIPT = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 32).cuda(), device_ids=[rank])
    optimizer = torch.optim.AdamW(model.parameters())
    for step in range(3):
        loss = model(torch.randn(8, 32, device="cuda")).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} loss {loss.item():.4f}")
    print("finished")
    dist.destroy_process_group()
""")


def test_a_gpu_script_that_logs_its_loss_finishes_shape_only(tmp_path, capfd):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run = simcomm.run_script(script, 2, tensors="shape", scalar_reads="nan")
    out = capfd.readouterr().out
    assert run.exit_codes == [0, 0], run.summary()
    for rank in range(2):
        assert [line for line in out.splitlines() if line.startswith(f"[rank {rank}] step")] == [
            f"[rank {rank}] step {step} loss nan" for step in range(3)]
        assert f"[rank {rank}] finished" in out
    stopped = simcomm.run_script(script, 2, tensors="shape")
    assert stopped.exit_codes == [1, 1]
    assert isinstance(stopped.error, ShapeOnlyError) or isinstance(stopped.error.__cause__, ShapeOnlyError)
    assert "aten._local_scalar_dense" in str(stopped.error)


def test_the_command_refuses_the_option_without_shape_only(tmp_path):
    import subprocess

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, "-m", "simcomm.run", "--nproc-per-node", "2",
                           "--scalar-reads", "nan", str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--scalar-reads nan needs --tensors shape" in done.stderr
    assert "step 0" not in done.stdout
