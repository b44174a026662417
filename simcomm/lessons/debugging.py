"""Small tools for finding the bugs of distributed programs (lesson 11).

* :func:`assert_replicated`: inside a program, check that a tensor every rank
  should hold identically (a replicated weight, its gradient, a random seed's
  draw) really is the same on every rank; an ``AssertionError`` names the
  ranks that differ and by how much.
* :func:`error_summary`: an error's message with each program location
  written as ``line N of function`` instead of a file path (a notebook cell's
  path changes from run to run), so a lesson can print it and compare.
"""
from __future__ import annotations

import re

import torch

from ..communicator import Communicator

__all__ = ["assert_replicated", "error_summary"]


def assert_replicated(comm: Communicator, tensor: torch.Tensor, what: str, *, atol: float = 0.0) -> None:
    """Raise ``AssertionError`` on every rank unless ``tensor`` is the same on all ranks of ``comm``.

    A collective (one all-gather of the detached tensor); blocks; does not
    modify ``tensor`` and adds nothing to its autograd graph. Every rank must
    pass a tensor of the same shape and dtype.
    """
    gathered = comm.all_gather(tensor.detach().reshape(1, -1), dim=0)     # (world, numel)
    differing = [(rank, (row - gathered[0]).abs().max().item()) for rank, row in enumerate(gathered)
                 if not torch.allclose(row, gathered[0], rtol=0, atol=atol)]
    if differing:
        ranks = ", ".join(f"rank {rank} by {diff:.3g}" for rank, diff in differing)
        raise AssertionError(f"{what} is not replicated: it differs from rank 0's on {ranks}")


_LOCATION = re.compile(r" at (?:\S*[/\\])?[^/\\\s]+:(\d+) in (\S+)")


def error_summary(error: BaseException) -> str:
    """``TypeName: message`` with file paths replaced by ``line N of function``."""
    return f"{type(error).__name__}: " + _LOCATION.sub(r" at line \1 of \2", str(error))
