"""A non-editable install (what `pip install .` gives a user) carries what the package needs at run
time: the schema, and the launch.sh that `jobspec sbatch` scripts run."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT

pytest.importorskip("hatchling", reason="the build backend (dev extra) builds the wheel without network")


def test_a_non_editable_install_renders_sbatch_scripts_whose_launch_sh_exists(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True, env=env).stdout.strip())
    # The test environment's packages (hatchling, jsonschema, pyyaml) come after the venv's own, so
    # nothing is downloaded; its .pth files are not read, so its editable jobspec stays out of sight.
    (site / "test_environment.pth").write_text(
        "".join(f"{p}\n" for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()))
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                              "--no-build-isolation", "--no-index", "--no-cache-dir", "-q", str(REPO_ROOT)],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr

    where = subprocess.run([str(python), "-c", "import jobspec; print(jobspec.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, check=True).stdout.strip()
    assert venv in Path(where).parents  # the installed copy runs, not the checkout

    render = subprocess.run([str(venv / "bin" / "jobspec"), "sbatch", str(REPO_ROOT / "jobs" / "quickstart.yaml")],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert render.returncode == 0, render.stderr
    exec_line = next(line for line in render.stdout.splitlines() if line.startswith("exec "))
    launch_sh = Path(shlex.split(exec_line)[1])
    assert venv in launch_sh.parents and launch_sh.is_file() and os.access(launch_sh, os.X_OK)
    assert launch_sh.read_bytes() == (REPO_ROOT / "launch.sh").read_bytes()
    usage = subprocess.run([str(launch_sh)], capture_output=True, text=True, env=env, timeout=30)
    assert usage.returncode == 2 and "sbatch launch.sh" in usage.stdout  # it runs: its own usage text
