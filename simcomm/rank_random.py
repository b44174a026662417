"""Per-rank random state: each virtual rank draws from a default generator of its own.

On real processes every rank has its own default generators, so
``torch.manual_seed(0)`` then ``torch.randn(3)`` gives every rank the same
numbers whatever the others draw. Virtual ranks are threads of one process
and share torch's one default CPU generator (and one per CUDA device). Since
the ranks take turns (:class:`simcomm.sim.RunState`), the generator belongs to
the rank holding the turn: a rank saves the generator's state when it hands
the turn on and loads its own state when it gets the turn back. Seeding or
drawing on one rank therefore never changes another rank's numbers.

**Where a rank starts.** Every rank starts every run from :data:`FRESH_SEED`,
the seed torch gives a generator nobody has seeded (``torch.Generator()``,
c10's ``default_rng_seed_val``), on the CPU and, in a CUDA World, on the
World's device. (torch 2.13 seeds a new interpreter's default generator from
the operating system instead, so unseeded numbers differ from process to
process and cannot be compared between backends at all; a fixed start keeps
simulated runs reproducible. ``real`` resets its workers to the same state
at the start of every run.)

The caller's own generator state is saved before a run and put back after
it, so a run does not change the numbers the caller draws next.
"""
from __future__ import annotations

import torch

__all__ = ["FRESH_SEED", "fresh_cpu_state", "RankRandomState"]

#: the seed of a generator nobody has seeded (c10's ``default_rng_seed_val``)
FRESH_SEED: int = torch.Generator().initial_seed()


def fresh_cpu_state() -> torch.Tensor:
    """The default CPU generator state each rank starts a run with."""
    return torch.Generator().get_state()


class RankRandomState:
    """The saved default-generator states of the ranks of one run.

    :meth:`save` is called by the rank handing the turn on, :meth:`load` by
    the rank taking it; both run on the rank's own thread while it holds the
    turn, so no lock is needed. Cost: about 1 us per handoff on the CPU (a
    5 KB state copied out and in).
    """

    __slots__ = ("cpu", "cuda", "device_index", "caller_cpu", "caller_cuda")

    def __init__(self, world_size: int, device: torch.device):
        fresh = fresh_cpu_state()
        self.cpu: list[torch.Tensor] = [fresh] * world_size   # set_state copies, so one tensor serves all
        self.cuda: list[torch.Tensor] | None = None
        self.device_index: int | None = None
        if device.type == "cuda":
            self.device_index = device.index if device.index is not None else torch.cuda.current_device()
            fresh_cuda = torch.Generator(device=torch.device("cuda", self.device_index)).get_state()
            self.cuda = [fresh_cuda] * world_size
        self.caller_cpu: torch.Tensor | None = None
        self.caller_cuda: torch.Tensor | None = None

    def save(self, rank: int) -> None:
        """Keep the generator state ``rank`` has drawn to (it is handing the turn on)."""
        self.cpu[rank] = torch.default_generator.get_state()
        if self.cuda is not None:
            self.cuda[rank] = torch.cuda.get_rng_state(self.device_index)

    def load(self, rank: int) -> None:
        """Put ``rank``'s state into the default generators (it has the turn now)."""
        torch.default_generator.set_state(self.cpu[rank])
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda[rank], self.device_index)

    def save_caller(self) -> None:
        """Before a run: remember the state of the thread that starts it."""
        self.caller_cpu = torch.default_generator.get_state()
        if self.cuda is not None:
            self.caller_cuda = torch.cuda.get_rng_state(self.device_index)

    def restore_caller(self) -> None:
        """After a run: the caller's generators are as they were before it."""
        if self.caller_cpu is not None:
            torch.default_generator.set_state(self.caller_cpu)
        if self.caller_cuda is not None:
            torch.cuda.set_rng_state(self.caller_cuda, self.device_index)
