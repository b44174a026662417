"""The import rule docs/architecture.md draws: which layer may import which.

Every import in ``simcomm/`` and ``real/`` counts, the ones inside functions too.
A layer may import itself and the layers ``ALLOWED`` names; the rule has no
cycle, and no module imports another package's private (underscore) name.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Entry points: the package's front door, the launcher, the backend switch and the
# handout builder may use every layer.
ENTRY = {"simcomm", "simcomm.run", "simcomm.backend", "simcomm.handout"}
VERIFY = {"real.verify", "real.cases", "real.model_cases", "real.faults"}

ALLOWED = {
    "core": set(),
    "c10d": {"core"},
    "sim": {"core", "c10d"},
    "real": {"core", "c10d"},
    "verify": {"core", "c10d", "real", "sim", "parallel"},
    "parallel": {"core", "sim"},
    "models": {"core", "parallel"},
    "planning": {"core", "sim", "parallel", "models"},
    "viz": {"core", "sim", "parallel", "models", "planning"},
    "lessons": {"core", "c10d", "sim", "parallel", "models", "planning", "viz"},
    "entry": {"core", "c10d", "sim", "real", "verify", "parallel", "models", "planning",
              "viz", "lessons"},
}


def layer(module: str) -> str:
    if module in ENTRY:
        return "entry"
    if module in VERIFY:
        return "verify"
    parts = module.split(".")
    if parts[0] == "real":
        return "real"
    if len(parts) > 1 and parts[1] in ALLOWED:
        return parts[1]
    return "core"  # simcomm's top-level modules and simcomm.model (the cost model)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str):
    """(target module, imported name or None, line) for every simcomm/real import."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                yield target, alias.name, node.lineno


def _modules():
    paths = sorted((ROOT / "simcomm").rglob("*.py")) + sorted((ROOT / "real").rglob("*.py"))
    return {_module_name(p): p for p in paths}


def _resolve(target: str, imported: str | None, modules) -> str:
    if imported and f"{target}.{imported}" in modules:
        return f"{target}.{imported}"
    return target


def import_violations():
    modules = _modules()
    found = []
    for name, path in modules.items():
        for target, imported, line in _imports(path, name):
            if target.split(".")[0] not in ("simcomm", "real"):
                continue
            resolved = _resolve(target, imported, modules)
            src, dst = layer(name), layer(resolved)
            where = f"{path.relative_to(ROOT)}:{line}"
            if src != dst and dst not in ALLOWED[src]:
                found.append(f"{where}: {src} may not import {dst} ({resolved})")
            if (imported and imported.startswith("_") and not imported.startswith("__")
                    and resolved.rpartition(".")[0] != name.rpartition(".")[0]
                    and resolved != name.rpartition(".")[0]):
                found.append(f"{where}: private name {imported} imported from {resolved}")
    return found


def test_every_import_follows_the_layer_rule():
    assert import_violations() == []


def test_the_rule_has_no_cycle():
    seen, done = set(), set()

    def visit(node, path):
        assert node not in seen or node in done, f"cycle: {' -> '.join(path + [node])}"
        if node in done:
            return
        seen.add(node)
        for nxt in sorted(ALLOWED[node]):
            visit(nxt, path + [node])
        done.add(node)

    for node in ALLOWED:
        visit(node, [])


def test_every_module_has_a_layer_the_rule_knows():
    assert all(layer(name) in ALLOWED for name in _modules())


def test_the_rule_can_fail(tmp_path, monkeypatch):
    """A core module importing the simulator is reported (the check is not vacuous)."""
    pkg = tmp_path / "simcomm"
    (pkg / "sim").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sim" / "__init__.py").write_text("")
    (pkg / "sim" / "world.py").write_text("_hidden = 1\n")
    (pkg / "checks.py").write_text("def f():\n    from simcomm.sim.world import _hidden\n")
    (tmp_path / "real").mkdir()
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path, raising=False)
    globals()["ROOT"], saved = tmp_path, ROOT
    try:
        found = import_violations()
    finally:
        globals()["ROOT"] = saved
    assert any("core may not import sim" in f for f in found), found
    assert any("private name _hidden" in f for f in found), found
