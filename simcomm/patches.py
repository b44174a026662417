"""Every process-wide change simcomm makes to torch, ``os``, ``sys`` and the interpreter: one table.

Virtual ranks are threads of one process, and torch.distributed, ``torch.cuda``,
``os.environ`` and ``sys.argv`` are process-wide; so the simulator changes
some of them, for as long as it needs and no longer. This module is the one
list of those changes (``PATCHES``) and of the places that decide what to
do by looking at the caller's stack (``STACK_DECISIONS``). It changes
nothing itself; the code that makes each change names its row here, and
``tests/core/test_patches.py`` checks the table against the code (every assignment
to an attribute of torch, ``os`` or ``sys`` in ``simcomm/`` and ``real/`` is a
row's ``code``; after a run, every attribute a run-long row changed is torch's
own again, and every one a process-long row changed is still simcomm's and
listed). ``docs/process_patches.md`` is the page for users.

Lifetimes (``Patch.lifetime``):

* ``"process"``: installed on first use, then kept for the life of the process
  (it forwards to torch's own behaviour on every thread that is not a rank
  thread with a program running, so other code sees no difference);
* ``"run"``: for the length of one :meth:`simcomm.World.run` (or
  :func:`simcomm.run.run_script`), put back when it ends, also after an error;
* ``"tracked"``: while some rank of this process has its memory tracked;
* ``"call"``: around one torch call, put back when it returns;
* ``"thread"``: per rank thread (the thread-local state of a rank), never another thread's;
* ``"worker"``: in the worker processes :mod:`real` starts (never the caller's process).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Patch", "StackDecision", "PATCHES", "STACK_DECISIONS", "STACK_NAMING", "TORCH_CHECKED",
           "LIFETIMES", "patch"]

#: the torch releases every row was checked on (torch's private names move between releases)
TORCH_CHECKED = ("2.13.0",)

LIFETIMES = ("process", "run", "tracked", "call", "thread", "worker")


@dataclass(frozen=True)
class Patch:
    """One process-wide change: ``what`` changes, made by module ``by``, ``why``, ``installed``
    and ``removed`` when; ``code``: the targets the module assigns (as the source writes them:
    ``tests/core/test_patches.py`` finds every such assignment and looks it up here);
    ``attributes``: the importable dotted names whose value it replaces (checked at run time;
    a name ending in ``.*`` stands for every attribute of that object it replaces)."""

    name: str
    what: str
    by: str
    why: str
    installed: str
    removed: str
    lifetime: str
    code: tuple[str, ...]
    attributes: tuple[str, ...] = ()
    checked_on: tuple[str, ...] = TORCH_CHECKED


@dataclass(frozen=True)
class StackDecision:
    """A function that decides what to do by reading the caller's frames (``sys._getframe``)."""

    where: str          # module:function
    decides: str
    why: str
    checked_on: tuple[str, ...] = TORCH_CHECKED


_C10D = "torch.distributed.distributed_c10d"

PATCHES: tuple[Patch, ...] = (
    # -- torch.distributed on virtual ranks ----------------------------------------------------
    Patch(
        "c10d-world", f"``{_C10D}._world``: replaced by a switch that forwards every read and write "
        "to the calling rank thread's own c10d world", "simcomm.sim.dist_world",
        "torch.distributed keeps its process groups in this one module-level object; virtual ranks "
        "are threads of one process, so each rank needs its own (a module body being imported, and "
        "every thread that is not a rank's, gets the process's own object)",
        "the first World.run (each rank's rank_process_group), and again if other code (PyTorch's "
        "threaded process group) replaced it since", "never: stays for the process", "process",
        ("c10d._world",), (f"{_C10D}._world",)),
    Patch(
        "c10d-init-globals", f"``sys.excepthook``, ``{_C10D}._backend``, ``_default_pg_init_method``: "
        "saved and put back around torch's init_process_group of a rank's default group",
        "simcomm.sim.dist_world",
        "torch's init_process_group sets them process-wide (a rank-prefixed excepthook); a virtual "
        "rank's group must not change them for the rest of the process",
        "each rank's default group creation", "when that call returns", "call",
        ("sys.excepthook", "c10d._backend", "c10d._default_pg_init_method")),
    Patch(
        "c10d-thread-isolation", "torch's C++ process-group registry made per thread "
        "(``torch._C._distributed_c10d._set_thread_isolation_mode(True)``); on a CUDA World also "
        "autograd's device threads off (``torch.autograd.set_multithreading_enabled(False)``)",
        "simcomm.sim.dist_world",
        "the functional collectives find groups by name in that registry; each rank's names are its "
        "own. A backward pass must run on the rank thread that started it, as on one process",
        "when the first rank thread of any run initialises torch.distributed",
        "when the last such rank thread ends its program", "run",
        ("torch._C._distributed_c10d._set_thread_isolation_mode()",
         "torch.autograd.set_multithreading_enabled()")),
    Patch(
        "mesh-identity", "``torch.distributed.device_mesh.DeviceMesh.__init__``: wrapped; a mesh made "
        "on a rank thread gets that rank's negative ``_thread_id``; with virtual GPUs a ``\"cuda\"`` mesh "
        "is made on the World's device", "simcomm.sim.dist_world",
        "meshes compare and hash by their ranks and layout, and process-wide caches keyed on them "
        "(DTensor's sharding propagation, redistribute's plans) would hand one rank's answer to "
        "every other rank; torch sets ``_thread_id`` only for its own threaded backend",
        "the first World.run", "never: stays for the process (meshes made elsewhere are unchanged)",
        "process", ("DeviceMesh.__init__",), ("torch.distributed.device_mesh.DeviceMesh.__init__",)),
    Patch(
        "init-process-group", "``torch.distributed.init_process_group`` (and c10d's, and the name "
        "``torch.distributed.device_mesh`` imported, through which a DeviceMesh creates the default "
        "group): a program's own "
        "call joins the run it runs in, as under torchrun", "simcomm.c10d.init_join",
        "every torchrun script calls it; inside a World.run the run's world already stands, so a call "
        "whose arguments agree returns at once and one that disagrees raises naming what disagrees "
        "(under python -m simcomm.run the first call creates the rank's group and a second raises "
        "torch's ValueError); everywhere else it is torch's own call",
        "the first World.run; in a real worker once it joined its group",
        "never: stays for the process (uninstall_init_join puts torch's back)", "process",
        ("dist.init_process_group", "c10d.init_process_group"),
        ("torch.distributed.init_process_group", f"{_C10D}.init_process_group",
         "torch.distributed.device_mesh.init_process_group")),
    Patch(
        "group-tags", f"``{_C10D}._register_pg_in_world``: a group a simcomm default group made is "
        "tagged as c10d tags one it makes itself", "simcomm.c10d.process_group",
        "c10d registers a group made by a default group's new_group under its name's tag only; the "
        "functional collectives look groups up by the default tag "
        "(``funcol.all_reduce(t, 'sum', group=[0, 1])``). Groups of other backends are unchanged",
        "with init-process-group", "never: stays for the process", "process",
        ("c10d._register_pg_in_world",), (f"{_C10D}._register_pg_in_world",)),
    Patch(
        "backend-name", "``torch.distributed.Backend``: the backend name ``\"simcomm\"`` registered",
        "simcomm.c10d.process_group",
        "c10d creates a default group through a registered backend's constructor",
        "the first World.run", "never (torch has no unregister)", "process",
        ("dist.Backend.register_backend()",)),
    Patch(
        "rank-thread-autograd", "autograd's device threads off on each rank thread "
        "(``torch.autograd.set_multithreading_enabled(False)``, thread-local)", "simcomm.sim.world",
        "backward runs on the rank thread, where the scheduler sees its waits", "each rank thread's start",
        "with the thread", "thread", ("torch.autograd.set_multithreading_enabled()",)),
    # -- what each process has to itself, given to each virtual rank ---------------------------
    Patch(
        "rank-argv-main", "``sys.argv`` and ``sys.modules['__main__']`` (and torch's, Python's and "
        "NumPy's default generator states, written in place): swapped at each turn handoff",
        "simcomm.sim.process_state",
        "each process of a real run has its own; the rank holding the turn has its own here",
        "each World.run (the caller's saved first)", "when the run ends: the caller's put back", "run",
        ("sys.argv", "sys.modules['__main__']")),
    Patch(
        "rank-modules", "``sys.modules``: the program's own Python modules imported during a run (not "
        "the standard library's, torch's, NumPy's, simcomm's or what they import) are one copy per rank, "
        "put in at each turn handoff and taken out after; ``sys.meta_path``: a finder that notes who "
        "imports a module and lets a rank whose own import fails (a process-wide registration such as "
        "a torch.library namespace) use the first rank's copy", "simcomm.sim.rank_modules",
        "each process of a real run imports its modules itself: a library's module-level state "
        "(accelerate's PartialState, a process_group_manager global, a logger set up by rank) is per rank",
        "each World.run (the finder; a rank's modules at its first import)",
        "when the run ends: the run's modules leave sys.modules, the finder sys.meta_path", "run",
        ("del sys.modules[name]", "sys.modules[spec.name]", "setattr(module)")),
    Patch(
        "rank-environ", "``os.environ``: a view resolving to the calling rank thread's own "
        "variables", "simcomm.sim.process_state",
        "torchrun gives each process RANK, LOCAL_RANK, WORLD_SIZE...; python -m simcomm.run gives "
        "each rank thread its own. The C environment (getenv, child processes started without env=) "
        "follows the rank holding the turn, for the variables that differ from the process's",
        "while any rank_environ block is active (simcomm.run's ranks)",
        "when the last one ends: the process's os.environ object and C environment are put back", "run",
        ("os.environ",)),
    Patch(
        "rank-threads", "``threading.Thread.start`` and ``threading.Thread.__init__``: a thread started "
        "by a rank thread (or by one of its threads) runs inside the rank's thread-local state (its "
        "torch.distributed world, os.environ view, output tag, virtual GPU mode, seed, autograd on "
        "its own thread) and may "
        "communicate as the rank; one made there without daemon= is waited for as the rank ends",
        "simcomm.sim.process_state",
        "a thread of a process belongs to that process: a background thread's dist.all_reduce is the "
        "rank's, its prints carry the rank's tag, and a process exits once its non-daemon threads "
        "have; on every thread that is no rank's, both methods behave as Python's own",
        "the first World.run", "never: stays for the process", "process",
        ("threading.Thread.start", "threading.Thread.__init__", "torch.autograd.set_multithreading_enabled()"),
        ("threading.Thread.start", "threading.Thread.__init__")),
    Patch(
        "rank-cwd", "``os.chdir`` and ``os.fchdir``: on a rank's thread (or a thread it started), the "
        "new directory is the rank's; the process's working directory is then swapped to the rank's "
        "at each turn handoff", "simcomm.sim.process_state",
        "each process of a torchrun run has its own working directory: a rank's os.chdir must not move "
        "the other ranks (relative paths, a relative script path) nor the caller after the run; on "
        "every other thread both are os's own", "the first World.run",
        "never: stays for the process (a run that changed directories puts the caller's back as it "
        "ends)", "process", ("os.chdir", "os.fchdir"), ("os.chdir", "os.fchdir")),
    Patch(
        "rank-warnings", "``warnings.filters``, ``warnings.showwarning``, ``warnings._showwarnmsg_impl``, "
        "``warnings._defaultaction``, ``warnings._onceregistry`` and the ``__warningregistry__`` of each "
        "module a warning was shown from during the run: each rank's own, swapped at each turn handoff once "
        "a rank changed or used them; ``warnings._filters_mutated`` and ``warnings._showwarnmsg``: "
        "wrapped to count those changes (a filter added by a module's import goes to every rank)",
        "simcomm.sim.rank_warnings",
        "each process of a torchrun run has its own warnings state: one rank's catch_warnings(record=True) "
        "recorded, and its simplefilter silenced, the other ranks' warnings, and a warning one rank showed "
        "was not shown by the next; a program that never touches warnings pays one integer comparison per "
        "handoff",
        "each World.run (the wrappers; a rank's own state once the state was touched)",
        "when the run ends: the caller's state and Python's own functions put back", "run",
        ("warnings._filters_mutated", "warnings._showwarnmsg", "warnings.filters", "warnings.showwarning",
         "warnings._showwarnmsg_impl", "warnings._defaultaction", "warnings._onceregistry"),
        ("warnings._filters_mutated", "warnings._showwarnmsg")),
    Patch(
        "rank-pid", "``os.getpid``: on a rank's thread (or a thread it started), the rank thread's Linux "
        "thread id (``threading.get_native_id()``)", "simcomm.sim.process_state",
        "each process of a torchrun run has its own pid, and scripts name files after it "
        "(grad_{os.getpid()}.pt); a thread id is distinct per rank, stable for the run and an id of "
        "this process to the kernel (os.kill, /proc); on every other thread, and in a child process a "
        "rank forks (a DataLoader worker), it is os's own",
        "the first World.run", "never: stays for the process", "process", ("os.getpid",), ("os.getpid",)),
    Patch(
        "rank-logging", "``logging.root.handlers`` and ``logging.root.level``: the rank's own at each turn "
        "handoff (a copy of the caller's handlers in its first turn)", "simcomm.sim.process_state",
        "each process of a torchrun run configures its own logging: logging.basicConfig(format=f'[r{rank}]"
        " ...') on each rank must give each rank's records its own format (named loggers stay shared)",
        "each World.run (the caller's saved first)", "when the run ends: the caller's put back", "run",
        ("logging.root.handlers", "logging.root.level")),
    Patch(
        "rank-hooks", "torch's global hook dicts (``torch.nn.modules.module._global_forward_pre_hooks``, "
        "``_global_forward_hooks`` (with ``_always_called``, ``_with_kwargs``), ``_global_backward_pre_hooks``, "
        "``_global_backward_hooks``, ``_global_is_full_backward_hook``, the buffer, module and parameter "
        "registration hooks; ``torch.optim.optimizer._global_optimizer_pre_hooks``/``_post_hooks``): an empty "
        "set in place of the caller's during a run, a rank's own set once it registers a hook, swapped at "
        "each turn handoff", "simcomm.sim.rank_hooks",
        "each process of a torchrun run has its own global hooks (register_module_forward_pre_hook, "
        "register_optimizer_step_pre_hook ...); on shared dicts a hook one rank registered fired for every "
        "rank's modules, and CommDebugMode's module tracker (ModTracker) raised 'The Module hierarchy "
        "tracking is wrong' on ranks 1 and 2",
        "each World.run (the caller's saved first)", "when the run ends: the caller's dicts put back, untouched",
        "run", ("setattr(_module)", "setattr(_optimizer)", "_module._global_is_full_backward_hook"),
        tuple(f"torch.nn.modules.module._global_{name}" for name in (
            "forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks",
            "buffer_registration_hooks", "module_registration_hooks", "parameter_registration_hooks",
            "forward_hooks_always_called", "forward_hooks_with_kwargs"))
        + ("torch.optim.optimizer._global_optimizer_pre_hooks", "torch.optim.optimizer._global_optimizer_post_hooks")),
    Patch(
        "rank-sleep", "``time.sleep``: on a rank's own thread while its program runs, the rank hands "
        "the turn to the ranks that can run and returns once the time has passed (``time.sleep(0)``: "
        "lets them run once)", "simcomm.sim.waiting",
        "a process that sleeps leaves the CPU to the others: a rank polling a file "
        "(while not exists(p): time.sleep(0.1)) kept the turn, so the rank that writes the file never "
        "ran. On every other thread (threads a rank started too), and in a child process a rank "
        "forks (a DataLoader worker), it is Python's own",
        "the first World.run", "never: stays for the process", "process",
        ("time.sleep",), ("time.sleep",)),
    Patch(
        "rank-store-waits", "``Store.get``, ``Store.wait``, ``Store.multi_get`` (torch's TCPStore, "
        "FileStore, HashStore, PrefixStore) and ``TCPStore.__init__``: on a rank's own thread while its "
        "program runs, a missing key is polled with the turn handed on between polls; a TCPStore server "
        "waits so for its clients, a client for its server", "simcomm.sim.waiting",
        "a script's own TCPStore server on rank 0 waited for its clients holding the turn (the other "
        "ranks never ran to connect), and a get of a key another rank sets blocked until the store's "
        "timeout; each call is torch's own on every other thread and for the run's own store",
        "the first World.run", "never: stays for the process", "process",
        ("_Store.get", "_Store.wait", "_Store.multi_get", "dist.TCPStore.__init__"),
        ("torch.distributed.Store.get", "torch.distributed.Store.wait", "torch.distributed.Store.multi_get",
         "torch.distributed.TCPStore.__init__")),
    Patch(
        "rank-process-settings", "``multiprocessing``'s default context (its class: the chosen start "
        "method is per rank on rank threads) and ``signal.signal``/``signal.getsignal`` (on a rank's "
        "thread: the rank's own handler table, recorded and not installed)", "simcomm.sim.process_state",
        "each process of a torchrun run calls mp.set_start_method('spawn') once and sets its own SIGTERM "
        "handler; on rank threads the second rank's call raised 'context has already been set' and "
        "signal.signal raised 'only works in main thread'. On every other thread all three are Python's own",
        "the first World.run", "never: stays for the process", "process",
        ("multiprocessing.context._default_context.__class__", "signal.signal", "signal.getsignal"),
        ("signal.signal", "signal.getsignal")),
    Patch(
        "cuda-answers", "``torch.cuda``'s queries (is_available, device_count, current_device, "
        "set_device, device, memory_allocated, mem_get_info, memory_summary, manual_seed, get_rng_state, "
        "Stream, Event, ...; CUDA graphs: a named NotImplementedError) and ``torch.nn.Module.cuda``/``.to``",
        "simcomm.sim.cuda_map",
        "virtual GPUs (World(map_cuda=True); python -m simcomm.run without a GPU): a GPU script runs "
        "unchanged; torch.cuda answers as one GPU per rank (random state and memory statistics per "
        "rank thread) and a module's .cuda()/.to(local_rank) stays on the World's device; on every "
        "other thread the module methods are torch's own",
        "each World(map_cuda=True).run", "when the run ends", "run",
        ("setattr(torch.cuda)", "torch.nn.Module.cuda", "torch.nn.Module.to"),
        ("torch.cuda.is_available", "torch.cuda.init", "torch.cuda.device_count", "torch.cuda.current_device",
         "torch.cuda.set_device", "torch.cuda.device", "torch.cuda.synchronize", "torch.cuda.empty_cache",
         "torch.cuda.reset_peak_memory_stats", "torch.cuda.reset_max_memory_allocated",
         "torch.cuda.memory_allocated", "torch.cuda.max_memory_allocated", "torch.cuda.memory_reserved",
         "torch.cuda.max_memory_reserved", "torch.cuda.mem_get_info",
         "torch.cuda.set_per_process_memory_fraction", "torch.cuda.memory_stats",
         "torch.cuda.memory_summary", "torch.cuda.get_device_name", "torch.cuda.get_device_properties",
         "torch.cuda.get_device_capability", "torch.cuda.is_bf16_supported", "torch.cuda.manual_seed",
         "torch.cuda.manual_seed_all", "torch.cuda.seed", "torch.cuda.seed_all", "torch.cuda.initial_seed",
         "torch.cuda.get_rng_state", "torch.cuda.set_rng_state", "torch.cuda.get_rng_state_all",
         "torch.cuda.set_rng_state_all", "torch.cuda.Stream",
         "torch.cuda.Event", "torch.cuda.current_stream", "torch.cuda.default_stream", "torch.cuda.stream",
         "torch.cuda.CUDAGraph", "torch.cuda.graph", "torch.cuda.graph_pool_handle",
         "torch.cuda.make_graphed_callables", "torch.nn.Module.cuda", "torch.nn.Module.to")),
    Patch(
        "accelerator-answers", "``torch.accelerator``'s queries (is_available, current_accelerator, "
        "device_count, set_device_index, current_device_index, device_index, synchronize, current_stream, "
        "memory_allocated, get_memory_info, ...)", "simcomm.sim.cuda_map",
        "virtual GPUs: scripts written for any accelerator ask torch.accelerator, not torch.cuda; it "
        "answers as torch.cuda does (current_accelerator() is device(type='cuda'))",
        "each World(map_cuda=True).run", "when the run ends", "run",
        ("setattr(torch.accelerator)",),
        ("torch.accelerator.is_available", "torch.accelerator.current_accelerator",
         "torch.accelerator.device_count", "torch.accelerator.set_device_index", "torch.accelerator.set_device_idx",
         "torch.accelerator.current_device_index", "torch.accelerator.current_device_idx",
         "torch.accelerator.device_index", "torch.accelerator.synchronize", "torch.accelerator.current_stream",
         "torch.accelerator.empty_cache", "torch.accelerator.memory_allocated",
         "torch.accelerator.max_memory_allocated", "torch.accelerator.memory_reserved",
         "torch.accelerator.max_memory_reserved", "torch.accelerator.reset_peak_memory_stats",
         "torch.accelerator.memory_stats", "torch.accelerator.get_memory_info",
         "torch.accelerator.get_device_capability")),
    Patch(
        "virtual-gpu-wrappers", "``torch.amp.autocast_mode.autocast.__init__`` (``torch.autocast``, "
        "``torch.amp.autocast``, ``torch.cuda.amp.autocast``), "
        "``torch.nn.parallel.DistributedDataParallel.__init__``, ``torch.load`` and ``torch.get_device_module``: "
        "wrapped; DataLoader's "
        "``torch.utils.data._utils.pin_memory.pin_memory``: replaced", "simcomm.sim.cuda_map",
        "virtual GPUs: on a rank thread, autocast('cuda', dtype) is the World device's autocast with the "
        "same dtype (CUDA's float16 when none is given), and DDP's device_ids/output_device, checked "
        "against the node's virtual GPUs, are dropped (DDP of a CPU module takes none), torch.load's "
        "CUDA map_location is the World's device, and get_device_module('cuda') (or of none) is torch.cuda "
        "(torch's own would cache torch.cpu for it); on every other thread those four are torch's own. "
        "DataLoader(pin_memory=True) pins on a thread of its own, which is no rank's: its batches are "
        "passed on as they are, on every thread (nothing can be pinned without a GPU)",
        "each World(map_cuda=True).run", "when the run ends", "run",
        ("setattr(torch.amp.autocast_mode.autocast)", "torch.nn.parallel.DistributedDataParallel.__init__",
         "torch.load", "torch.get_device_module", "torch.utils.data._utils.pin_memory.pin_memory"),
        ("torch.amp.autocast_mode.autocast.__init__", "torch.nn.parallel.DistributedDataParallel.__init__",
         "torch.load", "torch.get_device_module", "torch.utils.data._utils.pin_memory.pin_memory")),
    Patch(
        "sdpa-cpu-sharding", "DTensor's sharding propagator "
        "(``DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs``): strategies registered for "
        "``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (replicated, sharded on "
        "the heads ``Shard(1)``, sharded on the batch ``Shard(0)``), with DTensor's own "
        "``register_op_strategy``", "simcomm.sim.sdpa_cpu",
        "virtual GPUs compute with the CPU's kernels: F.scaled_dot_product_attention runs the CPU's flash "
        "attention where a real GPU runs _scaled_dot_product_flash_attention, which DTensor shards by heads, "
        "so a tensor-parallel attention block (PyTorch's FSDP+TP example) stopped in its first forward. "
        "The strategies answer only on a rank thread with virtual GPUs; everywhere else (plain CPU ranks, "
        "every other thread) they raise DTensor's own 'does not have a sharding strategy registered', as "
        "a gloo process under torchrun does. An op that already has a strategy (a later torch's) keeps it",
        "the first World(map_cuda=True).run (python -m simcomm.run with virtual GPUs)",
        "never: stays for the process (torch has no unregister)", "process",
        ("propagator.register_op_strategy()",)),
    Patch(
        "storage-resize", "``torch.UntypedStorage.resize_``: the same call, then the counted size "
        "follows the storage", "simcomm.memory",
        "FSDP2 frees and re-allocates unsharded parameters with resize_, outside the dispatcher, "
        "where the memory count would not see it",
        "when the first rank of the process starts being tracked (World(memory=True), "
        "Cluster(memory=True))", "when the last tracked rank ends (torch's own method again)", "tracked",
        ("torch.UntypedStorage.resize_", "del torch.UntypedStorage.resize_"),
        ("torch.UntypedStorage.resize_",)),
    Patch(
        "mesh-values", "``DeviceMesh``'s methods and ``init_device_mesh`` (in every torch.distributed "
        "module that imported it by name): run with the rank's fake mode set aside",
        "simcomm.sim.shape",
        "on shape-only ranks a DeviceMesh keeps its rank table as a real integer tensor (bookkeeping, "
        "not model data); outside a fake mode the wrappers change nothing",
        "the first shape-only World.run", "never: stays for the process", "process",
        ("setattr(mesh_class)", "module.init_device_mesh"),
        ("torch.distributed.device_mesh.init_device_mesh", "torch.distributed.init_device_mesh",
         "torch.distributed.device_mesh.DeviceMesh.get_group", "torch.distributed.device_mesh.DeviceMesh.*")),
    Patch(
        "futex-hash", "the process's futex hash (Linux ``prctl(PR_FUTEX_HASH)``): widened to at least "
        "two slots per rank", "simcomm.sim.scheduler",
        "each waiting rank thread sleeps on a futex; with thousands of ranks a small hash made every "
        "hand-off walk hundreds of sleeping threads in the kernel",
        "each World.run (Linux 6.16 on; older kernels refuse it, harmlessly)", "never: not shrunk",
        "process", ("prctl()",)),
    Patch(
        "one-cpu", "the CPU affinity of the thread starting a shape-only run's rank threads",
        "simcomm.sim.scheduler",
        "rank threads of a shape-only run are started on one CPU (they take turns; one CPU's caches)",
        "while the rank threads are started", "at once after: the caller's own CPUs", "call",
        ("os.sched_setaffinity()",)),
    Patch(
        "gc-thresholds", "Python's garbage collector thresholds: the oldest generation's raised "
        "(and, in a shape-only World.run, the youngest's)",
        "simcomm.collector",
        "a full collection walks every object; shape-only runs of thousands of ranks and trace "
        "building make many, and only cycles wait; a young collection walks every live young "
        "object, and each of thousands of ranks set off several",
        "each shape-only World.run and each trace's events and timeline built",
        "at the end of the block (unless something inside changed them)", "run",
        ("gc.set_threshold()",)),
    Patch(
        "get-backend", "``torch.distributed.get_backend`` (and c10d's): on a rank thread of a "
        "``python -m simcomm.run`` launch, a group answers the backend the script's "
        "init_process_group asked for (``\"gloo\"``) instead of ``\"simcomm\"``",
        "simcomm.sim.dist_world",
        "scripts and torch read it to decide (monitored_barrier runs on gloo only); on real "
        "processes it answers the backend asked for. Everywhere else it is torch's answer",
        "the first World.run", "never: stays for the process", "process",
        ("c10d.get_backend", "dist.get_backend"),
        ("torch.distributed.get_backend", f"{_C10D}.get_backend")),
    Patch(
        "run-script", "``sys.stdout``/``sys.stderr`` (rank-tagged streams), ``sys.argv`` per rank, "
        "``sys.path`` (the script's folder first), ``torch.set_num_threads`` (torchrun's "
        "OMP_NUM_THREADS)", "simcomm.run",
        "python -m simcomm.run / run_script runs a torchrun script on virtual ranks as torchrun "
        "would: each rank's output tagged, its own argv and ``__main__`` module, imports from the "
        "script's folder, one compute thread per rank",
        "each run_script launch", "when the launch ends: the caller's argv, sys.path, os.environ "
        "and thread count are put back as they were", "run",
        ("sys.stdout", "sys.stderr", "sys.argv", "sys.path.insert()", "sys.argv[:]", "sys.path[:]",
         "del os.environ[name]", "sys.modules['__main__']", "torch.set_num_threads()")),
    Patch(
        "rank-exits", "``os._exit``, ``os.abort``, ``os.kill`` and ``signal.raise_signal``: on a rank "
        "thread of a run_script launch, ``os._exit(n)``, ``os.abort()`` and a fatal signal the rank "
        "sends its own process end that rank only, with the exit status its process would have had "
        "(in a child process a rank forks, such as a DataLoader worker, they are the real calls)",
        "simcomm.run",
        "under torchrun each call ends one worker process, and the launcher reports it; on virtual "
        "ranks it would end the whole process (a notebook's kernel) and every rank with it",
        "each run_script launch", "when the launch ends", "run",
        ("os._exit", "os.abort", "os.kill", "signal.raise_signal")),
    Patch(
        "run-command-sigint", "SIGINT's handler: Python's ``default_int_handler`` where the process "
        "started with SIGINT ignored", "simcomm.run",
        "python -m simcomm.run stops on Ctrl-C as torchrun does, whose agent catches SIGINT itself; "
        "started as a background job of a non-interactive shell (SIGINT ignored) it ignored Ctrl-C",
        "when python -m simcomm.run starts (the command only, never run_script)",
        "never: the command's process ends with the run", "process", ("signal.signal()",)),
    Patch(
        "plotly-renderer", "plotly's renderers: a ``\"simcomm\"`` renderer registered and made the "
        "default", "simcomm.viz.render",
        "figures shown in JupyterLab also survive an HTML export of the notebook",
        "use_export_renderer() (simcomm.viz in a Jupyter kernel)", "never: stays for the process",
        "process", ("pio.renderers[RENDERER]", "pio.renderers.default")),
    Patch(
        "backend-devices", "``torch.distributed.Backend.backend_capability['simcomm']``: the device "
        "types the ``\"simcomm\"`` backend claims: ``cpu``, and ``cuda`` where this process has real "
        "GPUs or while a run of virtual GPUs claims it (``simcomm.c10d.process_group.claim_cuda``)",
        "simcomm.c10d.process_group",
        "c10d's BackendConfig and ShardedTensor read it: a backend claiming cuda on a machine without "
        "GPUs made ShardedTensor (and DCP's gather of one) ask for cuda, where gloo's answer is cpu",
        "the first World.run (registered with cpu, plus cuda where torch.cuda.is_available()); "
        "claim_cuda(True) adds cuda", "claim_cuda(False) takes cuda out again (not where real GPUs "
        "exist); the entry stays for the process", "process",
        ("dist.Backend.backend_capability[BACKEND_NAME]",)),
    Patch(
        "module-apply", "``torch.nn.Module._apply``: on a shape-only rank, a conversion that returns "
        "every parameter and gradient as it is (``Module.to('cpu')`` of a module on the cpu, "
        "``.float()`` of a float32 one) leaves the module as torch does, without swapping its fake "
        "parameters", "simcomm.sim.shape",
        "torch swaps fake parameters on every conversion, and the swap fails when the fake mode "
        "holds a weak reference to them (\"Couldn't swap\"), also for a conversion that changes "
        "nothing; elsewhere, and for a conversion that changes something, it is torch's own _apply",
        "the first shape-only World.run", "never: stays for the process", "process",
        ("torch.nn.Module._apply",), ("torch.nn.Module._apply",)),
    Patch(
        "shape-only-ddp", "``torch.nn.parallel.DistributedDataParallel.__new__``: "
        "``DistributedDataParallel(module, ...)`` of a module with fake tensors (a shape-only rank) "
        "makes a ``simcomm.sim.shape_ddp.ShapeOnlyDDP``, a subclass that issues DDP's collectives "
        "from Python", "simcomm.sim.shape_ddp",
        "torch's DDP checks parameter shapes, broadcasts module states and reduces gradient buckets "
        "in C++ that reads tensor data, which fake tensors do not have; a module with real tensors "
        "gets torch's own DDP",
        "the first shape-only World.run", "never: stays for the process", "process",
        ("DistributedDataParallel.__new__",), ("torch.nn.parallel.DistributedDataParallel.__new__",)),
    # -- the worker processes real starts (never the caller's process) --------------------------
    Patch(
        "worker-process", "SIGINT ignored, ``GLOO_SOCKET_IFNAME``, faulthandler on SIGUSR1, "
        "``torch.set_num_threads``, SIGKILL when the Cluster's process dies (``PR_SET_PDEATHSIG``)",
        "real.worker",
        "Ctrl-C in a notebook is the Cluster's to handle; stuck workers' stacks on demand; the "
        "threads a Cluster asks for; no worker outlives its Cluster", "at a worker's start",
        "with the worker", "worker",
        ("signal.signal()", "os.environ['GLOO_SOCKET_IFNAME']", "faulthandler.register()",
         "torch.set_num_threads()", "libc.prctl()")),
    Patch(
        "worker-default-group", "c10d's default group (and its tables) in a worker: a "
        "RealProcessGroup over the run's transport", "real.checked_pg",
        "every c10d call of a program on a worker is checked, traced and one sequence with comm.*",
        "each run on a worker", "the groups a run made are removed when it ends; the default group "
        "object stays (modules a run imported keep it)", "worker",
        ("world.pg_map[group]", "world.pg_names[group]", "world.pg_group_ranks[group]",
         "world.pg_backend_config[group]", "world.pg_to_tag[group]", "world.default_pg",
         "world.group_count", "del world.tags_to_pg[tag]")),
    Patch(
        "worker-groups", "c10d's tables in a worker: the worker's own groups hidden from the program, "
        "the default group swapped while one is created", "real.groups",
        "a program under torchrun sees its own groups only (group names count them)",
        "each group a worker creates", "stays for the worker", "worker",
        ("c10d._world.default_pg", "c10d._world.pg_group_ranks[group]", "del world.tags_to_pg[key]")),
    # -- shape-only ranks, continued --------------------------------------------------------------
    Patch(
        "fake-pickling", "``FakeTensor.__reduce_ex__`` and ``DTensor.__reduce_ex__``: a fake tensor of a "
        "shape-only rank (its fake mode is one simcomm made) pickles as the meta tensor of its shape, "
        "dtype, strides and requires_grad (a fake Parameter as a meta Parameter), and a DTensor over "
        "one as a DTensor on the meta device; stderr says once per run that such checkpoints hold "
        "shapes and dtypes only; ``torch.multiprocessing.reductions.rebuild_tensor``: a tensor another "
        "process sent (a DataLoader worker's batch) is rebuilt on a shape-only rank as the real tensor it "
        "is, outside the rank's fake mode; and a child a shape-only rank forks leaves the fake mode "
        "(``os.register_at_fork``); ``FakeTensor.__deepcopy__``: torch's, with the real constant a rank's "
        "fake tensor keeps copied outside the fake mode (``copy.deepcopy`` of an optimizer's state)",
        "simcomm.sim.shape",
        "a program that trains and then ``torch.save``s its state dict fails on a shape-only rank with "
        "torch's own reduction (it pickles the fake mode: \"Can't pickle local object\"); every other "
        "fake tensor, and every DTensor over other tensors, pickles as torch pickles it",
        "the first shape-only World.run", "never: stays for the process", "process",
        ("FakeTensor.__reduce_ex__", "DTensor.__reduce_ex__", "FakeTensor.__deepcopy__", "reductions.rebuild_tensor"),
        ("torch._subclasses.fake_tensor.FakeTensor.__reduce_ex__", "torch.distributed.tensor.DTensor.__reduce_ex__",
         "torch._subclasses.fake_tensor.FakeTensor.__deepcopy__", "torch.multiprocessing.reductions.rebuild_tensor")),
    Patch(
        "fake-tolist", "``FakeTensor.tolist``: a fake tensor with a value (a shape-only rank's bookkeeping "
        "computed from constants, or an index draw from a generator whose state is known) answers with "
        "its value's list at once; ``FakeTensor.__format__``: a 0-dim fake tensor formats as its number "
        "(``.item()``) where it has a value or a format spec is given, as torch formats a plain tensor",
        "simcomm.sim.shape",
        "torch's own reads a fake tensor element by element (one dispatched item() each): a sampler's "
        "randperm(n).tolist() of a million indices took minutes; torch formats a fake tensor as an object, "
        "so ``f\"{t:.4f}\"`` of a number the rank knows raised TypeError (and of one it does not know, "
        "TypeError instead of the named error); every other tensor gets torch's own",
        "the first shape-only World.run", "never: stays for the process", "process",
        ("FakeTensor.tolist", "FakeTensor.__format__"),
        ("torch._subclasses.fake_tensor.FakeTensor.tolist", "torch._subclasses.fake_tensor.FakeTensor.__format__")),
    Patch(
        "trunc-normal", "``torch.nn.init._no_grad_trunc_normal_`` (what ``trunc_normal_`` calls): a fake "
        "tensor is left as it is", "simcomm.sim.shape",
        "torch's redraws values outside the bounds until none is left, reading ``mask.any()`` of random "
        "data, which a shape-only rank does not have (ShapeOnlyError in a model's weight "
        "initialisation); every other tensor gets torch's own",
        "the first shape-only World.run", "never: stays for the process", "process",
        ("torch.nn.init._no_grad_trunc_normal_",), ("torch.nn.init._no_grad_trunc_normal_",)),
)

STACK_DECISIONS: tuple[StackDecision, ...] = (
    StackDecision("simcomm.sim.dist_world:_forwarded.get", "whether a read of c10d's state is a module "
                  "body's (the process's state) or a rank's",
                  "torch evaluates ``group=group.WORLD`` defaults when a module is imported; a module "
                  "imported on a rank thread must not capture that rank's group"),
    StackDecision("simcomm.sim.dist_world:_from_module_body", "the same, for every other attribute: "
                  "a module being imported (importlib's frame), not a script's top level run as __main__",
                  "see _forwarded"),
    StackDecision("simcomm.c10d.process_group:_p2p_async", "whether a send/recv came from "
                  "dist.send/dist.recv (blocking) or anywhere else (async)",
                  "c10d calls the same ProcessGroup method for both"),
    StackDecision("simcomm.c10d.process_group:_new_group_call", "the backend dist.new_group asked for "
                  "and the ``pg_tag`` c10d._new_group_with_tag was given (its locals ``backend``, "
                  "``pg_tag``)",
                  "c10d passes neither on to a default group's new_group: a new_group of another backend is "
                  "refused or made fake, and a second group asked for with the same ranks and tag is the "
                  "first, as c10d returns it for the groups it makes itself"),
    StackDecision("simcomm.lessons.verdicts:helper_in_caller", "whether the learner's cell that calls an "
                  "exercise checker computed its answer with the lesson's own helper (the verdict names it)",
                  "a checker gets a number, which does not say how it was computed; the cell's code does"),
    StackDecision("simcomm.c10d.process_group:_register_pg_in_world", "the ``pg_tag`` new_group was "
                  "given (c10d's _new_group_with_tag local), and whether the group it registers is the tagged "
                  "group it already has (registered once, as c10d does)", "see the group-tags patch"),
    StackDecision("simcomm.sim.rank_warnings:_counted_filters_mutated", "whether a change of the warning "
                  "filters is a filter added while a module is imported (``warnings._add_filter``'s locals "
                  "``item`` and ``append``, below importlib's frame)", "the module is imported once for the "
                  "process, where each torchrun process imports it: the filter goes to every rank"),
    StackDecision("simcomm.sim.rank_warnings:_noted_showwarnmsg", "which module's ``__warningregistry__`` a "
                  "shown warning was written to (the frame at the file and line the warning names)",
                  "the registry of each such module is made per rank"),
    StackDecision("simcomm.sim.rank_modules:RankModules.program_import", "whether an import during a "
                  "run comes from the program (its first frame outside importlib belongs to __main__, the "
                  "World program's module or a per-rank module) or from torch, NumPy, simcomm or the "
                  "standard library", "the program's modules are per rank; what torch imports lazily "
                  "must stay one copy for the process"),
)

#: functions that read frames only to name where a program is, in messages and reports
STACK_NAMING = ("simcomm.reports:program_frame", "simcomm.reports:program_location",
                "simcomm.sim.waits:describe_waits", "simcomm.sim.scheduler:RunState.join_rank_threads")


def patch(name: str) -> Patch:
    """The row of ``PATCHES`` named ``name``."""
    for row in PATCHES:
        if row.name == name:
            return row
    raise KeyError(f"no process-wide patch named {name!r}; known: {[row.name for row in PATCHES]}")
