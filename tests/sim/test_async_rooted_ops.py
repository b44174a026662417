"""reduce, scatter, all_to_all_single and the differentiable gather issued with async_op=True:
the same outputs and input gradients as the blocking calls, on virtual ranks and on gloo."""
from __future__ import annotations

import pytest
import torch

import simcomm


def _program(comm, asynchronous: bool):
    rank = comm.rank
    x = (torch.arange(6., dtype=torch.float64) + 10 * rank).reshape(6, 1).requires_grad_()

    def call(method, *args, **kwargs):
        if asynchronous:
            handle = method(*args, async_op=True, **kwargs)
            assert isinstance(handle, simcomm.Handle)
            return handle.wait()
        return method(*args, **kwargs)

    reduced = call(comm.reduce, x, 1)
    chunk = call(comm.scatter, x if rank == 0 else None, 0, 0)
    splits = [[1, 2], [3, 3]]                                   # splits[i][j]: rows rank i sends rank j
    sends = splits[rank]
    receives = [splits[0][rank], splits[1][rank]]
    exchanged = call(comm.all_to_all_single, x[:sum(sends)], receives, sends)
    gathered = call(comm.gather, x, 0, 0)
    weights = torch.arange(exchanged.shape[0], dtype=torch.float64).unsqueeze(1)
    loss = (reduced * 2).sum() + (chunk * 3).sum() + (exchanged * weights).sum() + gathered.sum()
    loss.backward()
    return [t.detach() for t in (reduced, chunk, exchanged, gathered)], x.grad


def _reference() -> list:
    """The single-device float64 computation of the same objective (sum of both ranks' losses)."""
    xs = [(torch.arange(6., dtype=torch.float64) + 10 * r).reshape(6, 1).requires_grad_() for r in range(2)]
    reduced = [torch.zeros(6, 1, dtype=torch.float64), xs[0] + xs[1]]
    chunks = [xs[0][:3], xs[0][3:]]
    splits = [[1, 2], [3, 3]]
    pieces = [xs[i][:sum(splits[i])].split(splits[i]) for i in range(2)]   # pieces[i][j]: i -> j
    exchanged = [torch.cat([pieces[i][j] for i in range(2)]) for j in range(2)]
    gathered = [torch.cat(xs), xs[1].new_zeros(0, 1)]
    total = 0
    for r in range(2):
        weights = torch.arange(exchanged[r].shape[0], dtype=torch.float64).unsqueeze(1)
        total = total + (reduced[r] * 2).sum() + (chunks[r] * 3).sum() + (exchanged[r] * weights).sum() \
            + gathered[r].sum()
    total.backward()
    return [([t.detach() for t in (reduced[r], chunks[r], exchanged[r], gathered[r])], xs[r].grad)
            for r in range(2)]


def _assert_equal(outs, expected) -> None:
    for (values, grad), (ref_values, ref_grad) in zip(outs, expected):
        for value, ref in zip(values, ref_values):
            torch.testing.assert_close(value, ref)
        torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_rooted_and_uneven_ops_async_match_reference(asynchronous):
    _assert_equal(simcomm.World(2).run(_program, asynchronous), _reference())


@pytest.mark.real
def test_rooted_and_uneven_ops_async_on_gloo():
    import real

    _assert_equal(real.run(_program, True, world_size=2, timeout=120), _reference())
