"""Writing a result into a buffer the caller gave, as a native backend does.

c10d hands a backend output tensors to fill in place; both transports (the
simulator's and a real worker's) and the c10d adapter write them here: through
a detached alias, outside autograd, the buffer's version counter left where it
was (the c10d adapter moves it as the native backend does).
"""
from __future__ import annotations

import torch

__all__ = ["write_into", "set_versions"]

#: set tensors' version counters (torch's; as torch.autograd._unsafe_preserve_version_counter does)
set_versions = torch._C._autograd._unsafe_set_version_counter


def write_into(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """Copy ``value`` (as many elements) into ``buffer``, invisibly to autograd: through a
    detached alias, the version counter left where it was (as
    ``torch.autograd._unsafe_preserve_version_counter`` does, inline)."""
    version = buffer._version
    (buffer.detach() if buffer.requires_grad else buffer).copy_(
        value if value.shape == buffer.shape else value.reshape(buffer.shape))
    set_versions((buffer,), (version,))
