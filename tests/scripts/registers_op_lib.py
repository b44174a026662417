"""A library module whose import registers an operator with torch (``torch.library``), a
registration a process holds once: importing it a second time into the same process raises.
The namespace is the run's (TORCHELASTIC_RUN_ID), so each run registers its own.
Imported by registers_op.py."""
import os

import torch

NAMESPACE = "rank_modules_" + "".join(c if c.isalnum() else "_" for c in os.environ["TORCHELASTIC_RUN_ID"])
_library = torch.library.Library(NAMESPACE, "DEF")
_library.define("scale(Tensor x, float factor) -> Tensor")
_library.impl("scale", lambda x, factor: x * factor, "CompositeExplicitAutograd")

IMPORTED_BY: list[int] = []


def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return getattr(getattr(torch.ops, NAMESPACE), "scale")(x, factor)
