"""Per-rank random state: each virtual rank draws from a default generator of its own.

On real processes every rank has its own default generators, so
``torch.manual_seed(0)`` then ``torch.randn(3)`` gives every rank the same
numbers whatever the others draw. Virtual ranks are threads of one process
and share torch's one default CPU generator (and one per CUDA device). Since
the ranks take turns (:class:`simcomm.sim.scheduler.RunState`), the generator belongs to
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

    The rank handing the turn on calls ``states[rank] = get_state()``, the rank
    taking it calls ``set_state(states[rank])``; both run on the rank's own
    thread while it holds the turn, so no lock is needed. (Two plain calls
    rather than methods: this is on the path of every handoff. Cost: about
    1 us per handoff on the CPU, a 5 KB state copied out and in.) In a CUDA
    World each entry holds the CPU and the device state together.
    """

    __slots__ = ("states", "get_state", "set_state", "caller")

    def __init__(self, world_size: int, device: torch.device):
        fresh = fresh_cpu_state()
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            fresh_cuda = torch.Generator(device=torch.device("cuda", index)).get_state()
            fresh = (fresh, fresh_cuda)
            self.get_state = lambda: (torch.default_generator.get_state(), torch.cuda.get_rng_state(index))

            def set_state(state: tuple[torch.Tensor, torch.Tensor]) -> None:
                torch.default_generator.set_state(state[0])
                torch.cuda.set_rng_state(state[1], index)
            self.set_state = set_state
        else:
            self.get_state = torch.default_generator.get_state
            self.set_state = torch.default_generator.set_state
        self.states: list = [fresh] * world_size     # set_state copies in, so one state serves all
        self.caller = None

    def save_caller(self) -> None:
        """Before a run: remember the state of the thread that starts it."""
        self.caller = self.get_state()

    def restore_caller(self) -> None:
        """After a run: the caller's generators are as they were before it."""
        if self.caller is not None:
            self.set_state(self.caller)
