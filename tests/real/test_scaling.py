"""Ring attention, the expert-parallel MoE and the 3-D block step on real worker processes:
equal to the simulator's results and to the single-device float64 references."""
from __future__ import annotations

import pytest
import torch

import real
import simcomm
from simcomm.parallel.context import unshard_sequence
from simcomm.parallel.mesh import Layout
from simcomm.models.transformer import assemble_grads, block_step
from tests.parallel.test_context import _reference as attention_reference
from tests.parallel.test_context import _ring_program, qkvw
from tests.parallel.test_expert import _program as moe_program
from tests.parallel.test_expert import _reference as moe_reference
from tests.parallel.test_expert import setup as moe_setup
from tests.models.test_transformer import HEADS, data, reference_loss

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_ring_attention_on_real_processes():
    q, k, v, w = qkvw(3)
    args = (q, k, v, w, True, "zigzag")
    outs = real.run(_ring_program, *args, world_size=3)
    assert _same(outs, simcomm.World(3).run(_ring_program, *args))
    for index, expected in enumerate(attention_reference(q, k, v, w, True)):
        assert torch.allclose(unshard_sequence([o[index] for o in outs], "zigzag"), expected, atol=1e-12)


def test_expert_parallel_moe_on_real_processes_with_an_empty_expert():
    params, x, w = moe_setup(3, seed=5)
    params["bias"] = torch.tensor([0., 0., 50., 0., 0., 40.], dtype=torch.float64)
    outs = real.run(moe_program, x, w, params, 2, None, world_size=3)
    assert _same(outs, simcomm.World(3).run(moe_program, x, w, params, 2, None))
    out, x_grad, grads = moe_reference(x, w, params, 2, None, 3)
    assert torch.allclose(torch.cat([o[0] for o in outs]), out, atol=1e-12)
    assert torch.allclose(sum(o[2]["router"] for o in outs), grads["router"], atol=1e-12)


def test_block_step_on_real_processes():
    x, w, params = data(batch=4)
    layout = Layout(pp=2, dp=1, tp=2)
    outs = real.run(block_step, x, w, params, HEADS, layout, world_size=4)
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    expected = reference_loss(x, w, leaves)
    expected.backward()
    assert sum(o["loss"] for o in outs).item() == pytest.approx(expected.item(), abs=1e-11)
    grads = assemble_grads(outs, layout)
    assert all(torch.allclose(grads[n], leaves[n].grad, atol=1e-11) for n in leaves)
