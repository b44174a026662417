"""simcomm.patches is the one list of what simcomm changes in a process: complete and true.

* every assignment (``setattr``, ``del``) to an attribute of torch, ``os``,
  ``sys``, ``gc`` and the like in ``simcomm/`` and ``real/``, and every call
  that sets process-wide state (``gc.set_threshold``, ``torch.set_num_threads``,
  ...), is a ``code`` entry of a row whose ``by`` is that module, and every
  row's ``code`` is still in its module;
* every function that decides by reading the caller's frames is listed;
* in a fresh process: during a run every listed attribute is simcomm's, every
  attribute simcomm replaced in torch's namespaces is listed, and after the run
  those of run-long rows are torch's own again while process-long rows stay;
* docs/process_patches.md names every row.
"""
from __future__ import annotations

import ast
import fnmatch
import json
import os
import subprocess
import sys
from pathlib import Path

from simcomm.patches import LIFETIMES, PATCHES, STACK_DECISIONS, STACK_NAMING

ROOT = Path(__file__).resolve().parents[2]

#: the modules whose attributes are process-wide state
ROOT_MODULES = ("torch", "os", "sys", "numpy", "random", "gc", "plotly", "signal", "faulthandler", "threading",
                "time", "logging", "multiprocessing", "warnings")
#: calls that change process-wide state without an assignment
PROCESS_CALLS = ("gc.set_threshold", "torch.set_num_threads", "signal.signal", "faulthandler.register",
                 "_set_thread_isolation_mode", "set_multithreading_enabled", "register_backend",
                 "sys.path.insert", "sys.path.remove", "sys.path.append", "os.putenv",
                 "sys.setswitchinterval", "sched_setaffinity", "prctl", "register_op_strategy")


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _sites(path: Path) -> set[str]:
    """What ``path`` changes in the process, each as its source writes the target."""
    tree = ast.parse(path.read_text())
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update((alias.asname or alias.name).split(".")[0] for alias in node.names
                         if alias.name.split(".")[0] in ROOT_MODULES)
        elif (isinstance(node, ast.ImportFrom) and not node.level and node.module
              and node.module.split(".")[0] in ROOT_MODULES):
            roots.update(alias.asname or alias.name for alias in node.names)
    for node in ast.walk(tree):
        # a local name for a class of those modules, or for c10d's world; a loop over sys.modules
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute)
                and _root(node.value) in roots
                and (node.value.attr[:1].isupper() or node.value.attr == "_world")):
            roots.update(target.id for target in node.targets if isinstance(target, ast.Name))
        if isinstance(node, ast.For) and "sys.modules" in ast.unparse(node.iter):
            roots.update(name.id for name in ast.walk(node.target) if isinstance(name, ast.Name))
    found: set[str] = set()

    def target(node: ast.AST, prefix: str = "") -> None:
        if isinstance(node, (ast.Tuple, ast.List)):
            for element in node.elts:
                target(element, prefix)
        elif isinstance(node, (ast.Attribute, ast.Subscript)) and _root(node) in roots:
            found.add(prefix + ast.unparse(node))

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for each in node.targets:
                target(each)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            target(node.target)
        elif isinstance(node, ast.Delete):
            for each in node.targets:
                target(each, "del ")
        elif isinstance(node, ast.Call):
            function = ast.unparse(node.func)
            if function == "setattr" and node.args and _root(node.args[0]) in roots:
                found.add(f"setattr({ast.unparse(node.args[0])})")
            elif any(function == call or function.endswith("." + call) for call in PROCESS_CALLS):
                found.add(function + "()")
    return found


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> list[Path]:
    return sorted(path for folder in ("simcomm", "real") for path in (ROOT / folder).rglob("*.py"))


def test_every_patch_in_the_code_is_a_row_and_every_row_is_in_the_code():
    listed = {(row.by, code) for row in PATCHES for code in row.code}
    found = {(_module_name(path), site) for path in _sources() for site in _sites(path)}
    unlisted = sorted(found - listed)
    assert not unlisted, (f"these change process-wide state but are no row's code in "
                          f"simcomm/patches.py (module, target): {unlisted}")
    stale = sorted(listed - found)
    assert not stale, f"these rows of simcomm/patches.py name code that is not there: {stale}"


def test_rows_are_filled_in():
    names = [row.name for row in PATCHES]
    assert len(names) == len(set(names))
    for row in PATCHES:
        assert row.lifetime in LIFETIMES, row.name
        assert row.what and row.why and row.installed and row.removed and row.code, row.name
        assert row.checked_on and all(version.count(".") == 2 for version in row.checked_on), row.name
        assert (ROOT / (row.by.replace(".", "/") + ".py")).exists(), row.by


def _frame_readers() -> set[str]:
    """``module:function`` (``outer.inner`` for a nested function, ``Class.method``) of every
    function that reads a frame's code or locals in its own body."""
    found = set()

    def visit(node: ast.AST, module: str, names: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = (*names, child.name)
                if not isinstance(child, ast.ClassDef) and _reads_frames(child):
                    found.add(f"{module}:{'.'.join(inner)}")
                visit(child, module, inner)
            else:
                visit(child, module, names)

    for path in _sources():
        visit(ast.parse(path.read_text()), _module_name(path), ())
    return found


def _reads_frames(function: ast.AST) -> bool:
    """Whether ``function``'s own body (not a function nested in it) reads ``f_code``/``f_locals``."""
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Attribute) and node.attr in ("f_locals", "f_code"):
            return True
        stack.extend(ast.iter_child_nodes(node))
    return False


def test_every_decision_by_stack_inspection_is_listed():
    listed = {decision.where for decision in STACK_DECISIONS} | set(STACK_NAMING)
    readers = _frame_readers()
    assert readers - listed == set(), ("these read the caller's frames and are not in "
                                       f"simcomm.patches.STACK_DECISIONS or STACK_NAMING: {readers - listed}")
    assert listed - readers == set(), f"listed but not reading frames: {listed - readers}"


_PROBE = r"""
import importlib, json
import torch, torch.distributed as dist
import simcomm
from simcomm.patches import PATCHES

def resolve(dotted):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    for part in parts[i:]:
        obj = getattr(obj, part)
    return obj

NAMESPACES = ("torch.cuda", "torch.distributed", "torch.distributed.distributed_c10d",
              "torch.distributed.device_mesh", "torch.distributed.device_mesh.DeviceMesh",
              "torch.nn.Module", "torch.UntypedStorage", "torch.Tensor")

def simcomm_values():
    found = set()
    for space in NAMESPACES:
        for name, value in list(vars(resolve(space)).items()):
            module = getattr(value, "__module__", None) if callable(value) else type(value).__module__
            if isinstance(module, str) and module.split(".")[0] in ("simcomm", "real"):
                found.add(f"{space}.{name}")
    return found

attributes = [a for row in PATCHES for a in row.attributes if not a.endswith(".*")]
original = {a: resolve(a) for a in attributes}
changed = lambda: sorted(a for a in attributes if resolve(a) is not original[a])
report = {"before": sorted(simcomm_values())}

def program(comm):
    dist.all_reduce(torch.ones(2))
    if comm.rank == 0:
        report["during"] = changed()
        report["found"] = sorted(simcomm_values())

simcomm.World(2, map_cuda=True, memory=True).run(program)
report["after"] = changed()
simcomm.World(2, tensors="shape").run(lambda comm: None)
report["after_shape"] = changed()
report["found"] += sorted(simcomm_values())
print(json.dumps(report))
"""


def test_a_run_installs_the_listed_patches_and_removes_the_run_long_ones():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["before"] == [], "importing simcomm changed torch"
    rows = {attribute: row for row in PATCHES for attribute in row.attributes}
    shape_only = {attribute for attribute in rows if rows[attribute].name in ("mesh-values", "module-apply", "fake-pickling",
                                                                                  "trunc-normal", "fake-tolist", "shape-only-ddp")}
    every = {attribute for attribute in rows if not attribute.endswith(".*")}
    assert set(report["during"]) == every - shape_only
    process_long = {attribute for attribute in every if rows[attribute].lifetime == "process"}
    assert set(report["after"]) == process_long - shape_only, "a run-long patch outlived its run"
    assert set(report["after_shape"]) == process_long
    unlisted = {name for name in report["found"]
                if not any(fnmatch.fnmatchcase(name, pattern) for pattern in rows)}
    assert not unlisted, f"simcomm replaced these, and simcomm/patches.py does not list them: {unlisted}"


def test_the_docs_page_names_every_row():
    text = (ROOT / "docs" / "process_patches.md").read_text()
    missing = [row.name for row in PATCHES if f"`{row.name}`" not in text]
    assert not missing, f"docs/process_patches.md does not name these rows of simcomm.patches: {missing}"
