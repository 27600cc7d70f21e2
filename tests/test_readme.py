"""The README's two set-up commands stay real: CI runs exactly the README's test command."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Set up and run", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```\n(.*?)```", section, flags=re.S)]


def test_readme_has_exactly_two_setup_commands():
    commands = _setup_commands()
    assert len(commands) == 2, commands
    assert "jobspec launch jobs/quickstart.yaml" in commands[0]
    assert "pytest" in _expanded(commands[1])


def test_ci_runs_the_readme_test_command():
    test_command = _setup_commands()[1]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert test_command in ci.splitlines(), f".ci/run must run the README's test command: {test_command}"


def _expanded(command: str) -> str:
    """The command, with a script of this repository it runs read in."""
    script = ROOT / command.split()[0]
    return command + "\n" + script.read_text(encoding="utf-8") if script.is_file() else command


def test_setup_never_pulls_unpinned_torch():
    # An unpinned torch would pull several GB of CUDA wheels on a CPU machine.
    for command in _setup_commands():
        assert "torch==2.13.0" in _expanded(command)


def test_the_test_command_installs_what_the_tests_need_then_runs_pytest():
    script = _expanded(_setup_commands()[1])
    for package in ("libaio-dev", "slurm-wlm", "munge"):
        assert package in script, package
    assert '-e ".[dev]"' in script and "python -m pytest -q" in script


def test_ci_installs_into_a_brand_new_virtualenv():
    # A package installed by hand once hid an undeclared dependency: CI must start from nothing.
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    test_line = lines.index(_setup_commands()[1])
    made = [i for i, line in enumerate(lines) if "-m venv" in line]
    removed = [i for i, line in enumerate(lines) if line.startswith("rm -rf") and "venv" in line]
    activated = [i for i, line in enumerate(lines) if "bin/activate" in line]
    assert made and removed and activated, "CI must create (and first remove) a virtualenv and activate it"
    assert removed[0] < made[0] < activated[0] < test_line
