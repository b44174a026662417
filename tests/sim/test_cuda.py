"""CUDA on virtual ranks: a World on a real CUDA device (those tests skip without a GPU), and
virtual GPUs on the CPU (World(map_cuda=True), simcomm.run's default without a GPU).

A World on a CUDA device: every op forward and backward on 4 virtual ranks.

With CUDA tensors autograd would run backward on its device thread, shared by
every rank thread, where the scheduler cannot see a rank's waits; each rank
thread therefore runs with autograd multithreading disabled. The oracle is
the single-device float64 reference of ``tests/reference.py`` on the CPU.

Virtual GPUs: what a program observes of ``torch.cuda`` / ``torch.accelerator`` per rank, each
against what one process computes (the same draws, the same CPU autocast, the same GradScaler
on the CPU device), and a GPU-style script (tests/scripts/gpu_*.py) unmodified on virtual GPUs
against its CPU twin (the text with "cuda" -> "cpu", "nccl" -> "gloo", the lines marked
``# gpu`` left out) run on the CPU device: the same printed losses and bitwise the same saved
tensors. tests/sim/test_run.py runs the twin under torchrun (slow tier).
"""
from __future__ import annotations

import pytest
import torch

import simcomm

from .. import reference as ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

WORLD = 4


def _inputs(shape, seed=0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(WORLD)]


def _weights(outs) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    return [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]


CASES = {
    # name: (call on a rank, reference over every rank's leaf, input shape, replicated input)
    "all_reduce_sum": (lambda c, x: c.all_reduce(x), lambda xs: ref.all_reduce(xs, "sum"), (4, 6), False),
    "all_reduce_avg": (lambda c, x: c.all_reduce(x, op="avg"), lambda xs: ref.all_reduce(xs, "avg"), (4, 6), False),
    "all_reduce_max": (lambda c, x: c.all_reduce(x, op="max"), lambda xs: ref.all_reduce(xs, "max"), (4, 6), False),
    "all_reduce_min": (lambda c, x: c.all_reduce(x, op="min"), lambda xs: ref.all_reduce(xs, "min"), (4, 6), False),
    "all_reduce_product": (lambda c, x: c.all_reduce(x, op="product"),
                           lambda xs: ref.all_reduce(xs, "product"), (4, 6), False),
    "all_gather": (lambda c, x: c.all_gather(x, dim=1), lambda xs: ref.all_gather(xs, 1), (4, 6), False),
    "reduce_scatter": (lambda c, x: c.reduce_scatter(x, dim=0), lambda xs: ref.reduce_scatter(xs, 0), (8, 3), False),
    "slice": (lambda c, x: c.slice(x, dim=1, scale_grad=False), lambda xs: ref.slice_(xs[0], WORLD, 1), (2, 8), True),
    "all_to_all_4D": (lambda c, x: c.all_to_all_4D(x, 2, 1), lambda xs: ref.all_to_all_4d(xs, 2, 1),
                      (1, 2, 4, 3), False),
    "broadcast": (lambda c, x: c.broadcast(x, src=2), lambda xs: ref.broadcast(xs, 2), (5,), False),
    "copy_to_group": (lambda c, x: c.copy_to_group(x), lambda xs: list(xs), (5,), False),
    "reduce_from_group": (lambda c, x: c.reduce_from_group(x), lambda xs: ref.all_reduce(xs, "sum"), (5,), False),
}


@needs_cuda
@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_backward_of_every_op_on_a_cuda_world(name):
    call, reference, shape, replicated = CASES[name]
    inputs = _inputs(shape)
    if replicated:
        inputs = [inputs[0]] * WORLD
    ref_leaves = [x.clone().requires_grad_() for x in inputs]
    ref_outs = reference(ref_leaves)
    weights = _weights(ref_outs)

    def program(comm, inputs, weights):
        x = inputs[comm.rank].detach().requires_grad_()       # on the World's device already
        y = call(comm, x)
        (y * weights[comm.rank]).sum().backward()
        return y.device.type, y.detach().cpu(), x.grad.cpu()

    outs = simcomm.World(WORLD, device="cuda").run(program, inputs, weights)
    objective = sum((y * w).sum() for y, w in zip(ref_outs, weights))
    objective.backward()
    ref_grads = [leaf.grad for leaf in ref_leaves]
    if replicated:   # one shared tensor: its gradient is the sum over ranks
        ref_grads = [ref_leaves[0].grad] * WORLD
    for rank, (device_type, y, grad) in enumerate(outs):
        assert device_type == "cuda"
        torch.testing.assert_close(y, ref_outs[rank].detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, ref_grads[rank], rtol=1e-12, atol=1e-12)


@needs_cuda
def test_gather_send_recv_barrier_and_subgroup_on_a_cuda_world():
    inputs = _inputs((3,))

    def program(comm, inputs):
        x = inputs[comm.rank]
        gathered = comm.gather(x, dst=1, dim=0)
        comm.barrier()
        if comm.rank % 2 == 0:
            comm.send(x, dst=comm.rank + 1)
            received = None
        else:
            received = comm.recv((3,), torch.float64, src=comm.rank - 1).cpu()
        pair = comm.subgroup([[0, 1], [2, 3]])
        pair_sum = pair.all_reduce(x).cpu()
        return (gathered.cpu() if gathered is not None else None), received, pair_sum

    outs = simcomm.World(WORLD, device="cuda").run(program, inputs)
    torch.testing.assert_close(outs[1][0], ref.gather(inputs, 1, 0)[1])
    assert outs[0][0] is None
    for rank in (1, 3):
        torch.testing.assert_close(outs[rank][1], inputs[rank - 1])
    for rank in range(WORLD):
        first = rank - rank % 2
        torch.testing.assert_close(outs[rank][2], inputs[first] + inputs[first + 1])


@needs_cuda
def test_each_rank_has_its_own_cuda_random_state():
    def program(comm):
        torch.manual_seed(0)
        first = torch.randn(3, device="cuda")
        comm.barrier()
        second = torch.randn(3, device="cuda")
        return first.cpu(), second.cpu()

    gen = torch.Generator(device="cuda").manual_seed(0)
    expected = [torch.randn(3, device="cuda", generator=gen).cpu() for _ in range(2)]
    for rank, (first, second) in enumerate(simcomm.World(WORLD, device="cuda").run(program)):
        assert torch.equal(first, expected[0]) and torch.equal(second, expected[1]), rank


# -- virtual GPUs: World(map_cuda=True), simcomm.run's default on a machine without a GPU ------------

import ast  # noqa: E402
import re  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch.distributed as dist  # noqa: E402

from simcomm.errors import RankError, ShapeOnlyError  # noqa: E402
from simcomm.run import main as run_main  # noqa: E402
from simcomm.run import run_script  # noqa: E402
from simcomm.sim.cuda_map import GPUS, VirtualGPUs, gpu_preset, parse_bytes  # noqa: E402

SCRIPTS = Path(__file__).parents[1] / "scripts"
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="virtual GPUs are the default only without a GPU")

#: the minimal textual edits that make a GPU-style script of tests/scripts/gpu_*.py run on the
#: CPU under torchrun with gloo (after the lines marked "# gpu" are left out)
TWIN_EDITS = (
    (", device_ids=[local_rank], output_device=local_rank", ""),
    (", device_id=device", ""),
    ("torch.accelerator.current_accelerator()", 'torch.device("cpu")'),
    ('"cuda"', '"cpu"'),
    ('"nccl"', '"gloo"'),
    ('torch.device("cpu", local_rank)', 'torch.device("cpu")'),
    (".to(local_rank", '.to("cpu"'),
    ("device=local_rank", 'device="cpu"'),
    (".pin_memory()", ""),
)


def cpu_twin(text: str) -> str:
    """The CPU twin of a GPU-style script: its lines marked ``# gpu`` left out, then
    :data:`TWIN_EDITS`. Checks that no CUDA is left in its code."""
    kept = [line for line in text.splitlines() if not line.rstrip().endswith("# gpu")]
    twin = "\n".join(kept) + "\n"
    for old, new in TWIN_EDITS:
        twin = twin.replace(old, new)
    tree = ast.parse(twin)
    code = ast.unparse(tree.body[1:] if ast.get_docstring(tree) else tree.body)
    # torch.cuda.manual_seed_all stays: on a CPU-only torch it is a no-op, as under torchrun
    for left in ("'cuda'", "'nccl'", "torch.cuda.set_device", "torch.cuda.Event", "torch.cuda.synchronize",
                 "torch.accelerator", "device_ids", "pin_memory()", "local_rank)"):
        assert left not in code, f"the CPU twin still has {left!r}"
    return twin


def tagged(text: str, prefix: str) -> dict[int, list[str]]:
    lines: dict[int, list[str]] = {}
    for match in re.finditer(rf"^\[rank (\d+)\] ({re.escape(prefix)}.*)$", text, re.MULTILINE):
        lines.setdefault(int(match.group(1)), []).append(match.group(2))
    return lines


@no_gpu
def test_a_gpu_ddp_script_on_virtual_gpus_prints_and_saves_what_its_cpu_twin_does(tmp_path, capsys):
    twin = tmp_path / "gpu_ddp_cpu.py"
    twin.write_text(cpu_twin((SCRIPTS / "gpu_ddp.py").read_text()))
    (tmp_path / "gpu").mkdir()
    (tmp_path / "cpu").mkdir()
    gpu = run_script(SCRIPTS / "gpu_ddp.py", 2, ["--out", str(tmp_path / "gpu")])
    gpu_out = capsys.readouterr()
    cpu = run_script(twin, 2, ["--out", str(tmp_path / "cpu")], virtual_gpus=False)
    cpu_out = capsys.readouterr()
    assert gpu.returncode == 0, gpu.summary()
    assert cpu.returncode == 0, cpu.summary()
    assert "each rank gets a virtual GPU" in gpu_out.err and "virtual GPU" not in cpu_out.err
    losses = tagged(gpu_out.out, "loss")
    assert len(losses[0]) == 4 and losses == tagged(cpu_out.out, "loss")
    assert len(tagged(gpu_out.out, "scaler")[0]) == 1 and tagged(gpu_out.out, "scaler") == tagged(cpu_out.out, "scaler")
    saved, expected = torch.load(tmp_path / "gpu" / "model.pt"), torch.load(tmp_path / "cpu" / "model.pt")
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in saved)
    for rank, lines in sorted(tagged(gpu_out.out, "gpu").items()):
        fields = dict(item.split("=", 1) for item in lines[0].split(" ")[1:] if "=" in item)
        assert lines[0].startswith("gpu name=NVIDIA H100 80GB HBM3 count=2")
        assert (fields["current"], fields["accelerator"], fields["index"]) == (str(rank), "cuda", str(rank))
        assert 0 < int(fields["allocated"]) <= int(fields["peak"])
        assert fields["elapsed"] == "0.0" and fields["out_dtype"] == "torch.bfloat16"
    assert gpu.memory is not None and all(peak > 0 for peak in gpu.memory.peak)   # tracked on virtual GPUs


@no_gpu
def test_the_gpu_ddp_script_finishes_shape_only_with_the_scalers_state_of_its_valued_run(tmp_path, capsys):
    # a GradScaler step shape-only is the step without overflow (simcomm.sim.shape_amp); the valued
    # run has none, so the scale grows the same way (growth_interval 2: 65536 -> 262144 in 4 steps)
    args = ["--log-every", "0", "--growth-interval", "2"]
    (tmp_path / "real").mkdir()
    (tmp_path / "shape").mkdir()
    real = run_script(SCRIPTS / "gpu_ddp.py", 2, [*args, "--out", str(tmp_path / "real")])
    real_out = capsys.readouterr()
    shape = run_script(SCRIPTS / "gpu_ddp.py", 2, [*args, "--out", str(tmp_path / "shape")], tensors="shape",
                       memory=True)
    shape_out = capsys.readouterr()
    assert real.returncode == 0 and shape.returncode == 0, real.summary() + shape.summary()
    assert shape_out.err.count("take every GradScaler step as one without overflow") == 1
    scaler = tagged(shape_out.out, "scaler")
    assert scaler == tagged(real_out.out, "scaler") and "'scale': 262144.0" in scaler[0][0]
    for rank, lines in tagged(shape_out.out, "gpu").items():
        fields = dict(item.split("=", 1) for item in lines[0].split(" ")[1:] if "=" in item)
        assert (fields["count"], fields["current"], fields["out_dtype"]) == ("2", str(rank), "torch.bfloat16")
        assert 0 < int(fields["allocated"]) <= int(fields["peak"])
    saved, expected = torch.load(tmp_path / "shape" / "model.pt"), torch.load(tmp_path / "real" / "model.pt")
    assert saved.keys() == expected.keys()
    assert all(saved[k].is_meta and (saved[k].shape, saved[k].dtype) == (expected[k].shape, expected[k].dtype)
               for k in saved)
    # printing the loss every step reads data: past the GradScaler, the named error at that read
    logged = run_script(SCRIPTS / "gpu_ddp.py", 2, tensors="shape")
    capsys.readouterr()
    assert logged.returncode == 1 and isinstance(logged.error, RankError)
    assert isinstance(logged.error.error, ShapeOnlyError) and "aten._local_scalar_dense" in str(logged.error)
    read = logged.error.error.__cause__         # torch's refusal, raised at the script's line
    frames = [frame for frame in traceback.extract_tb(read.__traceback__) if frame.filename.endswith("gpu_ddp.py")]
    assert frames and "total.item()" in frames[-1].line


def dcp_model(folder: Path) -> dict:
    """The model of the DCP checkpoint in ``folder`` (as one torch.save file)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder / "checkpoint", folder / "checkpoint.pt")
    return torch.load(folder / "checkpoint.pt")["model"]


@no_gpu
def test_an_fsdp2_script_for_any_accelerator_on_virtual_gpus_equals_its_cpu_twin(tmp_path, capsys):
    twin = tmp_path / "gpu_fsdp2_cpu.py"
    twin.write_text(cpu_twin((SCRIPTS / "gpu_fsdp2.py").read_text()))
    for name in ("gpu", "cpu"):
        (tmp_path / name).mkdir()
    gpu = run_script(SCRIPTS / "gpu_fsdp2.py", 2, ["--out", str(tmp_path / "gpu")])
    gpu_out = capsys.readouterr().out
    cpu = run_script(twin, 2, ["--out", str(tmp_path / "cpu")], virtual_gpus=False)
    cpu_out = capsys.readouterr().out
    assert gpu.returncode == 0 and cpu.returncode == 0, gpu.summary() + cpu.summary()
    losses = tagged(gpu_out, "loss")
    assert len(losses[0]) == 4 and losses == tagged(cpu_out, "loss")
    saved, expected = dcp_model(tmp_path / "gpu"), dcp_model(tmp_path / "cpu")
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in saved)
    for rank, lines in tagged(gpu_out, "gpu").items():
        fields = dict(item.split("=", 1) for item in lines[0].split(" ")[1:])
        assert (fields["count"], fields["index"]) == ("2", str(rank))
        assert 0 < int(fields["allocated"]) < int(fields["peak"])


@no_gpu
def test_an_fsdp2_script_past_its_virtual_gpus_memory_stops_with_cuda_out_of_memory(capsys):
    # width 512: a 512 x 512 float32 layer (1 MiB) unsharded in forward does not fit in 1 MiB
    result = run_script(SCRIPTS / "gpu_fsdp2.py", 2, ["--width", "512"], gpu_memory="1MiB")
    capsys.readouterr()
    assert result.returncode == 1 and isinstance(result.error, RankError)
    assert isinstance(result.error.error, torch.OutOfMemoryError)
    assert str(result.error.error).startswith("CUDA out of memory. Tried to allocate ")
    assert "total capacity of 1.00 MiB" in str(result.error.error)
    assert run_script(SCRIPTS / "gpu_fsdp2.py", 2, ["--width", "512", "--steps", "1"]).returncode == 0


@no_gpu
def test_without_virtual_gpus_a_gpu_script_fails_as_under_torchrun_here(tmp_path, capsys):
    result = run_script(SCRIPTS / "gpu_ddp.py", 2, virtual_gpus=False)
    err = capsys.readouterr().err
    assert result.returncode == 1 and result.exit_codes[0] == 1
    assert "[rank 0] gpu_ddp.py needs one GPU per process" in err and "virtual GPU" not in err
    script = tmp_path / "set_device.py"
    script.write_text("import torch\ntorch.cuda.set_device(0)\n")
    with pytest.raises(Exception) as here:      # what a torchrun process on this machine raises
        torch.cuda.set_device(0)
    failed = run_script(script, 2, virtual_gpus=False)
    assert isinstance(failed.error, RankError) and type(failed.error.error) is type(here.value)
    assert str(failed.error.error) == str(here.value)
    assert run_script(script, 2).returncode == 0


def test_integer_and_cuda_devices_mean_the_worlds_device():
    def program(comm):
        rank = comm.rank
        model = torch.nn.Linear(2, 2).to(rank)
        return [str(d) for d in (
            torch.device(0), torch.device("cuda", rank), torch.device(f"cuda:{rank}"),
            torch.ones(2, device=rank).device, torch.ones(2, device="cuda").device,
            torch.ones(2).to(rank).device, torch.ones(2).to(rank, non_blocking=True).device,
            torch.ones(2).to(device=rank).device, torch.ones(2).cuda(rank).device,
            torch.ones(2).pin_memory().device, torch.empty(2, pin_memory=True).device,
            model.weight.device, torch.nn.Linear(2, 2, device=rank).weight.device,
            model.to(rank, torch.float64).weight.device, model.cuda().weight.device)], model.weight.dtype

    for devices, dtype in simcomm.World(2, map_cuda=True).run(program):
        assert devices == ["cpu"] * 15 and dtype == torch.float64


def test_device_count_is_per_node_and_device_ordinals_are_checked():
    def program(comm):
        local = comm.rank % torch.cuda.device_count()
        torch.cuda.set_device(local)
        seen = [torch.cuda.device_count(), torch.cuda.current_device()]
        with torch.cuda.device(1 - local):
            seen.append(torch.cuda.current_device())
        seen.append(torch.cuda.current_device())
        torch.accelerator.set_device_index(0)
        with torch.accelerator.device_index(1):
            seen.append(torch.accelerator.current_device_index())
        seen.append(torch.accelerator.current_device_index())
        torch.cuda.set_device(local)
        with pytest.raises(torch.AcceleratorError, match="invalid device ordinal"):
            torch.cuda.set_device(2)
        with pytest.raises(torch.AcceleratorError, match="invalid device ordinal"):
            torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2), device_ids=[3])
        return seen

    outs = simcomm.World(4, map_cuda=VirtualGPUs(per_node=2)).run(program)
    assert outs == [[2, r % 2, 1 - r % 2, r % 2, 1, 0] for r in range(4)]


def test_torch_accelerator_answers_as_a_cuda_machine_and_nccl_joins_the_world():
    def program(comm):
        dist.init_process_group("nccl", device_id=torch.device("cuda", comm.rank))
        torch.accelerator.set_device_index(comm.rank)
        torch.accelerator.synchronize()
        total = torch.ones(2, device=torch.accelerator.current_accelerator())
        dist.all_reduce(total)
        return (torch.accelerator.is_available(), torch.accelerator.current_accelerator(),
                torch.accelerator.device_count(), torch.accelerator.current_device_index(), total.tolist(),
                dist.get_world_size())

    assert simcomm.World(2, map_cuda=True).run(program) == [
        (True, torch.device("cuda"), 2, rank, [2.0, 2.0], 2) for rank in range(2)]
    assert torch.accelerator.is_available() == torch.cuda.is_available()   # torch's own again


def test_cuda_random_state_is_per_rank_and_draws_on_cuda_use_the_worlds_generator(monkeypatch):
    from simcomm.fresh_state import DEFAULT_RUN_SEED, SEED_VARIABLE

    monkeypatch.delenv(SEED_VARIABLE, raising=False)

    def program(comm):
        initial = torch.cuda.initial_seed()
        torch.cuda.manual_seed(10 + comm.rank)
        state = torch.cuda.get_rng_state()
        torch.manual_seed(3)                    # seeds the CUDA generators too, as torch's does
        after_manual_seed = torch.cuda.initial_seed()
        draw = torch.randn(3, device="cuda")
        torch.cuda.set_rng_state(state)
        comm.barrier()
        return initial, state, after_manual_seed, draw, torch.cuda.get_rng_state_all()[0]

    expected_draw = torch.randn(3, generator=torch.Generator().manual_seed(3))
    for rank, (initial, state, seeded, draw, restored) in enumerate(simcomm.World(2, map_cuda=True).run(program)):
        assert initial == DEFAULT_RUN_SEED + rank   # the rank's own seed, as its CPU generator's
        assert torch.equal(state, torch.Generator().manual_seed(10 + rank).get_state())
        assert seeded == 3 and torch.equal(draw, expected_draw) and torch.equal(restored, state)


def test_autocast_on_cuda_is_the_cpu_autocast_with_the_same_dtype():
    a, b = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.randn(8, 3)

    def program(comm, a, b):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bf16 = a.cuda() @ b.cuda()
            enabled = torch.is_autocast_enabled("cpu")
        with torch.amp.autocast("cuda"):              # CUDA's default dtype: float16
            fp16 = a @ b
        return bf16, enabled, fp16

    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_bf16 = a @ b
    with torch.autocast("cpu", dtype=torch.float16):
        expected_fp16 = a @ b
    for bf16, enabled, fp16 in simcomm.World(2, map_cuda=True).run(program, a, b):
        assert enabled and bf16.dtype == torch.bfloat16 and torch.equal(bf16, expected_bf16)
        assert fp16.dtype == torch.float16 and torch.equal(fp16, expected_fp16)


def _scaled_steps(device_type: str, model: torch.nn.Module, x: torch.Tensor):
    scaler = torch.amp.GradScaler(device_type, init_scale=2.0 ** 10, growth_interval=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = []
    for step in range(3):
        loss = model(x).pow(2).sum() * (float("inf") if step == 1 else 1.0)   # step 1 overflows: skipped
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
    return [p.detach() for p in model.parameters()], scales


def test_grad_scaler_on_cuda_works_on_the_cpu_tensors_as_the_cpu_scaler():
    model, x = torch.nn.Linear(4, 2), torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    import copy

    expected = _scaled_steps("cpu", copy.deepcopy(model), x)
    for params, scales in simcomm.World(2, map_cuda=True).run(lambda comm, m, x: _scaled_steps("cuda", m, x), model, x):
        assert scales == expected[1] == [2048.0, 1024.0, 2048.0]
        assert all(torch.equal(p, q) for p, q in zip(params, expected[0]))
    for params, scales in simcomm.World(1, map_cuda=True).run(
            lambda comm, m, x: _scaled_steps_deprecated(m, x), model, x):
        assert scales[0] == 2.0 ** 16 * 2


def _scaled_steps_deprecated(model, x):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        scaler = torch.cuda.amp.GradScaler(growth_interval=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(x).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    return list(model.parameters()), [scaler.get_scale()]


def test_memory_statistics_answer_from_the_ranks_tracked_bytes():
    def program(comm):
        before = torch.cuda.memory_allocated()
        x = torch.empty(2 ** 18, device="cuda")                 # 1 MiB
        held = torch.cuda.memory_allocated() - before
        peak_with_x = torch.cuda.max_memory_allocated()
        del x
        after = torch.cuda.memory_allocated()
        peak_kept = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        return (held, after == before, peak_with_x >= before + held, peak_kept == peak_with_x,
                torch.cuda.max_memory_allocated() == after, free == total - after, total,
                stats["allocated_bytes.all.current"] == after, torch.accelerator.memory_allocated() == after,
                "NVIDIA H100 80GB HBM3" in torch.cuda.memory_summary())

    world = simcomm.World(2, map_cuda=True, memory=True)
    for out in world.run(program):
        assert out == (2 ** 20, True, True, True, True, True, 80 * 2 ** 30, True, True, True)
    untracked = simcomm.World(1, map_cuda=True).run(lambda comm: (torch.empty(100), torch.cuda.memory_allocated())[1])
    assert untracked == [0]


def test_a_rank_past_its_virtual_gpus_capacity_gets_cuda_out_of_memory():
    def program(comm):
        name, total = torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory
        small = torch.empty(2 ** 18)                          # 1 MiB: fits in 4 MiB
        try:
            torch.empty(2 ** 20 * comm.rank, device="cuda")   # rank 1: 4 MiB more
        except torch.OutOfMemoryError as error:
            return name, total, str(error), torch.cuda.memory_allocated() == small.nbytes
        return name, total, None, True

    world = simcomm.World(2, map_cuda=VirtualGPUs("A100", memory="4MiB"), memory=True)
    (name, total, fits, _), (_, _, oom, freed) = world.run(program)
    assert name == "NVIDIA A100-SXM4-80GB" and total == 4 * 2 ** 20 and fits is None
    assert oom.startswith("CUDA out of memory. Tried to allocate 4.00 MiB. GPU 0 has a total capacity of "
                          "4.00 MiB of which 3.00 MiB is free. Of the allocated memory 1.00 MiB is allocated")
    assert "rank 1" in oom and "--gpu-memory" in oom and freed

    def limited(comm):
        torch.cuda.set_per_process_memory_fraction(0.25)       # 1 MiB of the 4 MiB
        with pytest.raises(torch.OutOfMemoryError, match="total capacity of 1.00 MiB"):
            torch.empty(2 ** 19, device="cuda")
        return torch.cuda.mem_get_info()[1]

    assert world.run(limited) == [2 ** 20] * 2

    with pytest.raises(RankError) as info:
        simcomm.World(2, map_cuda=VirtualGPUs(memory="1MiB"), memory=True).run(
            lambda comm: torch.nn.Linear(1024, 1024, device="cuda"))
    assert isinstance(info.value.error, torch.OutOfMemoryError)


def test_run_script_names_the_virtual_gpu_and_its_memory(tmp_path, capsys):
    script = tmp_path / "props.py"
    script.write_text("import torch\np = torch.cuda.get_device_properties(0)\n"
                      "print('props', torch.cuda.is_available(), p.name, p.total_memory, torch.cuda.device_count())\n")
    assert run_script(script, 2, nnodes=2, gpu="a100", gpu_memory="8GiB", virtual_gpus=True).returncode == 0
    out = capsys.readouterr()
    assert tagged(out.out, "props")[3] == [f"props True NVIDIA A100-SXM4-80GB {8 * 2 ** 30} 2"]
    assert out.err.count("virtual GPU") == 1
    for argv, words in ((["--gpu", "B200"], "no GPU named 'B200'"), (["--gpu-memory", "8 parsecs"], "is not a size")):
        with pytest.raises(SystemExit, match=words):
            run_main([*argv, str(script)])


def test_gpu_presets_and_sizes():
    from simcomm.model.topology import PRESETS

    assert gpu_preset("h100") is GPUS["H100"] is gpu_preset("h100-nvswitch")
    assert all(gpu.topology in PRESETS for gpu in GPUS.values() if gpu.topology)   # the cost model's nodes
    assert gpu_preset("a100-40gb").total_memory == 40 * 2 ** 30
    assert [parse_bytes(v) for v in ("8GiB", "512 MiB", "80GB", 1024, "1.5KiB")] == [
        8 * 2 ** 30, 512 * 2 ** 20, 80 * 10 ** 9, 1024, 1536]
    for bad in ("0GiB", "-1", "lots"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    with pytest.raises(TypeError, match="map_cuda"):
        simcomm.World(2, map_cuda="H100")
    with pytest.raises(ValueError, match="per_node"):
        VirtualGPUs(per_node=0)


def test_torch_load_with_a_cuda_map_location_loads_onto_the_worlds_device(tmp_path):
    path = tmp_path / "snapshot.pt"
    torch.save({"w": torch.arange(4.0)}, path)

    def program(comm):
        loaded = [torch.load(path, map_location=f"cuda:{comm.rank}"), torch.load(path, map_location=comm.rank),
                  torch.load(path, map_location={"cpu": "cuda:0"}), torch.load(path)]
        return [(str(d["w"].device), d["w"].tolist()) for d in loaded]

    for out in simcomm.World(2, map_cuda=True).run(program):
        assert out == [("cpu", [0.0, 1.0, 2.0, 3.0])] * 4


def test_set_device_of_a_cuda_device_object_selects_its_ordinal():
    def program(comm):
        device = torch.device("cuda", comm.rank)
        torch.cuda.set_device(device)
        first = torch.cuda.current_device()
        torch.cuda.set_device(torch.device(f"cuda:{1 - comm.rank}"))
        second = torch.cuda.current_device()
        torch.cuda.set_device(torch.device(comm.rank))
        return str(device), device == torch.device("cpu"), first, second, torch.cuda.current_device()

    assert simcomm.World(2, map_cuda=True).run(program) == [("cpu", True, r, 1 - r, r) for r in range(2)]


def _tensor_parallel_step(comm, device_type):
    """A tensor-parallel MLP as PyTorch's TP example writes it: a mesh of ``device_type``, the model
    moved there, forward and backward (DTensor's backward moves gradients to the mesh's device)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device_type, (comm.world_size,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).to(device_type)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.arange(12.0, device=device_type).reshape(3, 4)
    model(x).square().sum().backward()
    return mesh.device_type, [p.grad.full_tensor() for p in model.parameters()]


def test_a_cuda_device_mesh_is_on_the_worlds_device_and_dtensor_backward_runs():
    from simcomm.sim.cuda_map import VirtualGPUs

    gpu = simcomm.World(2, map_cuda=VirtualGPUs(per_node=2)).run(_tensor_parallel_step, "cuda")
    cpu = simcomm.World(2).run(_tensor_parallel_step, "cpu")
    for (gpu_type, gpu_grads), (cpu_type, cpu_grads) in zip(gpu, cpu, strict=True):
        assert gpu_type == cpu_type == "cpu"
        assert len(gpu_grads) == 4 and all(torch.equal(a, b) for a, b in zip(gpu_grads, cpu_grads, strict=True))
