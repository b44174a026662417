"""DTensor sharding of the CPU's flash attention on virtual GPUs (simcomm.sim.sdpa_cpu).

A tensor-parallel attention block (q, k, v colwise as DTensors, ``use_local_output=False`` as
PyTorch's FSDP+TP example writes it, the output projection rowwise, heads sharded, causal ``F.scaled_dot_product_attention``) runs forward and backward on two virtual
GPUs and equals the same block on one device in float64; on plain CPU virtual ranks it stops
as it does under torchrun with gloo (DTensor has no strategy for the CPU op there).

Tolerance: the ranks compute in float32 with the CPU's flash kernel (blocked softmax with
running maxima) and a different summation order than the float64 reference; inputs and weights
are O(1), so outputs and gradients agree to a few float32 ulps of O(1) values: 1e-5 absolute and
relative is 10-100 float32 ulps, and far below any wrong sharding (a wrong head or a missing
reduction changes values by O(0.1)).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import simcomm

HEADS, HEAD_DIM, BATCH, SEQ = 4, 8, 2, 6
DIM = HEADS * HEAD_DIM


class Attention(torch.nn.Module):
    """Multi-head causal self-attention, as a Llama block writes it (q, k, v, o projections)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(DIM, DIM, bias=False, dtype=dtype) for _ in range(4))

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (proj(x).view(batch, seq, -1, HEAD_DIM).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(batch, seq, -1))


def _weights_and_input():
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(DIM, DIM, generator=generator, dtype=torch.float64) / DIM ** 0.5 for _ in range(4)]
    x = torch.randn(BATCH, SEQ, DIM, generator=generator, dtype=torch.float64)
    return weights, x


def _load(model, weights):
    with torch.no_grad():
        for proj, weight in zip((model.q, model.k, model.v, model.o), weights, strict=True):
            proj.weight.copy_(weight)


def _tp_attention(comm, device_type):
    """The block tensor-parallel over the world: forward, backward; full output and weight grads."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device_type, (comm.world_size,))
    weights, x = _weights_and_input()
    model = Attention().to(device_type)
    _load(model, [w.float() for w in weights])
    colwise = ColwiseParallel(use_local_output=False)      # q, k, v stay DTensors sharded on the heads
    parallelize_module(model, mesh, {"q": colwise, "k": colwise, "v": colwise, "o": RowwiseParallel()})
    x = x.float().to(device_type).requires_grad_()
    out = model(x)
    out.square().sum().backward()
    grads = [proj.weight.grad.full_tensor() for proj in (model.q, model.k, model.v, model.o)]
    return out.detach(), x.grad, grads


def _reference():
    weights, x = _weights_and_input()
    model = Attention(torch.float64)
    _load(model, weights)
    x.requires_grad_()
    out = model(x)
    out.square().sum().backward()
    return out.detach(), x.grad, [proj.weight.grad for proj in (model.q, model.k, model.v, model.o)]


def test_tensor_parallel_attention_on_virtual_gpus_equals_one_device_in_float64():
    from simcomm.sim.cuda_map import VirtualGPUs

    results = simcomm.World(2, map_cuda=VirtualGPUs(per_node=2)).run(_tp_attention, "cuda")
    out, x_grad, grads = _reference()
    for rank_out, rank_x_grad, rank_grads in results:
        torch.testing.assert_close(rank_out.double(), out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rank_x_grad.double(), x_grad, rtol=1e-5, atol=1e-5)
        assert len(rank_grads) == 4
        for got, want in zip(rank_grads, grads, strict=True):
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert out.abs().max() > 0.1 and all(g.abs().max() > 0.1 for g in grads)   # not a trivial comparison


def _ran_cpu_flash(comm):
    """The block's attention ran the CPU's flash kernel on the ranks (not the math fallback)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func)
            return func(*args, **(kwargs or {}))

    with Ops():
        _tp_attention(comm, "cuda")
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default in seen


def test_the_sharded_op_is_the_cpus_flash_attention_forward_and_backward():
    from simcomm.sim.cuda_map import VirtualGPUs

    assert simcomm.World(2, map_cuda=VirtualGPUs(per_node=2)).run(_ran_cpu_flash) == [True, True]


def test_on_plain_cpu_ranks_it_fails_as_under_torchrun():
    """No strategy off virtual GPUs: the error DTensor gives a gloo process, word for word."""
    with pytest.raises(Exception) as caught:
        simcomm.World(2).run(_tp_attention, "cpu")
    assert ("Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding "
            "strategy registered.") in str(caught.value)


def test_after_a_virtual_gpu_run_plain_cpu_ranks_still_fail():
    from simcomm.sim.cuda_map import VirtualGPUs

    simcomm.World(2, map_cuda=VirtualGPUs(per_node=2)).run(_tp_attention, "cuda")
    with pytest.raises(Exception, match="does not have a sharding strategy registered"):
        simcomm.World(2).run(_tp_attention, "cpu")


def test_a_dtensor_mask_is_refused_with_a_named_error():
    from simcomm.sim.cuda_map import VirtualGPUs

    def program(comm):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cuda", (2,))
        q = distribute_tensor(torch.randn(1, 2, 4, 8), mesh, [Shard(1)])
        mask = distribute_tensor(torch.ones(1, 2, 4, 4, dtype=torch.bool), mesh, [Shard(1)])
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    with pytest.raises(Exception, match="attn_mask is a DTensor"):
        simcomm.World(2, map_cuda=VirtualGPUs(per_node=2)).run(program)
