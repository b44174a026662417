"""The assertion helpers every lesson uses, so that a claim in a cell is an ``assert`` with a
readable message (one module for all lessons; each lesson's checker module re-exports them, so a
lesson reads ``check.assert_close(...)``):

* :func:`per_rank`, one line per rank of a result;
* :func:`max_error` and :func:`assert_close`, for tensors and nested lists/dicts of them;
* :func:`expect_error`, that a call raises the named error with the named fragments;
* :func:`gradcheck_across_ranks`, a finite-difference check of the gradients every rank gets,
  through the real collectives.

Nothing here prints: the functions return text for the notebook to show.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["per_rank", "max_error", "assert_close", "expect_error", "gradcheck_across_ranks"]


def _format(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    if isinstance(value, list):
        return "[" + ", ".join(_format(v) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + ", ".join(_format(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def per_rank(outs: Sequence[Any]) -> str:
    """One line per rank: ``rank r: <its result>``, numbers as ``1`` or ``2.5`` (not ``1.0``)."""
    return "\n".join(f"rank {rank}: {_format(out)}" for rank, out in enumerate(outs))


def _flat(values: Any) -> list[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, dict):
        return [t for key in sorted(values) for t in _flat(values[key])]
    if isinstance(values, (list, tuple)):
        return [t for value in values for t in _flat(value)]
    return [torch.as_tensor(values)]


def max_error(got: Any, expected: Any) -> float:
    """Largest absolute difference between two tensors, or two (nested) lists/dicts of tensors."""
    got, expected = _flat(got), _flat(expected)
    if len(got) != len(expected):
        raise AssertionError(f"{len(got)} tensors where {len(expected)} were expected")
    worst = 0.0
    for index, (a, b) in enumerate(zip(got, expected)):
        a, b = a.detach().cpu(), b.detach().cpu()
        if a.shape != b.shape:
            raise AssertionError(f"tensor {index}: shape {tuple(a.shape)}, expected {tuple(b.shape)}")
        if a.numel():
            worst = max(worst, (a.double() - b.double()).abs().max().item())
    return worst


def assert_close(got: Any, expected: Any, what: str, *, atol: float = 1e-10) -> str:
    """Assert ``got`` equals ``expected`` to ``atol``; return a line saying so."""
    error = max_error(got, expected)
    if not error <= atol:
        raise AssertionError(f"{what}: differs from the reference by {error:.3g} (tolerance {atol:g})")
    return f"{what}: matches the reference"


def expect_error(call: Callable[[], Any], error_type: type[BaseException] | tuple,
                 *fragments: str) -> BaseException:
    """Call ``call()``; assert it raises ``error_type`` whose message holds every fragment.

    Returns the exception, so a cell can show its message.
    """
    try:
        call()
    except error_type as error:  # the expected failure
        message = str(error)
        missing = [fragment for fragment in fragments if fragment not in message]
        if missing:
            raise AssertionError(f"the {type(error).__name__} does not mention {missing}:\n{message}") from error
        return error
    raise AssertionError(f"expected {error_type} to be raised, but the call returned normally")


# -- a finite-difference check through the collectives ----------------------------------------

def _loss_and_grad(comm, loss_fn: Callable, inputs: Sequence[torch.Tensor]):
    x = inputs[comm.rank].to(comm.device, copy=True).requires_grad_()
    loss = loss_fn(comm, x)
    loss.backward()
    return loss.detach(), x.grad


def _loss_only(comm, loss_fn: Callable, inputs: Sequence[torch.Tensor]):
    with torch.no_grad():
        return loss_fn(comm, inputs[comm.rank].to(comm.device, copy=True))


def gradcheck_across_ranks(world, loss_fn: Callable, inputs: Sequence[torch.Tensor], *,
                           directions: int = 3, eps: float = 1e-6, seed: int = 0) -> float:
    """Check the gradients of ``sum over ranks of loss_fn(comm, x_rank)`` numerically.

    ``inputs[r]`` is rank ``r``'s float64 input. The gradients autograd gives
    every rank (through the collectives' backward rules) are compared with
    central finite differences of the summed loss along ``directions`` random
    directions that move every rank's input at once, each a complete run of
    ``world``. Returns the largest relative error; raises ``AssertionError``
    above ``1e-6``.
    """
    results = world.run(_loss_and_grad, loss_fn, list(inputs))
    grads = [grad for _, grad in results]
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for _ in range(directions):
        step = [torch.randn(x.shape, generator=gen, dtype=x.dtype) for x in inputs]
        plus = sum(world.run(_loss_only, loss_fn, [x + eps * v for x, v in zip(inputs, step)]))
        minus = sum(world.run(_loss_only, loss_fn, [x - eps * v for x, v in zip(inputs, step)]))
        numeric = (plus - minus).item() / (2 * eps)
        analytic = sum((g * v).sum().item() for g, v in zip(grads, step))
        error = abs(numeric - analytic) / max(1.0, abs(analytic))
        worst = max(worst, error)
    if worst > 1e-6:
        raise AssertionError(f"gradcheck across ranks: relative error {worst:.3g} between the "
                             "autograd gradients and finite differences")
    return worst
