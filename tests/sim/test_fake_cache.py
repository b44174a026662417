"""The shared dispatch cache in front of each shape-only rank's FakeTensorMode (simcomm.sim.fake_cache).

The oracle is torch's fake mode itself with every cache off: for each op, the
output a rank gets from the shared cache must have the metadata, aliasing,
version counter and attributes the fake mode gives when it computes the op.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import simcomm
from simcomm.sim import fake_cache, shape


def _program():
    """Ops of every kind the cache meets; returns (name, output, inputs) triples."""
    x = torch.empty(6, 4)
    w = torch.empty(3, 4, requires_grad=True)
    n = torch.empty(5, dtype=torch.int64)
    out = []
    y = x @ w.T
    out.append(("mm", y, (x, w)))
    view = y.t()
    out.append(("view", view, (y,)))
    out.append(("strided view", x[1:, ::2], (x,)))
    out.append(("reshape of a transpose", x.t().reshape(2, 12), (x,)))
    square = torch.empty(4, 4)
    out.append(("transpose", square.t(), (square,)))
    # the same op on the same shape: only the storage offset differs, then only the strides
    rows = torch.empty(8, 4)
    out.append(("transpose of the first half", rows[:4].t(), (rows,)))
    out.append(("transpose of the second half", rows[4:].t(), (rows,)))
    transposed = torch.empty(4, 4).t()
    out.append(("transpose of a transpose", transposed.t(), (transposed,)))
    z = torch.empty(6, 3)
    z.add_(1)
    out.append(("in place", z, (z,)))
    target = torch.empty(6, 3)
    result = torch.add(z, z, out=target)
    out.append(("out=", result, (target,)))
    values, indices = torch.max(x, dim=0)
    out.append(("tuple values", values, (x,)))
    out.append(("tuple indices", indices, (x,)))
    out.append(("int times int", n * 2, (n,)))
    out.append(("int times float", n * 2.0, (n,)))
    out.append(("bf16", x.to(torch.bfloat16), (x,)))
    out.append(("detach", w.detach(), (w,)))
    out.append(("split", torch.split(x, 2)[1], (x,)))
    out.append(("contiguous transpose", x.t().contiguous(), (x,)))
    # torch keeps a negative entry for it; the cache answers it as the view the fake mode returns
    out.append(("unsafe view", torch.ops.aten._unsafe_view(x, [24]), (x,)))
    out.append(("unsafe view of a view", torch.ops.aten._unsafe_view(rows[2:6], [16]), (rows,)))
    out.append(("unsafe view of a transposed square", torch.ops.aten._unsafe_view(square.t(), [4, 4]), (square,)))
    rows.add_(1)                 # moves the version of rows and of its views, not of an unsafe view
    loss = y.sum()
    loss.backward()
    out.append(("grad", w.grad, (w,)))
    return out


def _run(mode: FakeTensorMode, cached: bool):
    with mode, shape.FunctionalCollectives(mode if cached else None):
        return _program()


def _describe(tensor: torch.Tensor, inputs: tuple) -> tuple:
    storage = tensor.untyped_storage()._cdata
    return (type(tensor), tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.dtype, tensor.device,
            tensor.requires_grad, tensor.is_leaf, tensor._version, tensor._is_view(),
            str(torch._C._dispatch_keys(tensor)),
            tuple(storage == item.untyped_storage()._cdata for item in inputs),
            tuple(tensor is item for item in inputs),
            {name: value for name, value in vars(tensor).items() if name not in ("fake_mode", "_version")})


def test_a_rank_answered_from_the_cache_gets_what_the_fake_mode_computes():
    shape.dispatch_cache_clear()
    first = _run(shape.rank_mode(), cached=True)         # learns the entries
    assert fake_cache.cache_info()["misses"] > 0
    mode = shape.rank_mode()
    before = fake_cache.cache_info()
    answered = _run(mode, cached=True)                    # a second rank: from the cache
    assert fake_cache.cache_info()["hits"] - before["hits"] >= 10
    # the calls torch keeps a negative entry for: a list output computed directly, an unsafe view
    # rebuilt as the view of the rank's own input that the fake mode returned for the first rank
    assert fake_cache.cache_info()["computed"] - before["computed"] >= 1
    assert sum(type(entry) is fake_cache._UnsafeView for entry in fake_cache._ENTRIES.values()) >= 3
    reference_mode = FakeTensorMode(allow_non_fake_inputs=True)
    reference_mode.cache_enabled = False                  # torch computes every op itself
    reference = _run(reference_mode, cached=False)
    assert [name for name, *_ in answered] == [name for name, *_ in reference]
    for (name, tensor, inputs), (_, expected, expected_inputs) in zip(answered, reference):
        assert _describe(tensor, inputs) == _describe(expected, expected_inputs), name
        assert tensor.fake_mode is mode, name
    for (name, tensor, _), (_, other, _) in zip(answered, first):   # nothing shared with the first rank
        assert tensor.untyped_storage()._cdata != other.untyped_storage()._cdata, name


def test_the_fast_constructor_matches_fake_tensors_own():
    mode = shape.rank_mode()
    with torch._C._DisableTorchDispatch():
        elem = torch.empty_strided((3, 5), (1, 3), dtype=torch.float16, device="meta")
    device = torch.device("cpu")
    fake_cache._fake_tensor(mode, elem, device)          # learns the template
    fast, slow = fake_cache._fake_tensor(mode, elem, device), FakeTensor(mode, elem, device)
    assert type(fast) is type(slow) is FakeTensor
    assert vars(fast).keys() == vars(slow).keys()
    assert all(vars(fast)[name] is vars(slow)[name] or vars(fast)[name] == vars(slow)[name] for name in vars(slow))
    assert str(torch._C._dispatch_keys(fast)) == str(torch._C._dispatch_keys(slow))
    assert (fast.shape, fast.stride(), fast.dtype, fast.device) == (slow.shape, slow.stride(), slow.dtype, slow.device)


@pytest.mark.parametrize("size, stride, dtype", [((3, 5), (5, 1), torch.bfloat16), ((3, 5), (1, 3), torch.int64),
                                                 ((), (), torch.float32), ((2, 0, 4), (4, 4, 1), torch.bool)])
def test_a_received_tensor_built_directly_is_what_empty_strided_returns_in_the_rank_mode(size, stride, dtype):
    mode = shape.rank_mode()
    cpu = torch.device("cpu")
    with mode, shape.FunctionalCollectives(mode):
        assert shape._rank_fake_mode_alone() is mode
        dispatched = torch.empty_strided(size, stride, dtype=dtype, device=cpu)
        direct = fake_cache.empty(mode, size, stride, dtype, cpu)
        received = shape.own(torch.empty_strided(size, stride, dtype=dtype, device="meta"), cpu)
    assert _describe(direct, ()) == _describe(dispatched, ()) == _describe(received, ())
    assert direct.fake_mode is received.fake_mode is mode
    assert direct.untyped_storage().nbytes() == dispatched.untyped_storage().nbytes()
    assert direct.untyped_storage()._cdata != dispatched.untyped_storage()._cdata


def test_a_received_tensor_goes_through_the_dispatch_when_another_mode_is_set():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    mode = shape.rank_mode()
    meta = torch.empty(2, 3, device="meta")
    with mode, shape.FunctionalCollectives(mode):
        with Seen() as seen:                                # a program's own mode sees the allocation
            assert shape._rank_fake_mode_alone() is None
            out = shape.own(meta, torch.device("cpu"))
        assert torch.ops.aten.empty_strided.default in seen.ops and out.fake_mode is mode
        with torch.inference_mode():
            assert shape._rank_fake_mode_alone() is None
    assert shape._rank_fake_mode_alone() is None            # outside a rank


def test_arguments_the_key_cannot_hold_and_a_disabled_cache_go_to_the_fake_mode():
    shape.dispatch_cache_clear()
    mode = shape.rank_mode()
    real = torch.ones(4)                                  # a real tensor among fake ones (allowed)
    with mode, shape.FunctionalCollectives(mode):
        fake = torch.empty(4)
        for _ in range(3):
            out = fake + real
    assert isinstance(out, FakeTensor) and out.shape == (4,)
    assert fake_cache.cache_info()["uncached"] >= 3
    off = shape.rank_mode()
    off.cache_enabled = False                             # as TORCH_FAKE_TENSOR_DISPATCH_CACHE=0
    hits = fake_cache.cache_info()["hits"]
    with off, shape.FunctionalCollectives(off):
        a = torch.empty(2, 3)
        b = a * 2
    assert b.shape == (2, 3) and fake_cache.cache_info()["hits"] == hits


def test_scalars_of_different_types_are_different_keys():
    shape.dispatch_cache_clear()
    for _ in range(2):                                    # the second pass answers from the cache
        mode = shape.rank_mode()
        with mode, shape.FunctionalCollectives(mode):
            n = torch.empty(3, dtype=torch.int32)
            assert (n * 2).dtype == torch.int32
            assert (n * 2.0).dtype == torch.float32
            assert (n * True).dtype == torch.int32
    assert fake_cache.cache_info()["hits"] >= 3


@pytest.mark.parametrize("world_size", [4, 8])
def test_shape_only_trace_and_memory_equal_the_real_valued_run_with_the_cache(world_size):
    def program(comm):
        torch.manual_seed(comm.rank)
        layer = torch.nn.Linear(16, 32)
        x = torch.randn(8, 16)
        y = comm.all_gather(layer(x).relu(), dim=0)      # (8 * world, 32)
        loss = comm.reduce_scatter(y, dim=0).pow(2).sum()
        loss.backward()
        comm.all_reduce(layer.weight.grad, "avg")
        return layer.weight.grad.shape

    shape.dispatch_cache_clear()
    real = simcomm.World(world_size, memory=True)
    fake = simcomm.World(world_size, memory=True, tensors="shape")
    assert real.run(program) == fake.run(program)
    assert shape.dispatch_cache_info()["shared_hits"] > 0
    assert shape.trace_signature(real.trace) == shape.trace_signature(fake.trace)
    assert real.memory.peak == fake.memory.peak


def test_device_queries_in_a_rank_mode_answer_what_the_fake_modes_handler_answers():
    """The rank's dispatch mode answers autograd's device queries itself: a fake tensor's own
    device, or meta while its fake mode runs a kernel, as torch's handler does; a query it does
    not answer itself still reaches torch's handler (size)."""
    from torch._subclasses.fake_tensor import _device_handler

    mode = shape.rank_mode()
    with mode, shape.FunctionalCollectives(mode):
        x = torch.empty(2, 3)
        y = torch.empty(4, device="cpu")
        assert torch.ops.prim.device.default(x) == _device_handler([x]) == torch.device("cpu")
        assert x.device == torch.device("cpu") and y.device == torch.device("cpu")
        mode.in_kernel_invocation = True
        try:
            assert torch.ops.prim.device.default(x) == _device_handler([x]) == torch.device("meta")
        finally:
            mode.in_kernel_invocation = False
        assert list(torch.ops.aten.size.default(x)) == [2, 3]
        # and autograd, which asks for the device of every tensor, still gets a gradient of the
        # parameter's device
        w = torch.empty(3, 3).requires_grad_()
        (x @ w).sum().backward()
        assert w.grad.device == torch.device("cpu") and w.grad.shape == (3, 3)


def _metadata_changed_without_an_op(comm):
    # each change below reaches no dispatch mode, so the cache sees only the tensor's metadata
    # when the next op comes: an op seen before the change must not answer from the old entry
    out = []
    x = torch.empty(4, 4)
    out.append((x * 2).stride())          # files the entry of a contiguous 4 x 4 argument
    x.data = x.t()                        # same storage, shape and offset; strides (1, 4)
    out.append((x * 2).stride())
    y = torch.empty(4, 4)
    out.append(y.t().contiguous().stride())
    y.data = torch.empty(2, 8, dtype=torch.float64)
    out.append(((y * 2).shape, (y * 2).dtype))
    return out


def test_metadata_changed_outside_any_op_gives_the_real_valued_runs_outputs():
    real = simcomm.World(1).run(_metadata_changed_without_an_op)[0]
    fake = simcomm.World(1, tensors="shape").run(_metadata_changed_without_an_op)[0]
    assert real[1] == (1, 4) and real[0] == (4, 1)
    assert fake == real
