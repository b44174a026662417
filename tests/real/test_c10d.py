"""The same torch.distributed programs through real processes (gloo): equal to the simulator."""
from __future__ import annotations

import pytest
import torch

import simcomm

from .. import torch_dist_programs as progs

pytestmark = [pytest.mark.real, pytest.mark.slow]

WORLD = progs.WORLD
GLOO_REDUCE_OPS = ("sum", "max", "min", "product")   # gloo has no ReduceOp.AVG


@pytest.fixture(scope="module")
def cluster(gloo_cluster):
    return gloo_cluster(WORLD)


def _same(real_out, sim_out) -> None:
    for got, want in zip(real_out, sim_out, strict=True):
        if isinstance(want, dict):
            assert got.keys() == want.keys()
            for name in want:
                assert got[name].dtype == want[name].dtype, name
                torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12, msg=name)
        else:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_dist_collectives_agree_with_the_simulator_and_the_reference(cluster):
    real_outs = cluster.run(progs.collectives_program, GLOO_REDUCE_OPS)
    sim_outs = simcomm.World(WORLD).run(progs.collectives_program, GLOO_REDUCE_OPS)
    _same(real_outs, sim_outs)
    _same(real_outs, progs.collectives_reference(reduce_ops=GLOO_REDUCE_OPS))


def test_ddp_agrees_with_the_simulator(cluster):
    real_outs = cluster.run(progs.ddp_program)
    sim_outs = simcomm.World(WORLD).run(progs.ddp_program)
    _same(real_outs, sim_outs)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_dtensor_agrees_with_the_simulator(cluster, mesh_shape):
    real_outs = cluster.run(progs.dtensor_matmul_program, mesh_shape)
    sim_outs = simcomm.World(WORLD).run(progs.dtensor_matmul_program, mesh_shape)
    _same(real_outs, sim_outs)


def test_nn_functional_agrees_with_the_simulator(cluster):
    real_outs = cluster.run(progs.nn_functional_program, "max")
    sim_outs = simcomm.World(WORLD).run(progs.nn_functional_program, "max")
    for (real_y, real_grad), (sim_y, sim_grad) in zip(real_outs, sim_outs, strict=True):
        torch.testing.assert_close(real_y, sim_y)
        torch.testing.assert_close(real_grad, sim_grad)


def test_fsdp2_agrees_with_the_simulator(cluster):
    real_outs = cluster.run(progs.fsdp_program)
    sim_outs = simcomm.World(WORLD).run(progs.fsdp_program)
    _same(real_outs, sim_outs)


def test_tensor_parallel_agrees_with_the_simulator(cluster):
    real_outs = cluster.run(progs.tensor_parallel_program)
    sim_outs = simcomm.World(WORLD).run(progs.tensor_parallel_program)
    for (real_y, real_grads), (sim_y, sim_grads) in zip(real_outs, sim_outs, strict=True):
        torch.testing.assert_close(real_y, sim_y)
        _same(real_grads, sim_grads)


@pytest.mark.parametrize("op", progs.NN_OPS)
def test_nn_functional_collectives_agree_with_the_simulator(cluster, op):
    real_outs = cluster.run(progs.nn_functional_collective_program, op)
    sim_outs = simcomm.World(WORLD).run(progs.nn_functional_collective_program, op)
    for (real_out, real_grad), (sim_out, sim_grad) in zip(real_outs, sim_outs, strict=True):
        torch.testing.assert_close(real_out, sim_out)
        torch.testing.assert_close(real_grad, sim_grad)


def test_async_forms_agree_with_the_simulator_and_the_reference(cluster):
    real_outs = cluster.run(progs.async_program)
    sim_outs = simcomm.World(WORLD).run(progs.async_program)
    _same(real_outs, sim_outs)
    _same(real_outs, progs.async_reference())


def test_an_async_all_reduce_overlaps_on_real_processes_too(cluster):
    real_outs = cluster.run(progs.overlap_program)
    sim_outs = simcomm.World(WORLD).run(progs.overlap_program)
    for (real_t, real_message), (sim_t, sim_message), (want, want_message) in zip(
            real_outs, sim_outs, progs.overlap_reference(), strict=True):
        torch.testing.assert_close(real_t, sim_t, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(real_t, want, rtol=1e-12, atol=1e-12)
        if want_message is not None:
            torch.testing.assert_close(real_message, want_message, rtol=0, atol=0)
            torch.testing.assert_close(sim_message, want_message, rtol=0, atol=0)


def test_ddp_comm_hook_agrees_with_the_simulator(cluster):
    real_outs = cluster.run(progs.ddp_program, hook="allreduce")
    sim_outs = simcomm.World(WORLD).run(progs.ddp_program, hook="allreduce")
    _same(real_outs, sim_outs)
    _same(real_outs, [progs.data_parallel_reference()] * WORLD)


def test_a_0d_tensor_on_gloo_is_what_the_simulator_gives_and_traced_as_shape_0d(cluster):
    real_outs = cluster.run(progs.zero_d_program)
    for got, want in zip(real_outs, progs.zero_d_reference(), strict=True):
        for name in want:
            assert got[name].shape == () and torch.equal(got[name], want[name]), name
    assert {(e.op, e.shape) for e in cluster.trace.events} == {("all_reduce", ()), ("broadcast", ()), ("reduce", ())}
