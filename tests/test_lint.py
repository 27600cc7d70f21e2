"""ruff and mypy pass on jobspec/ (pyproject.toml's [tool.ruff] and [tool.mypy]): `python -m pytest`
alone holds the line that scripts/test.sh draws. Skipped only where the tool is not installed
(`pip install -e ".[dev]"` installs both)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("tool, args", [
    ("ruff", ["check", "jobspec"]),
    ("mypy", ["jobspec"]),
])
def test_tool_passes(tool, args):
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (pip install -e '.[dev]')")
    result = subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"{tool} {' '.join(args)}:\n{result.stdout}{result.stderr}"
