"""``"fake"`` process groups (torch's backend that communicates nothing) on virtual ranks.

The oracle is torch's own fake backend on real processes: the script below makes fake groups
beside the world's (``dist.new_group(backend="fake")`` and a DeviceMesh dimension with
``backend_override="fake"``), calls every collective on them, and prints what each rank
observes. ``EXPECTED`` is what each process prints under ``torchrun --nproc-per-node 2``
(gloo; torch 2.13): the fast tests compare the virtual ranks with it, the slow test runs the
script under torchrun and compares torchrun's output with it too.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from simcomm import World
from simcomm.run import run_script
from tests.launchers import TORCHRUN, launch_ok
from tests.sim.test_run import tagged_lines

SCRIPT = '"""A torchrun script: "fake" process groups (torch\'s backend that communicates nothing) beside gloo."""\nimport torch\nimport torch.distributed as dist\nimport torch.distributed._functional_collectives as funcol\nimport torch.distributed.fsdp  # noqa: F401  (registers the "fake" backend, as torchtitan\'s imports do)\nfrom torch.distributed.device_mesh import init_device_mesh\n\ndist.init_process_group("gloo")\nrank, world = dist.get_rank(), dist.get_world_size()\nfake = dist.new_group(list(range(world)), backend="fake", group_desc="mine")\nprint(f"fake: backend={dist.get_backend(fake)} rank={fake.rank()} size={fake.size()} "\n      f"ranks={dist.get_process_group_ranks(fake)} name={fake.group_name} desc={fake.group_desc}")\nmine = torch.arange(4.0) + 10 * rank\nt = mine.clone(); dist.all_reduce(t, group=fake); print(f"all_reduce={t.tolist()}")\nt = mine.clone(); dist.broadcast(t, src=0, group=fake); print(f"broadcast={t.tolist()}")\nouts = [torch.full((4,), -1.0) for _ in range(world)]; dist.all_gather(outs, mine, group=fake)\nprint(f"all_gather={[o.tolist() for o in outs]}")\nout = torch.full((4 * world,), -1.0); dist.all_gather_into_tensor(out, mine, group=fake)\nprint(f"all_gather_into_tensor={out.tolist()}")\nout = torch.full((4 // world,), -1.0); dist.reduce_scatter_tensor(out, mine, group=fake)\nprint(f"reduce_scatter_tensor={out.tolist()}")\nout = torch.full((4,), -1.0); dist.all_to_all_single(out, mine, group=fake); print(f"all_to_all_single={out.tolist()}")\nt = mine.clone(); dist.reduce(t, dst=0, group=fake); print(f"reduce={t.tolist()}")\nwork = dist.all_reduce(mine.clone(), group=fake, async_op=True)\nprint(f"async: completed_before_wait={work.is_completed()} wait={work.wait()}")\ndist.barrier(group=fake)\nif rank == 1:\n    dist.send(mine, 0, group=fake)           # communicates nothing: nobody receives\nprint(f"funcol={funcol.all_reduce(mine, \'sum\', fake).tolist()}")\npart = dist.new_group([0], backend="fake")\nprint(f"member_of_[0]={part is not dist.GroupMember.NON_GROUP_MEMBER}")\nreal = dist.new_group(list(range(world)))\nt = mine.clone(); dist.all_reduce(t, group=real)\nprint(f"after: name={real.group_name} all_reduce={t.tolist()}")\nmesh = init_device_mesh("cpu", (world,), mesh_dim_names=("world",))\ngrid = mesh._unflatten(0, (1, world), ("pp", "dp"), backend_override={"pp": "fake", "dp": "fake"})\nfor dim in ("pp", "dp"):\n    group = grid[dim].get_group()\n    print(f"mesh {dim}: backend={dist.get_backend(group)} size={group.size()} local_rank={grid[dim].get_local_rank()} "\n          f"desc={group.group_desc} ranks={dist.get_process_group_ranks(group)}")\nt = mine.clone(); dist.all_reduce(t, group=grid["dp"].get_group()); print(f"mesh dp all_reduce={t.tolist()}")\nt = mine.clone(); dist.all_reduce(t, group=mesh.get_group()); print(f"mesh world all_reduce={t.tolist()}")\ndist.destroy_process_group()\nprint("done")\n'


def _row(rank: int) -> list[str]:
    """What process ``rank`` of 2 prints under torchrun (gloo): its own tensor back from every
    collective of a fake group, the world's sum from the gloo groups."""
    mine = [10.0 * rank + i for i in range(4)]
    return [f"fake: backend=fake rank={rank} size=2 ranks=[0, 1] name=1 desc=mine",
            f"all_reduce={mine}", f"broadcast={mine}", f"all_gather={[mine, mine]}",
            f"all_gather_into_tensor={mine + mine}", f"reduce_scatter_tensor={mine[2 * rank:2 * rank + 2]}",
            f"all_to_all_single={mine}", f"reduce={mine}", "async: completed_before_wait=False wait=True",
            f"funcol={mine}", f"member_of_[0]={rank == 0}",
            "after: name=3 all_reduce=[10.0, 12.0, 14.0, 16.0]",
            f"mesh pp: backend=fake size=1 local_rank=0 desc=mesh_pp ranks=[{rank}]",
            f"mesh dp: backend=fake size=2 local_rank={rank} desc=mesh_dp ranks=[0, 1]",
            f"mesh dp all_reduce={mine}", "mesh world all_reduce=[10.0, 12.0, 14.0, 16.0]", "done"]


EXPECTED = {rank: _row(rank) for rank in range(2)}


def _printed(text: str) -> dict[int, list[str]]:
    """Each rank's lines of the script's own output (torch's warnings left out)."""
    return {rank: [line for line in lines if not line.startswith((" ", "/")) and "Warning" not in line
                   and "terminate called" not in line]
            for rank, lines in tagged_lines(text).items()}


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "fake_groups.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.parametrize("virtual_gpus", [False, True])
def test_fake_groups_on_virtual_ranks_print_what_torchrun_processes_print(script, capsys, virtual_gpus):
    result = run_script(script, 2, virtual_gpus=virtual_gpus)
    out = capsys.readouterr()
    assert result.returncode == 0, result.summary() + out.err[-3000:]
    assert _printed(out.out + out.err) == EXPECTED


def test_a_fake_group_communicates_nothing_so_the_trace_holds_only_the_worlds_calls():
    def program(comm):
        import torch.distributed.fsdp  # noqa: F401  (registers "fake")
        dist.init_process_group("simcomm", rank=comm.rank, world_size=comm.world_size)
        fake = dist.new_group([0, 1, 2], backend="fake")
        t = torch.full((2,), float(comm.rank))
        dist.all_reduce(t, group=fake)             # nothing: each rank keeps its own
        dist.barrier(group=fake)
        kept = t.tolist()
        dist.all_reduce(t)                         # the world's sum
        dist.destroy_process_group()
        return kept, t.tolist()

    world = World(3)
    assert world.run(program) == [([float(r)] * 2, [3.0, 3.0]) for r in range(3)]
    ops = [event.op for event in world.trace.events if event.rank == 0]
    assert ops.count("all_reduce") == 1 and "barrier" not in ops, ops


def test_a_rank_that_skips_creating_a_fake_group_neither_waits_nor_blocks_the_others():
    """torch's fake groups are made by each process alone: no rank waits for the others."""
    def program(comm):
        import torch.distributed.fsdp  # noqa: F401
        dist.init_process_group("simcomm", rank=comm.rank, world_size=comm.world_size)
        made = None
        if comm.rank == 0:
            made = dist.new_group([0, 1], backend="fake", use_local_synchronization=True).size()
        t = torch.ones(1)
        dist.all_reduce(t)
        dist.destroy_process_group()
        return made, t.item()

    assert World(2).run(program) == [(2, 2.0), (None, 2.0)]


def test_a_fake_mesh_dimension_on_shape_only_ranks_keeps_each_ranks_shapes():
    def program(comm):
        import torch.distributed.fsdp  # noqa: F401
        from torch.distributed.device_mesh import init_device_mesh
        dist.init_process_group("simcomm", rank=comm.rank, world_size=comm.world_size)
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
        grid = mesh._unflatten(0, (2, 2), ("dp", "tp"), backend_override={"dp": "fake"})
        dp, tp = grid["dp"].get_group(), grid["tp"].get_group()
        t = torch.ones(8)
        out = torch.empty(16)
        dist.all_gather_into_tensor(out, t, group=dp)
        dist.all_reduce(t, group=tp)
        result = (dist.get_backend(dp), dist.get_backend(tp) == "simcomm", tuple(out.shape),
                  grid["dp"].get_local_rank(), grid["tp"].get_local_rank())
        dist.destroy_process_group()
        return result

    assert World(4, tensors="shape").run(program) == [("fake", True, (16,), r // 2, r % 2) for r in range(4)]


def test_fake_before_torch_registers_it_is_c10ds_own_error(monkeypatch):
    import torch.distributed.fsdp  # noqa: F401
    monkeypatch.delitem(dist.Backend._plugins, "FAKE")

    def program(comm):
        dist.init_process_group("simcomm", rank=comm.rank, world_size=comm.world_size)
        try:
            dist.new_group([0, 1], backend="fake")
        except AssertionError as error:
            return str(error)
        finally:
            dist.destroy_process_group()

    assert World(2).run(program) == ["Unknown c10d backend type FAKE"] * 2


def test_other_backends_are_still_refused_by_name():
    def program(comm):
        dist.init_process_group("simcomm", rank=comm.rank, world_size=comm.world_size)
        try:
            dist.new_group([0, 1], backend="gloo")
        except NotImplementedError as error:
            return "backend='gloo'" in str(error)
        finally:
            dist.destroy_process_group()

    assert World(2).run(program) == [True, True]




@pytest.mark.real
@pytest.mark.skipif(not TORCHRUN.exists(), reason=f"no torchrun at {TORCHRUN}")
def test_the_script_under_torchrun_gloo_prints_the_expected_rows(script, tmp_path):
    text = launch_ok([str(TORCHRUN), "--standalone", "--tee", "3", "--nproc-per-node", "2", str(script)],
                     tmp_path, reference=True, timeout=300)
    assert _printed(text) == EXPECTED
