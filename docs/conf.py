"""Sphinx configuration: the reference pages (Markdown, MyST) and the API pages (autodoc).

Build (from the repository root):

    python -m sphinx -b html -W --keep-going docs docs/_build/html
"""
from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path

from sphinx.util.nodes import make_refnode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))            # simcomm and real, also without `pip install -e .`
os.environ.setdefault("SIMCOMM_BACKEND", "sim")

project = "simcomm"
author = "the simcomm authors"
release = version = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "**/_build"]

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3                 # [text](page.md#a-heading) links are checked too

autosummary_generate = False             # nothing is written into docs/ while building
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"ignore-module-all": True}

# -- cross-references ------------------------------------------------------------------------
# Nitpicky: every :class:, :func:, :mod:, :meth:, :data:, :attr: reference (written in a
# docstring or a page, or made by autodoc from an annotation) must resolve, so a dead one fails
# the build (-W).
nitpicky = True

# The build has no network, so no intersphinx: references into packages that are not this
# project have no target here and are ignored, by the package they point into. Ignored are
# torch (also as its annotations are written: `nn.`, `dist.`, `F.`, and the bare names of
# the torch classes imported under their own name), the standard library, numpy, plotly,
# nbformat, and c10d's C++ classes (`c10d::Work`, from torch's pybind signatures). Nothing of
# simcomm or real is ignored: a stdlib module name that is also a module of this project
# (`trace`) is left out, and bare (undotted) names are ignored only as modules (:mod:).
_OWN_MODULE_NAMES = {path.stem for package in ("simcomm", "real")
                     for path in (ROOT / package).rglob("*.py")} | {"simcomm", "real"}
_STDLIB = {name for name in sys.stdlib_module_names if not name.startswith("_")} - _OWN_MODULE_NAMES
_EXTERNAL_PACKAGES = sorted(_STDLIB | {"torch", "numpy", "plotly", "nbformat"})
_TORCH_ALIASES = ["nn", "dist", "F"]                 # import torch.nn as nn, torch.distributed as dist, ...
_TORCH_CLASSES = ["Module", "ProcessGroup", "DeviceMesh", "FakeTensorMode"]  # from torch... import X


def _any_of(names):
    return "|".join(re.escape(name) for name in names)


nitpick_ignore_regex = [
    (r"py:mod", rf"(?:{_any_of(_EXTERNAL_PACKAGES)})(?:\..+)?"),
    (r"py:.*", rf"(?:{_any_of(_EXTERNAL_PACKAGES + _TORCH_ALIASES)})\..+"),
    (r"py:class", rf"(?:{_any_of(_TORCH_CLASSES)})"),
    (r"py:class", r"c10d::\w+"),
]

# alabaster ships with Sphinx; it needs no network at build time
html_theme = "alabaster"
html_theme_options = {"description": "distributed PyTorch collectives on virtual ranks",
                      "fixed_sidebar": True, "page_width": "1100px", "sidebar_width": "240px"}
html_static_path: list[str] = []
html_title = "simcomm"

#: docstrings whose reST does not parse yet (reported upstream); shown verbatim, so the
#: build stays free of warnings and every other docstring is still checked
VERBATIM_DOCSTRINGS = {"simcomm.autograd", "simcomm.parallel.zero", "real.verify.evaluate"}


def _verbatim(app, what, name, obj, options, lines):
    if name in VERBATIM_DOCSTRINGS and lines:
        lines[:] = ["::", ""] + ["    " + line if line else "" for line in lines] + [""]


def _import(name):
    """The object a dotted name names (the longest importable module, then attributes), or KeyError."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except Exception:
            continue
        try:
            for attribute in parts[split:]:
                obj = getattr(obj, attribute)
        except Exception:
            break
        return obj
    raise KeyError(name)


def _documented_as(obj, written, objects):
    """The documented full name of ``obj`` (reached as ``written``), or None: its canonical
    ``__module__.__qualname__``; else (data, properties) the one documented object of the same
    last name that is ``obj`` itself."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and f"{module}.{qualname}" in objects:
        return f"{module}.{qualname}"
    last = written.rsplit(".", 1)[-1]
    same = []
    for name in objects:
        if name.rsplit(".", 1)[-1] == last:
            try:
                if _import(name) is obj:
                    same.append(name)
            except KeyError:
                pass
    return same[0] if len(same) == 1 else None


def _resolve_alias(app, env, node, contnode):
    """missing-reference: a Python reference to a public alias of a documented object (``simcomm.World``,
    ``real.Cluster``, ``simcomm.World.run``), or to a name of the module it is written in that is
    documented where it is defined (``NOT_ANSWERED``), links to the object's documented entry.

    A private object of this project (``_Step``) is documented nowhere; a docstring names it as
    ``literal`` text, but an annotation (``-> _Step``, shown in the parameter list) makes it a
    reference: it is shown as plain text if the object exists, and left to fail if it does not."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip(".~")
    module, cls = node.get("py:module"), node.get("py:class")
    written = [f"{module}.{cls}.{target}" if module and cls else None,
               f"{module}.{target}" if module else None, target]
    objects = env.get_domain("py").objects
    for name in filter(None, written):
        if not name.startswith(("simcomm.", "real.")):
            continue                     # only this project's modules are imported here
        try:
            obj = _import(name)
        except KeyError:
            continue
        fullname = _documented_as(obj, name, objects)
        if fullname is not None:
            entry = objects[fullname]
            return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, fullname)
        last = name.rsplit(".", 1)[-1]
        if last.startswith("_") and not last.endswith("__"):
            return contnode
    return None


def setup(app):
    app.connect("autodoc-process-docstring", _verbatim)
    app.connect("missing-reference", _resolve_alias)
