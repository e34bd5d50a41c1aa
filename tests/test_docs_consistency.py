"""The README, the shipped config and the tools' --help say the same thing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CONFIG = (ROOT / "configs" / "precompute" / "qwen36-27b.yaml").read_text()


def tool_help(main, capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_texts_print_percent_signs_once(capsys):
    from dflash_cb.cache.precompute import cli as precompute_cli
    from dflash_cb.core import compare, extract_cli
    from dflash_cb.demo import demo
    from dflash_cb.integrations import eval_cli, panels, specforge_cli

    assert "tau with 95% intervals" in tool_help(compare.main, capsys)
    for main in (demo.main, eval_cli.main, extract_cli.main, panels.main, precompute_cli._precompute,
                 precompute_cli._merge, specforge_cli.main):
        assert "%%" not in tool_help(main, capsys), main


def test_the_demo_figures_are_quoted_the_same_everywhere():
    # tau 3.094 at step 1200 has one interval, the one the demo prints for seed 0
    assert set(re.findall(r"3\.094 \[(\d\.\d\d), (\d\.\d\d)\]", README)) == {("2.77", "3.44")}
    assert "2.95" not in README and "3.24" not in README
    # the DDTree figure 4.375 is the budget-32 column of the demo's table
    header = re.search(r"step +tau \[95% interval\] +(dd@\d+) +(dd@\d+)", README)
    last = re.search(r"1200 +3\.094 \[2\.77, 3\.44\] +([\d.]+) +([\d.]+)", README)
    assert header and last
    budget_of = {v: h.split("@")[1] for h, v in zip(header.groups(), last.groups(), strict=True)}
    assert budget_of["4.375"] == "32"
    assert set(re.findall(r"DDTree b(\d+) 4\.375", README)) == {"32"}
    assert set(re.findall(r"4\.375 at budget (\d+)", README)) == {"32"}


def test_float32_weights_and_the_dtype_probe_are_stated_once():
    float32_gb = {int(x) for x in re.findall(r"(\d+) GB (?:of )?float32", README + CONFIG)}
    float32_gb |= {int(x) for x in re.findall(r"(\d+) GB fit in memory", CONFIG)}
    assert float32_gb == {round(27e9 * 4 / 1e9)}  # README: N = 27e9 parameters, 4 bytes each
    assert "about a second)" not in CONFIG and "0.2 s" in CONFIG and "0.2 s here" in README


def test_no_unclear_or_wrong_claims():
    assert "bootstrap is present" not in README
    # a cache holds no block size: the README must not list it among the fields compared with the cache
    for listing in re.findall(r"compares the cache with the drafter's config \(([^)]*)\)", README, re.S):
        assert "block size" not in listing.split(";")[0], listing
