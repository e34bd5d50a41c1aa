"""The README and the pages under docs/: one screen of README, every page rendered and linked, every figure
from the script that measures it, the same figure quoted the same way everywhere, no internal history,
and the tools' --help consistent with them."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}
CONFIG = (ROOT / "configs" / "precompute" / "qwen36-27b.yaml").read_text()
EVERYTHING = README + "".join(PAGES.values())


def tool_help(main, capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_texts_print_percent_signs_once(capsys):
    from dflash_cb.cache.precompute import cli as precompute_cli
    from dflash_cb.demo import demo
    from dflash_cb.integrations.cli import compare as compare
    from dflash_cb.integrations.cli import eval_drafter as eval_cli
    from dflash_cb.integrations.cli import extract as extract_cli
    from dflash_cb.integrations.cli import specforge_train as specforge_cli
    from dflash_cb.integrations.cli import sweep_cli
    from dflash_cb.integrations.tracking import panels

    assert "tau with 95% intervals" in tool_help(compare.main, capsys)
    for main in (demo.main, eval_cli.main, extract_cli.main, panels.main, sweep_cli.main, precompute_cli._precompute,
                 precompute_cli._merge, specforge_cli.main):
        assert "%%" not in tool_help(main, capsys), main


def test_readme_is_one_screen_with_the_two_commands_first():
    lines = README.splitlines()
    assert len(lines) <= 200 and max(len(x) for x in lines) <= 400
    first = re.search(r"```bash\n(.*?)```", README, re.S)
    assert first and first.group(1).split("\n")[:2] == ["python dev.py demo", "python dev.py test"]
    assert README[:first.end()].count("\n") < 30


def test_every_page_is_in_the_nav_and_every_relative_link_resolves():
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    listed = {next(iter(item.values())) for item in nav}
    assert listed == set(PAGES), (sorted(set(PAGES) - listed), sorted(listed - set(PAGES)))
    for name, text in [("README.md", README), *PAGES.items()]:
        base = ROOT if name == "README.md" else ROOT / "docs"
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            assert (base / target).exists(), f"{name}: link to {target} does not resolve"


def test_tables_are_the_measuring_scripts_and_none_is_empty():
    """A marked table is written by the script it names (``benchmarks/_docs.py``), with its machine."""
    blocks = re.findall(r"<!-- table:([\w-]+) -->\n(.*?)<!-- /table:\1 -->", "".join(PAGES.values()), re.S)
    assert len(blocks) >= 5
    for name, body in blocks:
        assert body.startswith("Measured with `python benchmarks/"), (name, body[:120])
        assert " on " in body.split("\n")[0] and ("|" in body or "```" in body), name


def test_no_internal_history():
    for pattern in (r"\bissue \d+", r"the issue's", r"today's", r"git (archive|checkout|worktree add)\S* [0-9a-f]{7}"):
        assert not re.search(pattern, EVERYTHING, re.I), pattern


def test_a_demo_figure_is_quoted_with_its_own_interval_everywhere():
    """Every ``tau T [lo, hi]`` quoted in the docs is the demo's own (the generated table holds it)."""
    table = re.search(r"<!-- table:demo -->(.*?)<!-- /table:demo -->", PAGES["getting-started.md"], re.S)
    assert table
    measured = set(re.findall(r"(\d\.\d{3}) \[(\d\.\d\d), (\d\.\d\d)\]", table.group(1)))
    quoted = set(re.findall(r"tau (\d\.\d{3}) \[(\d\.\d\d), (\d\.\d\d)\]", EVERYTHING))
    assert measured and quoted <= measured, sorted(quoted - measured)


def test_float32_weights_and_the_dtype_probe_are_stated_once():
    float32_gb = {int(x) for x in re.findall(r"(\d+) GB (?:of )?float32", EVERYTHING + CONFIG)}
    float32_gb |= {int(x) for x in re.findall(r"(\d+) GB fit in memory", CONFIG)}
    assert float32_gb == {round(27e9 * 4 / 1e9)}  # 27e9 parameters, 4 bytes each
    assert "0.2 s" in CONFIG and "0.2 s" in PAGES["precompute.md"]


@pytest.mark.e2e
def test_the_pages_build_strict(tmp_path):
    """``mkdocs build --strict``: a broken link, a missing anchor or a page left out of the nav fails."""
    mkdocs = shutil.which("mkdocs")
    cmd = [mkdocs] if mkdocs else [sys.executable, "-m", "mkdocs"]
    r = subprocess.run([*cmd, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "site" / "metrics" / "index.html").exists()


def test_the_metrics_page_opens_with_the_number_to_watch_and_why_the_accuracies_differ():
    """A new user reads the first lines: which figure to watch, and why the live specforge/acc is not the tool's."""
    head = "\n".join((ROOT / "docs" / "metrics.md").read_text().splitlines()[:16])
    assert "**Watch `dflash_eval/tau`**" in head
    assert "`specforge/acc`" in head and "full/specforge/acc" in head and "--anchor-stride" in head


_DURATION = re.compile(r"\b\d+(?:\.\d+)?\s?(?:s|ms|seconds?|minutes?)\b|\babout a minute\b|\bunder a minute\b|"
                       r"\ba few minutes\b")


def test_every_quoted_timing_says_its_thread_count():
    """A time depends on the threads it ran with: a paragraph that quotes one says how many (a measured table's
    header names them: ``benchmarks/_docs.py``); a limit (a timeout) is no measured time."""
    missing = []
    for page in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        text = re.sub(r"<!-- table:(\S+) -->.*?<!-- /table:\1 -->", "", page.read_text(), flags=re.S)
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # commands and formulas, not measurements
        for paragraph in re.split(r"\n\s*\n", text):
            # A limit ("waits up to 5 s", "within 30 s") is a setting, not a measured time.
            measured = [m for m in _DURATION.finditer(paragraph)
                        if not re.search(r"(up to|within|every|at most)\s+$", paragraph[:m.start()])]
            if measured and "thread" not in paragraph:
                missing.append(f"{page.name}: {' '.join(paragraph.split())[:160]}")
    assert not missing, "\n".join(missing)


def test_the_demo_prints_the_band_the_docs_quote_from_the_machine_that_measured_it():
    """The band of last tau the demo prints for its default run (the seeds' spread where it was measured) is the
    one getting-started quotes, with the same CPU and thread count, and its seed 0 is the demo table's last tau."""
    from dflash_cb.demo.demo import MEASURED_ON, MEASURED_TAU, DemoConfig, expected_band

    page = PAGES["getting-started.md"]
    lo, hi = min(MEASURED_TAU.values()), max(MEASURED_TAU.values())
    line = expected_band(DemoConfig.resolve(seed=0), MEASURED_TAU[0])
    assert f"{lo:.3f} to {hi:.3f}" in line and MEASURED_ON in line and "inside" in line
    assert f"{lo:.3f} to {hi:.3f}" in page and MEASURED_ON.removeprefix("a ") in page
    for seed, tau in MEASURED_TAU.items():
        assert f"seed {seed} {tau:.3f}" in page, seed
    table = re.search(r"<!-- table:demo -->(.*?)<!-- /table:demo -->", page, re.S).group(1)
    assert f"Last evaluation (step 1200): tau {MEASURED_TAU[0]:.3f} [" in table and "seed 0, 1 thread(s)" in table
    # Another drafter, --quick or other steps train something else: no band is printed for them.
    assert expected_band(DemoConfig.resolve(quick=True)) is None
    assert expected_band(DemoConfig.resolve(drafter="mtp")) is None and expected_band(DemoConfig.resolve(steps=10)) is None
