"""Loss scaling on shape-only ranks (simcomm.sim.shape_amp): a GradScaler step is the step without
overflow, so a mixed-precision training loop finishes shape-only with the scale, the growth tracker
and the memory a real-valued run without overflow has."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import simcomm
from simcomm import memory
from simcomm.errors import RankError, ShapeOnlyError
from simcomm.sim.shape_amp import AMP_NOTICE

WIDTH = 128
LAYERS = 4
#: parameters of the model of train(): LAYERS x Linear(WIDTH, WIDTH)
PARAMETERS = LAYERS * (WIDTH * WIDTH + WIDTH)


def train(comm, device_name: str, dtype: torch.dtype, scaler_kind: str, steps: int = 3,
          growth_interval: int = 2, fused: bool = False) -> dict:
    """A mixed-precision DDP-style loop: autocast, GradScaler, gradients averaged with all_reduce,
    AdamW (``fused``: the fused kernel, which unscales and skips itself, given the scaler's
    ``grad_scale`` and ``found_inf``). Returns the scale and growth tracker after every step and
    the scaler's state."""
    if device_name == "cuda":
        torch.cuda.set_device(dist.get_rank())
    device = torch.device(device_name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if fused else {"foreach": False}))
    if scaler_kind == "torch.cuda.amp":
        with pytest.warns(FutureWarning):
            scaler = torch.cuda.amp.GradScaler(growth_interval=growth_interval)
    else:
        scaler = torch.amp.GradScaler(device_name, growth_interval=growth_interval)
    scales = []
    for step in range(steps):
        x = torch.randn(4, WIDTH, device=device)
        with torch.autocast(device_name, dtype=dtype):
            out = model(x)
        loss = out.float().pow(2).mean()
        optimizer.zero_grad(set_to_none=False)
        scaler.scale(loss).backward()
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)
            parameter.grad /= dist.get_world_size()
        scaler.step(optimizer)
        scaler.update()
        memory.mark(f"after step {step}")
        scales.append((scaler.get_scale(), scaler._get_growth_tracker()))
    state = scaler.state_dict()
    return {"scales": scales, "state": state, "out_dtype": out.dtype}


CASES = [
    pytest.param("cpu", torch.bfloat16, "torch.amp", {}, id="cpu-bf16"),
    pytest.param("cpu", torch.bfloat16, "fused", {}, id="cpu-bf16-fused-adamw"),
    pytest.param("cuda", torch.float16, "torch.amp", {"map_cuda": True}, id="virtual-gpu-fp16"),
    pytest.param("cuda", torch.float16, "torch.cuda.amp", {"map_cuda": True}, id="virtual-gpu-fp16-cuda-amp"),
]


@pytest.mark.parametrize("device_name, dtype, scaler_kind, options", CASES)
def test_a_gradscaler_loop_finishes_shape_only_with_the_scale_of_a_run_without_overflow(
        device_name, dtype, scaler_kind, options, capsys):
    real_world = simcomm.World(2, memory=True, **options)
    fused = scaler_kind == "fused"
    real = real_world.run(train, device_name, dtype, scaler_kind, fused=fused)
    assert "GradScaler" not in capsys.readouterr().err
    shape_world = simcomm.World(2, tensors="shape", memory=True, **options)
    shape = shape_world.run(train, device_name, dtype, scaler_kind, fused=fused)
    err = capsys.readouterr().err
    assert err.count(AMP_NOTICE) == 1           # once per run, not per rank or per step
    # the real-valued run has no overflow: the scale doubles every growth_interval (2) steps
    expected = [(65536.0, 1), (131072.0, 0), (131072.0, 1)]
    for rank in range(2):
        assert real[rank]["scales"] == expected and shape[rank]["scales"] == expected
        assert shape[rank]["state"] == real[rank]["state"]
        assert shape[rank]["out_dtype"] == real[rank]["out_dtype"] == dtype
        # memory at the end of each step: parameters, gradients and AdamW's two moments (float32),
        # as hand-counted, and as the real-valued run counts it
        for step in range(3):
            mark = shape_world.memory[rank].at(f"after step {step}")
            assert mark.total == real_world.memory[rank].at(f"after step {step}").total
            assert abs(mark.total - 4 * 4 * PARAMETERS) <= 0.1 * 4 * 4 * PARAMETERS, mark
    assert shape_world.memory.peak == real_world.memory.peak


def test_the_notice_comes_once_per_run():
    import io
    from contextlib import redirect_stderr

    for _ in range(2):
        err = io.StringIO()
        with redirect_stderr(err):
            simcomm.World(2, tensors="shape").run(train, "cpu", torch.bfloat16, "torch.amp", 2)
        assert err.getvalue().count(AMP_NOTICE) == 1


def test_found_inf_without_a_value_is_not_made_up():
    """The rule keeps what found_inf had: one that has no value (data) stays without one."""

    def program(comm):
        grads = [torch.randn(4)]
        found_inf = torch.randn(()).abs() * 0          # data: no value, even though it is 0
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch.full((), 0.5))
        return float(found_inf.item())

    with pytest.raises(RankError) as caught:
        simcomm.World(2, tensors="shape").run(program)
    assert isinstance(caught.value.error, ShapeOnlyError)
    assert "aten._local_scalar_dense" in str(caught.value.error)


def test_unscaled_gradients_have_no_value():
    """Gradients that had values (a constant) lose them where the check ran without values."""

    from torch._subclasses.fake_tensor import DataDependentOutputException

    def program(comm):
        constant = torch.ones(3)
        grads = [constant, torch.randn(3)]     # the second has none: the rule's case
        found_inf = torch.zeros(())
        before = constant.sum().item()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch.full((), 0.5))
        try:
            after = constant.sum().item()
        except DataDependentOutputException:
            after = None
        return before, found_inf.item(), after

    assert simcomm.World(2, tensors="shape").run(program) == [(3.0, 0.0, None)] * 2


def test_with_values_the_check_finds_an_inf():
    """Where every gradient has a value, the op runs on the values: an inf is found."""

    def program(comm):
        grads = [torch.tensor([1.0, float("inf")])]
        found_inf = torch.zeros(())
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch.full((), 0.5))
        return found_inf.item(), grads[0][0].item()

    assert simcomm.World(2, tensors="shape").run(program) == simcomm.World(2).run(program) == [(1.0, 0.5)] * 2


def test_a_loss_read_is_still_the_named_error():
    def program(comm):
        model = torch.nn.Linear(8, 8)
        scaler = torch.amp.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(2, 8)).float().sum()
        scaler.scale(loss).backward()
        scaler.step(torch.optim.SGD(model.parameters(), lr=0.1))
        scaler.update()
        return loss.item()

    assert len(simcomm.World(2).run(program)) == 2
    with pytest.raises(RankError) as caught:
        simcomm.World(2, tensors="shape").run(program)
    assert isinstance(caught.value.error, ShapeOnlyError)
    assert "aten._local_scalar_dense" in str(caught.value.error) and "rank 0" in str(caught.value.error)


def test_a_number_the_rank_knows_formats_as_with_values():
    """A training loop's log line: ``f"{t:.4f}"`` of a 0-dim tensor formats its number (the scale, a
    mean of constants), as a plain tensor does; of one without a value, it is a value read."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    def program(comm):
        known = torch.zeros(4).mean() + torch.full((), 65536.0).log2()
        loss = torch.randn(()) * 2
        try:
            read = f"{loss:.4f}"
        except DataDependentOutputException:
            read = "a value read"
        return f"{known:.4f} {known}", read, f"{loss}"

    real = simcomm.World(2).run(program)
    shape = simcomm.World(2, tensors="shape").run(program)
    assert [known for known, _, _ in shape] == [known for known, _, _ in real] == ["16.0000 16.0"] * 2
    assert all(read == "a value read" for _, read, _ in shape)
    # no format spec, no value: torch's own text of a fake tensor (the real run prints the number)
    assert all(text.startswith("FakeTensor(") for _, _, text in shape)
