"""The install files agree: environment.yml installs requirements.txt and pins nothing itself."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _requirements() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line or line.startswith("-"):
            continue
        name = re.split(r"[=<>~!\[; ]", line, maxsplit=1)[0]
        pins[name.strip().lower()] = line
    return pins


def test_environment_installs_requirements():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["channels"] == ["conda-forge", "nodefaults"]
    deps = env["dependencies"]
    assert "python=3.11" in deps
    pip_sections = [d["pip"] for d in deps if isinstance(d, dict) and "pip" in d]
    assert pip_sections == [["-r requirements.txt"]]
    conda_names = {re.split(r"[=<>]", d)[0] for d in deps if isinstance(d, str)}
    # conda brings only the interpreter and pip: every library version comes from requirements.txt
    assert conda_names == {"python", "pip"}
    assert not conda_names & set(_requirements())


def test_requirements_pin_torch_and_list_what_the_project_needs():
    reqs = _requirements()
    assert reqs["torch"] == "torch==2.13.0"
    for name in ("numpy", "jupyterlab", "ipywidgets", "plotly", "nbval", "pytest", "cloudpickle",
                 "hypothesis"):
        assert name in reqs, name
    assert "-e ." in (ROOT / "requirements.txt").read_text().splitlines()


def test_readme_commands_are_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert len(blocks) >= 2
    setup_and_test = blocks[1].strip()
    assert "pip install -r requirements.txt" in blocks[0] and "jupyter lab" in blocks[0]
    assert setup_and_test in (ROOT / ".ci" / "run").read_text()
