"""Global module and optimizer hooks are per rank, as each process of a torchrun run has its own
(simcomm.sim.rank_hooks; docs/torchrun.md's table, row "module hooks"): CommDebugMode's and
MemTracker's module trackers on a tensor-parallel module, on 2 and 3 ranks, with ``simcomm.run``
(fast tier) and under torchrun on gloo (slow tier)."""
from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.modules.module as module_globals
import torch.optim.optimizer as optimizer_globals

import simcomm
from simcomm.run import run_script
from simcomm.sim.rank_hooks import HOOK_DICTS
from tests.launchers import rank_reports, torchrun_lines

SCRIPT = Path(__file__).parents[1] / "scripts" / "comm_debug_modules.py"


def _lines(text: str) -> dict[int, str]:
    return rank_reports(text)


def _fields(line: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in line.split())


def _under_torchrun(nproc: int) -> dict[int, str]:
    """Each rank's line under torchrun (gloo)."""
    return torchrun_lines(SCRIPT, nproc, _lines)


def _on_virtual_ranks(nproc: int, capsys) -> dict[int, str]:
    result = run_script(SCRIPT, nproc)
    out = capsys.readouterr()
    assert result.returncode == 0, result.summary() + out.err[-3000:]
    return _lines(out.out + out.err)


def _one_device_loss_and_grad() -> tuple[float, float]:
    """The script's model on one device in float64 (the oracle): loss and the input's gradient sum."""
    script = runpy.run_path(str(SCRIPT), run_name="comm_debug_modules")
    torch.manual_seed(0)
    model = script["Net"]()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    loss = model(x).sum()
    loss.backward()
    return loss.item(), x.grad.sum().item()


@pytest.mark.parametrize("nproc", [2, 3])
def test_comm_debug_mode_counts_per_module_on_each_rank(nproc, capsys):
    lines = _on_virtual_ranks(nproc, capsys)
    assert sorted(lines) == list(range(nproc)), lines
    loss, grad = _one_device_loss_and_grad()
    for rank in range(nproc):
        got = _fields(lines[rank])
        # ColwiseParallel then RowwiseParallel: one all_reduce forward (after mlp.down), one in
        # backward (the replicated input's gradient, at mlp.up), counted in each enclosing module
        assert got["total"] == "2" and got["counts"] == '{"all_reduce":2}', got
        modules = json.loads(got["modules"])
        assert modules["Net.mlp.down"] == {"fwd": '{"all_reduce":1}', "bwd": "{}"}, modules
        assert modules["Net.mlp.up"] == {"fwd": "{}", "bwd": '{"all_reduce":1}'}, modules
        assert "Net.head" not in modules and set(modules) == {"Global", "Net", "Net.mlp", "Net.mlp.down",
                                                              "Net.mlp.up"}, modules
        assert got["parents"] == "Global,Net,Net.mlp"
        assert got["mem_modules"] == "Net,Net.head,Net.mlp,Net.mlp.down,Net.mlp.up"
        assert float(got["loss"]) == pytest.approx(loss, rel=1e-12)
        assert float(got["grad"]) == pytest.approx(grad, rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_comm_debug_mode_prints_what_it_prints_under_torchrun(nproc, capsys):
    reference = _under_torchrun(nproc)
    assert sorted(reference) == list(range(nproc)), reference
    assert _on_virtual_ranks(nproc, capsys) == reference


# -- the hooks themselves, on World.run ---------------------------------------------------------

def _caller_dicts() -> list:
    return [getattr(module, name) for module, name in HOOK_DICTS]


def test_a_global_hook_a_rank_registers_fires_for_that_rank_only():
    before = _caller_dicts()
    before_contents = [dict(each) for each in before]

    def program(comm):
        fired = []
        layer = torch.nn.Linear(2, 2)
        if comm.rank == 1:
            handle = torch.nn.modules.module.register_module_forward_hook(
                lambda module, args, out: fired.append(comm.rank))
            torch.nn.modules.module.register_module_full_backward_hook(
                lambda module, grad_in, grad_out: fired.append(("bwd", comm.rank)))
        comm.barrier()                       # the other ranks run their forward while rank 1's hook stands
        layer(torch.ones(1, 2, requires_grad=True)).sum().backward()
        comm.barrier()
        if comm.rank == 1:
            handle.remove()                  # from rank 1's own dict
        comm.barrier()
        layer(torch.ones(1, 2))
        return fired

    assert simcomm.World(3).run(program) == [[], [1, ("bwd", 1)], []]
    after = _caller_dicts()
    assert all(a is b for a, b in zip(after, before))                  # the caller's own objects
    assert [dict(each) for each in after] == before_contents           # untouched


def test_each_rank_has_its_own_optimizer_hooks_and_the_callers_hooks_are_copied_to_each_rank():
    seen = []
    caller = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: seen.append("caller"))
    try:
        def program(comm):
            counted = []
            parameter = torch.nn.Parameter(torch.ones(2))
            optimizer = torch.optim.SGD([parameter], lr=0.1)
            if comm.rank == 0:
                optimizer_globals.register_optimizer_step_pre_hook(lambda opt, a, k: counted.append(comm.rank))
            comm.barrier()
            parameter.grad = torch.ones(2)
            optimizer.step()
            torch.nn.Linear(2, 2)(torch.ones(2))     # the caller's hook: each rank has a copy
            return counted

        assert simcomm.World(2).run(program) == [[0], []]
        assert seen == ["caller", "caller"]
        assert len(optimizer_globals._global_optimizer_pre_hooks) == 0
        assert len(module_globals._global_forward_pre_hooks) == 1
    finally:
        caller.remove()
    assert len(module_globals._global_forward_pre_hooks) == 0
