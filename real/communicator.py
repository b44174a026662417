"""vLLM's ``DeviceCommunicatorBase`` constructor (extended with differentiable collectives) on simcomm's communicator.

Code written against that interface (``DeviceCommunicatorBase(cpu_group, device,
device_group, unique_name)``) drops in: same constructor, same attributes
(``cpu_group``, ``device_group``, ``device``, ``unique_name``, ``rank``,
``world_size``, ``ranks``, ``global_rank``, ``global_world_size``,
``rank_in_group``), same methods, with simcomm's semantics and backward rules.
What differs is what a straightforward differentiable version of it gets wrong:

* the collectives run on ``device_group`` when given, else on ``cpu_group``
  itself: never on the whole world;
* MAX/MIN/PRODUCT backward are the true adjoints; the all-gather backward
  hands the backend a flat buffer, so it works on gloo;
* sizes that do not split evenly raise ``ValueError`` instead of truncating;
* ``send`` is documented as what it is: blocking.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from simcomm.communicator import Communicator

from .transport import DistTransport

__all__ = ["DeviceCommunicatorBase"]


def _check_member(group: ProcessGroup | None, argument: str) -> None:
    if group is None:
        raise ValueError(f"DeviceCommunicatorBase: {argument}=None; pass the process group this "
                         f"communicator works on (it never falls back to the whole world)")
    if group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"DeviceCommunicatorBase: global rank {dist.get_rank()} is not a member "
                         f"of {argument}")


class DeviceCommunicatorBase(Communicator):
    """simcomm's :class:`~simcomm.Communicator` built from ``DeviceCommunicatorBase``'s constructor arguments.

    ``cpu_group`` names the members; ``device_group`` (same members, e.g. an
    NCCL group) carries the data when given, else ``cpu_group`` does.
    ``device=None`` means ``cuda:<current device>`` for an NCCL group and the
    CPU otherwise. Tracing is off unless ``trace=True`` (then events collect in
    ``self.transport.trace``).
    """

    def __init__(self, cpu_group: ProcessGroup, device: torch.device | None = None,
                 device_group: ProcessGroup | None = None, unique_name: str = "", *,
                 trace: bool = False):
        _check_member(cpu_group, "cpu_group")
        ranks = dist.get_process_group_ranks(cpu_group)
        if device_group is not None:
            _check_member(device_group, "device_group")
            device_ranks = dist.get_process_group_ranks(device_group)
            if device_ranks != ranks:
                raise ValueError(f"DeviceCommunicatorBase: device_group has ranks {device_ranks} but "
                                 f"cpu_group has ranks {ranks}; both must name the same processes")
        self.cpu_group = cpu_group
        self.device_group = device_group
        self.unique_name = unique_name
        group = device_group if device_group is not None else cpu_group
        super().__init__(DistTransport(group, device, events=[] if trace else None))
        self.global_world_size = dist.get_world_size()

    @property
    def rank_in_group(self) -> int:
        """This process's rank within the group (``DeviceCommunicatorBase``'s name for :attr:`rank`)."""
        return self.rank

    def destroy(self) -> None:
        """Release what this communicator holds (nothing: the process groups belong to the caller)."""
        return None
