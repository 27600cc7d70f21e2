"""The README's install runs every shipped job (issue 36 item 6): what a job needs at plan and launch
time is installed by the README's command, with no extra to remember.

Checked on the dependency metadata rather than by a fresh virtualenv per CI run: .ci/run already
builds a new virtualenv from pyproject.toml every run and plans every job there
(tests/memory/test_planner.py::test_every_job_is_planned_from_its_own_model), and tests/test_dependencies
finds an import no distribution declares; a second fresh install here would add torch's wheel and
minutes of a 2-core CI to say the same. What this test adds: the README's command names no extra,
and every optional package a shipped job uses (bitsandbytes: QLoRA, adamw_8bit) is a core dependency."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
# a spec feature -> the distribution it imports (validate refuses the job without it: techniques/lora,
# optimizers/adamw_8bit)
FEATURE_PACKAGES = {("model", "quantization"): "bitsandbytes", ("training", "optimizer", "name", "adamw_8bit"):
                    "bitsandbytes"}


def _install_command() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Set up and run", 1)[1].split("\n## ", 1)[0]
    return next(block for block in re.findall(r"```\n(.*?)```", section, flags=re.S) if "pip install" in block)


def _core() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower() for requirement in project["dependencies"]}


def _uses(spec: dict, path: tuple) -> bool:
    node = spec
    for key in path[:-1] if len(path) == 4 else path:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return node == path[-1] if len(path) == 4 else node is not None


def test_the_readme_installs_the_project_without_extras():
    command = _install_command()
    assert re.search(r"pip install .*-e \.(\s|$|&)", command), command   # the project itself, no [extra]


def test_every_package_a_shipped_job_needs_is_a_core_dependency():
    needed = {}
    for job in sorted((ROOT / "jobs").glob("*.yaml")):
        spec = yaml.safe_load(job.read_text())
        for path, package in FEATURE_PACKAGES.items():
            if _uses(spec, path):
                needed.setdefault(package, []).append(job.name)
    assert needed.get("bitsandbytes"), "the QLoRA and 8-bit AdamW jobs are shipped"
    missing = {package: jobs for package, jobs in needed.items() if package not in _core()}
    assert not missing, f"jobs that the README's install cannot run (add to [project].dependencies): {missing}"
