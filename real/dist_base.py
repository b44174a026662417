"""What ``torch.distributed`` offers a process on this torch, as :mod:`real.transport` uses it.

The names torch gives its single-tensor collectives (they changed over
releases), every dtype this torch knows in a fixed order (a scatter header
names one by its index), and how a backend says it does not implement a call
(``is_unsupported``: :class:`real.transport.DistTransport` then emulates it).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["reduce_scatter_single", "all_gather_single", "DTYPES", "is_unsupported"]

# The names torch gives its single-tensor collectives changed over releases.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: every dtype this torch knows, in a fixed order: a scatter header names one by its index
DTYPES = tuple(dict.fromkeys(value for _, value in sorted(vars(torch).items(), key=lambda item: item[0])
                              if isinstance(value, torch.dtype)))

_UNSUPPORTED = ("not supported", "unsupported", "does not support", "cannot use", "not implemented")


def is_unsupported(error: BaseException) -> bool:
    text = str(error).lower()
    return any(phrase in text for phrase in _UNSUPPORTED)
