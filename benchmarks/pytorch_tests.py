"""Run test classes from a PyTorch source checkout on simcomm's virtual ranks.

PyTorch's distributed tests (``MultiProcessTestCase`` and its subclasses
``DTensorTestBase`` and ``FSDPTest``; ``MultiThreadedTestCase``) start
``world_size`` processes (or threads) and call the test method on each with
``self.rank`` set. Here each test method is one ``simcomm.World(world_size).run``
program instead: every rank builds its own test-case instance, sets ``rank`` and
``file_name`` as the base class's ``_run`` does in each child process, does the
initialisation that the base class would do there (``FSDPTest``: ``init_process_group``
with its backend and a barrier; ``MultiThreadedTestCase``: ``init_process_group``;
the others initialise in the test, e.g. DTensor's ``with_comms``, and their
``init_process_group`` joins the run), seeds the generators as ``run_test`` does
(``common_utils.set_rng_seed``), calls the test method, and destroys the default
group afterwards where the class asks for it (``destroy_pg_upon_exit``). The
World is made with ``explicit_init=True``, so a test sees no default group until
it creates one, as in a freshly spawned process. The device is the CPU.

A skip is what the base class counts as one: ``unittest.SkipTest`` or a
``sys.exit`` with one of ``TEST_SKIPS``' exit codes (``skip_if_lt_x_gpu`` and its
kind). Classes that are neither multi-process nor multi-threaded run in one
process under PyTorch's own runner; they are listed and not run, as are DTensor's
``...WithLocalTensor`` classes (``create_local_tensor_test_class``), which simulate every
rank in one process.

Usage (the PyTorch checkout's ``test/`` tree should be the release of the installed
torch; PyTorch's test files are not part of this repository)::

    python benchmarks/pytorch_tests.py --pytorch /path/to/pytorch \\
        distributed/test_device_mesh.py distributed/tensor/parallel/test_tp_style.py

A path may end in ``::Class`` or ``::Class::test_name``. Paths are taken relative
to ``<pytorch>/test`` (or as given, if that file exists). Each file runs in a fresh
interpreter (``--timeout`` seconds per test method, as ``World.run(timeout=)``).
PyTorch's test utilities import ``expecttest``; where it is not installed a stand-in is
used (tests that compare against inline expected text then fail).

Output: one line per test, ``PASS``/``FAIL``/``SKIP``, its class and name, and for a
failure or skip the first line of its error or reason; then totals per file.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import unittest
from typing import Any

RESULT_TAG = "@@result "


# --------------------------------------------------------------------------- one file, in a child

def _first_line(error: BaseException) -> str:
    """``Type: first line of the message`` of the innermost cause of ``error``."""
    while error.__cause__ is not None:
        error = error.__cause__
    # PyTorch's TestCase appends a "To execute this test, run ..." note (inside a KeyError's repr too)
    text = str(error).split("To execute this test")[0].replace("\\n", "\n").strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _skip_reason(code: Any) -> str | None:
    """The TEST_SKIPS message of a ``sys.exit`` code, or None for an exit that is no skip."""
    from torch.testing._internal.common_distributed import TEST_SKIPS
    for skip in TEST_SKIPS.values():
        if skip.exit_code == code:
            return skip.message
    return None


def _rank_program(comm: Any, cls: type, name: str, file_name: str) -> tuple[str, str]:
    """One rank of one test method: what the base class's child process does."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal import common_utils
    from torch.testing._internal.common_distributed import MultiThreadedTestCase

    fsdp_test = _fsdp_test_class()
    case = cls(name)
    case.rank = comm.rank
    case.file_name = file_name
    try:
        if fsdp_test is not None and issubclass(cls, fsdp_test):
            from torch.testing._internal import common_fsdp
            dist.init_process_group(init_method=case.init_method,
                                    backend=common_fsdp.DISTRIBUTED_BACKEND,
                                    world_size=int(case.world_size), rank=case.rank)
            dist.barrier()
            torch._dynamo.reset()
        elif issubclass(cls, MultiThreadedTestCase):
            dist.init_process_group(backend="gloo", rank=case.rank, world_size=case.world_size,
                                    init_method=f"file://{file_name}")
        common_utils.set_rng_seed()
        getattr(case, name)()
        if fsdp_test is not None and issubclass(cls, fsdp_test):
            torch._dynamo.reset()
            dist.barrier()
            dist.destroy_process_group()
    except unittest.SkipTest as skip:
        return "skip", str(skip).splitlines()[0] if str(skip) else "skipped"
    except SystemExit as exit_:
        reason = _skip_reason(exit_.code)
        if reason is None:
            raise RuntimeError(f"rank {comm.rank} called sys.exit({exit_.code!r})") from None
        return "skip", reason
    if getattr(case, "destroy_pg_upon_exit", True) or issubclass(cls, MultiThreadedTestCase):
        try:
            dist.destroy_process_group()
        except (AssertionError, ValueError, RuntimeError):
            pass      # the test destroyed it itself
    return "pass", ""


def _fsdp_test_class() -> type | None:
    module = sys.modules.get("torch.testing._internal.common_fsdp")
    return getattr(module, "FSDPTest", None)


def _distributed_kind(cls: type) -> str | None:
    from torch.testing._internal.common_distributed import MultiProcessTestCase, MultiThreadedTestCase
    if _single_process_dtensor(cls):
        return None
    if issubclass(cls, MultiProcessTestCase):
        return "process"
    if issubclass(cls, MultiThreadedTestCase):
        return "thread"
    return None


def _single_process_dtensor(cls: type) -> bool:
    """DTensor's ``LocalDTensorTestBase`` and ``LocalDTensorOpTestBase`` classes (made by
    ``create_local_tensor_test_class``) run every rank in one process on a ``"fake"`` group
    with local tensors; they start no processes or threads."""
    module = sys.modules.get("torch.testing._internal.distributed._tensor.common_dtensor")
    bases = tuple(base for base in (getattr(module, "LocalDTensorTestBase", None),
                                    getattr(module, "LocalDTensorOpTestBase", None)) if base)
    return bool(bases) and issubclass(cls, bases)


def _shim_testing_names() -> list[str]:
    """Stand-ins for what PyTorch's test utilities import and this environment lacks, so a
    test file imports: the ``expecttest`` package (its ``TestCase`` is ``unittest.TestCase``
    here; only ``assertExpectedInline`` tests need the real one), and names newer test files
    import from ``common_utils`` that this torch lacks (inert; tests do not depend on them)."""
    import enum
    import types

    added = []
    if importlib.util.find_spec("expecttest") is None:
        stand_in = types.ModuleType("expecttest")
        stand_in.TestCase = unittest.TestCase
        sys.modules["expecttest"] = stand_in
        added.append("the expecttest package")
    from torch.testing._internal import common_utils
    if not hasattr(common_utils, "HardwareClassification"):
        class HardwareClassification(enum.Enum):   # a class attribute read by PyTorch's CI sharding
            GENERIC = "generic"
            ACCELERATOR = "accelerator"
        common_utils.HardwareClassification = HardwareClassification
        added.append("common_utils.HardwareClassification")
    return added


def run_file(path: str, selector: list[str], timeout: float) -> None:
    """Run one test file's distributed test classes; print result lines for the parent."""
    import simcomm

    sys.argv = [path]                      # PyTorch's test utilities read sys.argv at import
    for entry in (os.path.dirname(path), _test_root(path)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    for name in _shim_testing_names():
        print(f"note: {name} is missing here; a stand-in was added")
    module_name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)

    loader = unittest.TestLoader()
    for cls_name, cls in sorted(vars(module).items()):
        if not (isinstance(cls, type) and issubclass(cls, unittest.TestCase)):
            continue
        if getattr(cls, "__module__", None) != module_name or cls_name.startswith("_"):
            continue
        if selector and selector[0] != cls_name:
            continue
        names = loader.getTestCaseNames(cls)
        if len(selector) > 1:
            names = [n for n in names if n == selector[1]]
        kind = _distributed_kind(cls)
        if kind is None:
            if names:
                print(f"note: {cls_name}: {len(names)} single-process tests, not run here")
            continue
        for name in names:
            _emit(_run_test(cls, name, timeout, simcomm), cls_name, name)


def _run_test(cls: type, name: str, timeout: float, simcomm: Any) -> tuple[str, str]:
    if getattr(cls, "__unittest_skip__", False):
        return "skip", str(getattr(cls, "__unittest_skip_why__", "skipped"))
    probe = cls(name)
    world_size = int(probe.world_size)
    with tempfile.NamedTemporaryFile(delete=False) as handle:
        file_name = handle.name       # the rendezvous file the base class's setUp makes
    try:
        results = simcomm.World(world_size, explicit_init=True).run(
            _rank_program, cls, name, file_name, timeout=timeout)
    except BaseException as error:     # noqa: BLE001 - a failing test, reported
        if isinstance(error, KeyboardInterrupt):
            raise
        if os.environ.get("PYTORCH_TESTS_TRACEBACK"):
            traceback.print_exc()
        return "fail", _first_line(error)
    finally:
        try:
            os.remove(file_name)
        except OSError:
            pass
    skips = [reason for status, reason in results if status == "skip"]
    if skips:
        return "skip", skips[0]
    return "pass", ""


def _emit(result: tuple[str, str], cls_name: str, name: str) -> None:
    status, message = result
    print(RESULT_TAG + json.dumps({"status": status, "test": f"{cls_name}.{name}", "message": message}),
          flush=True)


def _test_root(path: str) -> str:
    """``<pytorch>/test`` for a path inside it (for imports such as ``from distributed...``)."""
    parts = os.path.abspath(path).split(os.sep)
    if "test" in parts:
        index = len(parts) - 1 - parts[::-1].index("test")
        return os.sep.join(parts[:index + 1])
    return ""


# --------------------------------------------------------------------------- the parent

def _resolve(pytorch: str | None, spec: str) -> tuple[str, list[str]]:
    path, *selector = spec.split("::")
    for candidate in ([os.path.join(pytorch, "test", path), os.path.join(pytorch, path)] if pytorch else []) + [path]:
        if os.path.isfile(candidate):
            return os.path.abspath(candidate), selector
    raise SystemExit(f"pytorch_tests: no test file {path!r} (looked under {pytorch!r}/test)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pytorch", help="a PyTorch source checkout (its test/ tree)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per test method")
    parser.add_argument("--one-file", help=argparse.SUPPRESS)
    parser.add_argument("files", nargs="*", help="test files, relative to <pytorch>/test, "
                                                  "optionally ::Class or ::Class::test")
    args = parser.parse_args(argv)
    if args.one_file:
        path, *selector = args.one_file.split("::")
        run_file(path, selector, args.timeout)
        return 0
    if not args.files:
        parser.error("name at least one test file")
    totals_by_file = []
    for spec in args.files:
        path, selector = _resolve(args.pytorch, spec)
        counts = {"pass": 0, "fail": 0, "skip": 0}
        print(f"== {spec}", flush=True)
        started = time.perf_counter()
        child = subprocess.run([sys.executable, os.path.abspath(__file__), "--timeout", str(args.timeout),
                                "--one-file", "::".join([path, *selector])],
                               capture_output=True, text=True)
        for line in child.stdout.splitlines():
            if line.startswith(RESULT_TAG):
                result = json.loads(line[len(RESULT_TAG):])
                counts[result["status"]] += 1
                message = f"  ({result['message']})" if result["message"] else ""
                print(f"{result['status'].upper():4} {result['test']}{message}")
            elif line.startswith("note: "):
                print(line)
        if child.returncode != 0:
            lines = child.stderr.strip().splitlines()
            print(f"ERROR the file did not run to its end (exit {child.returncode}): "
                  f"{lines[-1] if lines else ''}")
        run = sum(counts.values())
        print(f"-- {spec}: {run} run, {counts['pass']} passed, {counts['fail']} failed, "
              f"{counts['skip']} skipped ({time.perf_counter() - started:.0f} s)\n", flush=True)
        totals_by_file.append((spec, run, counts))
    print("file | run | passed | failed | skipped")
    for spec, run, counts in totals_by_file:
        print(f"{spec} | {run} | {counts['pass']} | {counts['fail']} | {counts['skip']}")
    total = {key: sum(c[key] for _, _, c in totals_by_file) for key in ("pass", "fail", "skip")}
    print(f"all | {sum(total.values())} | {total['pass']} | {total['fail']} | {total['skip']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
