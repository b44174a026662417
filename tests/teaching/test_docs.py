"""The docs: the site builds without a warning, links resolve, code blocks run, the checklist is current.

* the Sphinx site (``docs/conf.py``) builds with warnings as errors, so a broken
  internal link or cross-reference, a docstring whose reST does not parse, or
  a page missing from every toctree fails;
* every relative link (and image) of ``README.md`` and ``docs/**/*.md`` names a
  file that exists, and a ``#anchor`` into a Markdown page names one of its
  headings;
* every ```` ```python ```` block of those pages runs: each page's blocks in
  order, in one fresh interpreter, from the repository root. A block marked
  ```` ```python no-run ```` or preceded by ``<!-- no-run: reason -->`` is
  skipped; the reason must be given;
* the checklist "To add a collective, touch these files" of
  ``docs/contributing.md`` names files that exist and mention the ops it says
  they mention, and every file of ``simcomm/`` and ``real/`` that mentions
  ``all_to_all_single`` is on it.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("**/*.md"))]
PAGES = [page for page in PAGES if "_build" not in page.parts]
CHECKLIST_HEADING = "## To add a collective, touch these files"
#: the ops the checklist's last column may name: methods of simcomm.Communicator wired through every layer
REFERENCE_OPS = ("all_to_all_single", "reduce", "scatter", "all_gather")
SENTINEL_OP = "all_to_all_single"

_FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")
_NO_RUN_COMMENT = re.compile(r"^<!--\s*no-run:(.*?)-->\s*$")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- Markdown parsing --------------------------------------------------------------------------

def _closes(line: str, fence: str) -> bool:
    stripped = line.strip()
    return len(stripped) >= len(fence) and set(stripped) == {fence[0]}


def _blocks(text: str) -> list[dict]:
    """Fenced code blocks: info string, first line number of the code (1-based), code, the
    no-run reason (None: runnable)."""
    lines = text.split("\n")
    blocks, index = [], 0
    while index < len(lines):
        match = _FENCE.match(lines[index])
        if not match:
            index += 1
            continue
        fence, info = match.group(1), match.group(2).strip()
        start = index + 1
        end = start
        while end < len(lines) and not _closes(lines[end], fence):
            end += 1
        previous = index - 1
        while previous >= 0 and not lines[previous].strip():
            previous -= 1
        reason = None
        comment = _NO_RUN_COMMENT.match(lines[previous].strip()) if previous >= 0 else None
        words = info.split()
        if comment:
            reason = comment.group(1).strip()
        elif "no-run" in words[1:]:
            reason = " ".join(word for word in words[1:] if word != "no-run") or "no-run"
        blocks.append({"info": info, "lang": words[0] if words else "", "line": start + 1,
                       "code": "\n".join(lines[start:end]), "reason": reason, "marked": bool(comment)
                       or "no-run" in words[1:]})
        index = end + 1
    return blocks


def _prose(text: str) -> str:
    """The page without its fenced blocks and inline code (links there are examples, not links)."""
    out, inside, fence = [], False, ""
    for line in text.split("\n"):
        match = _FENCE.match(line)
        if match and not inside:
            inside, fence = True, match.group(1)
            out.append("")
            continue
        if inside:
            if _closes(line, fence):
                inside = False
            out.append("")
            continue
        out.append(re.sub(r"`[^`]*`", "``", line))
    return "\n".join(out)


_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _links(page: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(_prose(page.read_text()).split("\n"), 1):
        for match in _LINK.finditer(line):
            found.append((number, match.group(1)))
    return found


def _slug(heading: str) -> str:
    """GitHub's (and MyST's) anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in _prose(page.read_text()).split("\n")
            if re.match(r"^#{1,6} ", line)}


# -- the slow jobs: the site build and one interpreter per page, started together ------------

def _runnable(page: Path) -> list[tuple[int, str]]:
    return [(block["line"], block["code"]) for block in _blocks(page.read_text())
            if block["lang"] in ("python", "py", "python3") and block["reason"] is None]


RUNNABLE_PAGES = [page for page in PAGES if _runnable(page)]

_RUNNER = r"""
import sys
page, blocks = sys.argv[1], eval(sys.stdin.read())
namespace = {"__name__": "__main__"}
for line, code in blocks:
    # pad so a traceback names the page and the line of the Markdown file
    exec(compile("\n" * (line - 1) + code, page, "exec"), namespace)
"""
_TIMEOUT_S = 300


def _run(command: list[str], stdin: str | None = None) -> tuple[int, str]:
    """Run ``command`` from the repository root: ``(returncode, stderr)``."""
    env = dict(os.environ, SIMCOMM_BACKEND="sim", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, input=stdin, capture_output=True, text=True,
                              timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        return -1, f"timed out after {_TIMEOUT_S} s\n{error.stderr or ''}"
    return done.returncode, done.stderr


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """The site build and every page's blocks (only those whose tests were selected), two at a
    time, so both CPUs work while the tests wait for their own job."""
    selected = {item.name for item in request.session.items if getattr(item, "module", None) is request.module}
    out = tmp_path_factory.mktemp("docs")
    before = sorted(path for path in DOCS.rglob("*") if "_build" not in path.parts)
    pool = ThreadPoolExecutor(max_workers=2)
    started: dict[str, Future] = {}
    if "test_site_builds_without_warnings" in selected:   # the longest first
        started["site"] = pool.submit(_run, [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going",
                                             "-q", "-d", str(out / "doctrees"), str(DOCS), str(out / "html")])
    for page in sorted(RUNNABLE_PAGES, key=lambda page: -len(_runnable(page))):
        if f"test_code_blocks_run[{_rel(page)}]" in selected:
            started[_rel(page)] = pool.submit(_run, [sys.executable, "-c", _RUNNER, _rel(page)],
                                              repr(_runnable(page)))
    yield started, out, before
    for future in started.values():
        future.cancel()
    pool.shutdown(wait=True)


# -- (a) the site builds ------------------------------------------------------------------------

@pytest.mark.slow
def test_site_builds_without_warnings(jobs):
    """``python -m sphinx -b html -W --keep-going docs OUT``, as docs/contributing.md says."""
    started, out, before = jobs
    returncode, stderr = started["site"].result()
    assert returncode == 0, f"the docs build failed or warned:\n{stderr[-6000:]}"
    for page in ("index", "communicator", "contributing", "api/simcomm"):
        assert (out / "html" / f"{page}.html").is_file(), page
    after = sorted(path for path in DOCS.rglob("*") if "_build" not in path.parts)
    assert after == before, f"the build wrote into docs/: {sorted(set(after) - set(before))}"


# -- (b) relative links -------------------------------------------------------------------------

def test_every_relative_link_names_an_existing_file():
    broken = []
    for page in PAGES:
        for number, target in _links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                if target.startswith("#") and _slug(target[1:]) not in _anchors(page) \
                        and target[1:] not in _anchors(page):
                    broken.append(f"{_rel(page)}:{number}: {target} (no such heading on the page)")
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve()
            if not resolved.exists():
                broken.append(f"{_rel(page)}:{number}: {target} (no file {resolved})")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{_rel(page)}:{number}: {target} (no heading #{anchor} in {path}; "
                              f"headings: {sorted(_anchors(resolved))})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_no_run_blocks_give_a_reason():
    unexplained = [f"{_rel(page)}:{block['line']}" for page in PAGES for block in _blocks(page.read_text())
                   if block["marked"] and block["reason"] in ("", "no-run")]
    assert not unexplained, ("a block marked no-run must say why (<!-- no-run: needs GPUs -->): "
                             + ", ".join(unexplained))


# -- (c) code blocks run ------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=[_rel(page) for page in RUNNABLE_PAGES])
def test_code_blocks_run(page, jobs):
    started, _, _ = jobs
    returncode, stderr = started[_rel(page)].result()
    assert returncode == 0, (f"a python block of {_rel(page)} failed (mark a block that must not run "
                             f"with <!-- no-run: reason -->):\n{stderr[-6000:]}")


# -- the checklist for adding a collective ----------------------------------------------------

def _checklist() -> tuple[dict[str, set[str]], set[str]]:
    """``{file: ops its row says it mentions}`` for the files to touch, and the files that only use ops."""
    text = (DOCS / "contributing.md").read_text()
    assert CHECKLIST_HEADING in text, f"docs/contributing.md lost its heading {CHECKLIST_HEADING!r}"
    section = text.split(CHECKLIST_HEADING, 1)[1]
    section = re.split(r"\n## ", section, maxsplit=1)[0]
    touch: dict[str, set[str]] = {}
    users: set[str] = set()
    for line in section.split("\n"):
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        files = re.findall(r"`([^`]+)`", cells[0])
        if len(cells) == 3:
            ops = set(re.findall(r"`([^`]+)`", cells[2]))
            for name in files:
                touch[name] = ops
        else:
            users.update(files)
    assert touch, "the checklist table of docs/contributing.md has no rows"
    return touch, users


def test_checklist_ops_are_communicator_methods():
    import simcomm

    for op in REFERENCE_OPS:
        assert callable(getattr(simcomm.Communicator, op, None)), \
            f"the checklist's reference op {op!r} is not a method of simcomm.Communicator"
    touch, _ = _checklist()
    named = set().union(*touch.values())
    assert named <= set(REFERENCE_OPS), (
        f"docs/contributing.md's checklist names ops {sorted(named - set(REFERENCE_OPS))} that "
        f"tests/teaching/test_docs.py does not check; use {list(REFERENCE_OPS)}")


def test_checklist_files_exist_and_mention_their_ops():
    touch, users = _checklist()
    problems = []
    for name, ops in sorted(touch.items()):
        path = ROOT / name
        if not path.is_file():
            problems.append(f"{name}: no such file")
            continue
        text = path.read_text()
        for op in sorted(ops):
            if not re.search(rf"\b{op}\b", text):
                problems.append(f"{name}: does not mention {op} (update its row of the checklist)")
    for name in sorted(users):
        if not (ROOT / name).is_file():
            problems.append(f"{name}: no such file")
    assert not problems, "docs/contributing.md's checklist is stale:\n" + "\n".join(problems)


def test_every_file_wiring_a_collective_is_on_the_checklist():
    touch, users = _checklist()
    listed = set(touch) | users
    mentioning = sorted(_rel(path) for folder in ("simcomm", "real") for path in (ROOT / folder).rglob("*.py")
                        if re.search(rf"\b{SENTINEL_OP}\b", path.read_text()))
    missing = [name for name in mentioning if name not in listed]
    assert not missing, (f"these files mention {SENTINEL_OP} but are not on the checklist "
                         f"'To add a collective, touch these files' of docs/contributing.md; add each "
                         f"to the checklist (what a new collective needs there), or to its table of "
                         f"files that only use collectives: {missing}")
    stale = [name for name, ops in touch.items() if SENTINEL_OP in ops and name.split("/")[0] in ("simcomm", "real")
             and name not in mentioning]
    assert not stale, f"the checklist says these mention {SENTINEL_OP}, but they do not: {stale}"


# -- the layout table and the API pages cover every module -----------------------------------

def _modules() -> list[Path]:
    return sorted(path for folder in ("simcomm", "real") for path in (ROOT / folder).rglob("*.py")
                  if "__pycache__" not in path.parts)


def test_architecture_page_lists_every_module():
    text = (DOCS / "architecture.md").read_text()
    listed = set(re.findall(r"`([\w/.]+)`", text))
    missing = []
    for path in _modules():
        name = _rel(path)
        folder = _rel(path.parent) + "/"
        if name not in listed and not (path.name == "__init__.py" and folder in listed):
            missing.append(name)
    assert not missing, f"docs/architecture.md's layout table lacks these files (one line each): {missing}"


def test_api_pages_document_every_module():
    documented = set()
    for page in (DOCS / "api").glob("*.md"):
        documented.update(re.findall(r"^\.\. automodule:: ([\w.]+)", page.read_text(), flags=re.M))
    missing = []
    for path in _modules():
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name not in documented:
            missing.append(name)
    assert not missing, f"no page of docs/api/ has '.. automodule::' for: {missing}"


# -- paths and dotted names in the pages name what is in the tree ------------------------------

_PATH_SPAN = re.compile(r"`((?:simcomm|real|tests|benchmarks|docs|notebooks)/[\w./-]*)`")
_NAME_SPAN = re.compile(r"`((?:simcomm|real)(?:\.\w+)+)`")


def _code_spans(page: Path, pattern: re.Pattern) -> list[tuple[int, str]]:
    return [(number, match.group(1)) for number, line in enumerate(page.read_text().split("\n"), 1)
            for match in pattern.finditer(line)]


def test_paths_in_the_pages_exist():
    missing = [f"{_rel(page)}:{number}: {path}" for page in PAGES for number, path in _code_spans(page, _PATH_SPAN)
               if not (ROOT / path).exists()]
    assert not missing, "these paths are not in the tree (moved? update the page):\n" + "\n".join(missing)


def test_dotted_names_in_the_pages_resolve():
    import importlib

    def resolves(name: str) -> bool:
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attribute in parts[cut:]:
                    obj = getattr(obj, attribute)
            except AttributeError:
                return False
            return True
        return False

    unresolved = [f"{_rel(page)}:{number}: {name}" for page in PAGES
                  for number, name in _code_spans(page, _NAME_SPAN) if not resolves(name)]
    assert not unresolved, "these names do not resolve (moved? update the page):\n" + "\n".join(unresolved)
