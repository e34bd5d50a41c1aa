"""The tools as commands: a console command per tool, thin ``tools/*.py`` scripts, and their messages.

Every ``tools/*.py`` script runs the same object as its ``[project.scripts]`` command
(``dflash_cb.common.cli.command``); from a checkout that is not installed it says so in one line.
While a tool runs, the package's library messages (``logging``) are shown on stderr, one line each.
"""

from __future__ import annotations

import ast
import importlib
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_cb.common.cli import run

ROOT = Path(__file__).resolve().parents[2]
TOOLS = sorted(p for p in (ROOT / "tools").glob("*.py") if not p.name.startswith("_"))


def console_scripts() -> dict[str, str]:
    """``[project.scripts]`` of pyproject.toml: command name -> ``module:object``."""
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert section, "pyproject.toml has no [project.scripts]"
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.:]+)"', section[1], re.M))


def tool_target(path: Path) -> str:
    """``module:object`` that ``tools/<name>.py`` runs (its ``run_command(module[, object])`` call)."""
    calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "run_command"]
    assert len(calls) == 1, f"{path.name}: expected one run_command(...) call"
    args = [a.value for a in calls[0].args]
    return f"{args[0]}:{args[1] if len(args) > 1 else 'command'}"


def launched(target: str) -> str:
    """``module:object`` a console script's launcher runs (``cli.launcher``)."""
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr).target


def test_every_tool_is_a_console_command_running_the_same_object():
    scripts = console_scripts()
    assert sorted(map(launched, scripts.values())) == sorted(tool_target(t) for t in TOOLS)
    assert all(name.startswith("dflash-") for name in scripts)
    for t in TOOLS:
        assert "sys.path" not in t.read_text(), f"{t.name} changes sys.path"


@pytest.mark.parametrize("name", sorted(console_scripts()))
def test_each_command_runs_its_tool(name, monkeypatch, capsys):
    module, attr = console_scripts()[name].split(":")
    command = getattr(importlib.import_module(module), attr)
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as e:
        command()
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: ")


@pytest.mark.e2e
@pytest.mark.parametrize("tool", TOOLS, ids=lambda p: p.name)
def test_a_tool_of_a_checkout_that_is_not_installed_says_so_in_one_line(tool, tmp_path):
    """``-S -E``: no site-packages and no PYTHONPATH, as in an environment where the package was never installed."""
    proc = subprocess.run([sys.executable, "-S", "-E", str(tool), "--help"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the dflash_cb package is not installed"), proc.stderr
    assert "`pip install -e .`" in lines[0] and str(ROOT) in lines[0]


def test_library_messages_are_shown_while_a_tool_runs(capsys):
    """One line per message on stderr, once however the tools nest (the demo runs the precompute's), and the
    package's logging is as it was afterwards: used as a library, INFO messages stay quiet."""
    logger = logging.getLogger("dflash_cb.cache.precompute.run")

    def inner(argv):
        logger.info("inner message")
        logger.debug("not shown")

    def outer(argv):
        logger.info("outer message")
        return run(inner)

    package = logging.getLogger("dflash_cb")
    before = (list(package.handlers), package.level)
    assert run(outer) == 0
    assert capsys.readouterr().err == "outer message\ninner message\n"
    assert (list(package.handlers), package.level) == before
    logger.info("a library message")
    assert capsys.readouterr().err == ""


def test_a_python_warning_in_a_tool_is_one_line_without_a_source_line(capsys):
    """A warning the package raises while a tool runs (a cost profile timed for another drafter) is its message
    on one line: Python's own format would print the package's internal source line beneath it."""
    import warnings

    def tool(argv):
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("--profile p.json: timed for another drafter (hidden_size 64 vs 32)", stacklevel=1)
        assert warnings.showwarning is not shown  # the edge's own format, while the tool runs

    shown = warnings.showwarning
    assert run(tool) == 0
    assert capsys.readouterr().err == "UserWarning: --profile p.json: timed for another drafter (hidden_size 64 vs 32)\n"
    assert warnings.showwarning is shown  # the program's own format is back


# -- Ctrl-C while a tool starts -------------------------------------------------------------------------------------

def _interrupted_while_starting(argv: list[str]) -> tuple[int, str, str]:
    """Run ``python -X importtime *argv --help`` and send SIGINT as soon as torch's C extension has been
    imported (``-X importtime`` prints a line as each import completes: the signal lands in the middle of
    torch's start-up, seconds before any tool could print its usage). Returns (exit code, stdout, stderr
    without the import-time lines)."""
    import os
    import signal

    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-X", "importtime", *argv, "--help"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("import time:") and line.split("|")[-1].strip() == "torch._C":
                proc.send_signal(signal.SIGINT)
                break
        lines += proc.stderr.readlines()
        out = proc.stdout.read()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
    return proc.returncode, out, "".join(x for x in lines if not x.startswith("import time:"))


@pytest.mark.e2e
@pytest.mark.parametrize("tool", TOOLS, ids=lambda p: p.name)
def test_ctrl_c_while_a_tool_starts_is_one_line(tool):
    """Python's own handler printed a KeyboardInterrupt traceback from the middle of ``import torch`` (or torch's
    C++ start-up aborted: ``what(): KeyboardInterrupt``, exit 134); the tool says ``interrupted`` and exits 130,
    as it does when interrupted later."""
    code, out, err = _interrupted_while_starting([str(tool)])
    assert (code, err) == (130, "interrupted\n"), (code, err[-3000:])
    assert "usage:" not in out  # it was stopped while starting, before it could answer --help


@pytest.mark.e2e
@pytest.mark.parametrize("name", sorted(console_scripts()))
def test_ctrl_c_while_a_console_command_starts_is_one_line(name):
    """The same for each ``[project.scripts]`` command, run as pip's generated script runs it."""
    module, attr = console_scripts()[name].split(":")
    script = f"import sys; from {module} import {attr}; sys.argv[0] = {name!r}; sys.exit({attr}())"
    code, out, err = _interrupted_while_starting(["-c", script])
    assert (code, err) == (130, "interrupted\n"), (code, err[-3000:])
    assert "usage:" not in out


@pytest.mark.e2e  # a subprocess (the fast subset leaves those out)
def test_console_commands_import_nothing_heavy_before_their_guard():
    """What pip's script imports before calling the command is light: torch comes in under the Ctrl-C guard."""
    script = ("import importlib, sys; [importlib.import_module(t.split(':')[0]) for t in sys.argv[1:]]; "
              "print(sorted(m for m in ('torch', 'numpy', 'transformers', 'lightning') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", script, *console_scripts().values()], cwd=ROOT, text=True,
                          capture_output=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", (proc.stdout, proc.stderr)


def test_every_console_command_is_in_the_getting_started_table():
    """docs/getting-started.md lists each ``[project.scripts]`` command beside the tools/ script running the same
    object."""
    page = (ROOT / "docs" / "getting-started.md").read_text()
    by_target = {tool_target(t): t.name for t in TOOLS}
    for name, target in console_scripts().items():
        assert f"| `{name}` | `python tools/{by_target[launched(target)]}` |" in page, name
