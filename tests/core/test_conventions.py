"""Figures named after the peer number they equal, and each convention once.

- ``specforge/acc`` is a pooled ratio of integer counts: batch and rank splits give the same number.
- ``tau_request_mean`` / ``accept_length_served`` follow ``dflash.benchmark`` / SGLang's per-request
  ``completion_tokens / spec_verify_ct``; samples without a cycle stay out of both. (That they are equal
  under DDP and in one process, to the bit, is checked by ``tests/integrations/test_callback_distributed.py``.)
- A published figure declares its convention and is stored under the live metric of that convention.
"""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from dflash_cb.core.figures.metrics import (
    ACCEPT_LENGTH_SERVED,
    SPECFORGE_ACC,
    TAU,
    TAU_REQUEST_MEAN,
    EvalCounts,
    ci_high,
    ci_low,
    summarize,
)
from dflash_cb.core.results.baselines import load_published
from dflash_cb.core.results.results_file import report_to_results


@pytest.fixture(scope="module")
def scored(tiny_cache, tiny_drafter_config):
    from tiny_target import train_briefly

    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter
    from dflash_cb.core.replay import evaluate

    cache = StateCache(tiny_cache)
    torch.manual_seed(3)
    drafter = train_briefly(DFlashDrafter.from_config_dict(tiny_drafter_config), cache)  # cycles of varied length
    return cache, drafter, evaluate(cache, drafter, budgets=[4])


def test_request_means_follow_the_peers_definitions(scored):
    cache, _, report = scored
    res = report_to_results(report, cache)
    s = res.metrics
    lengths = {r.id: r.acceptance_lengths for r in report.samples}
    # dflash.benchmark: the mean over requests of each request's mean acceptance length.
    per_request = [sum(x) / len(x) for x in lengths.values() if x]
    assert s[TAU_REQUEST_MEAN] == pytest.approx(sum(per_request) / len(per_request), rel=1e-12)
    # SGLang: completion_tokens / spec_verify_ct per request, where the completion is the cached one
    # (the prefill's token included: the replay's tokens plus one).
    served = []
    for e in cache.samples:
        x = lengths[e.id]
        assert e.valid_len == e.total_len and 1 + sum(x) == e.completion_len
        served.append(e.completion_len / len(x))
    assert s[ACCEPT_LENGTH_SERVED] == pytest.approx(sum(served) / len(served), rel=1e-12)
    assert s[ACCEPT_LENGTH_SERVED] > s[TAU_REQUEST_MEAN]
    pooled = sum(map(sum, lengths.values())) / sum(map(len, lengths.values()))
    assert s[TAU] == pytest.approx(pooled) and s[TAU_REQUEST_MEAN] != pytest.approx(pooled, abs=1e-9)
    for m in (TAU_REQUEST_MEAN, ACCEPT_LENGTH_SERVED):
        assert res.metric(ci_low(m)) <= res.metric(m) <= res.metric(ci_high(m))
        assert res.metric(ci_low(m)) < res.metric(ci_high(m))


def test_specforge_acc_is_a_ratio_of_integer_counts_that_sums_over_ranks():
    """What an all_reduce of two ranks' flat counts gives equals one rank's, to the bit."""
    g = torch.Generator().manual_seed(0)
    d = 5
    one, parts = EvalCounts(d + 1, (), ("a",)), [EvalCounts(d + 1, (), ("a",)) for _ in range(2)]
    for i in range(7):
        n_anchors = int(torch.randint(1, 9, (1,), generator=g))
        valid = torch.rand(n_anchors, d, generator=g) < 0.9
        match = torch.rand(n_anchors, d, generator=g) < 0.5
        accepted = (match & valid).long().cumprod(1).sum(1)
        for c in (one, parts[i % 2]):
            c.add_anchors(accepted, accepted + 1, valid, match)
    reduced = EvalCounts(d + 1, (), ("a",))
    reduced.load_flat(parts[0].flat() + parts[1].flat())
    a, b = summarize(one), summarize(reduced)
    total = one.data["depth_total"].sum().item()
    assert a[SPECFORGE_ACC] == b[SPECFORGE_ACC] == one.data["depth_match"].sum().item() / total
    assert total == int(total) and 0 < a[SPECFORGE_ACC] < 1


def test_samples_without_a_cycle_stay_out_of_the_request_means():
    from dflash_cb.core.figures.bootstrap import request_means
    from dflash_cb.core.results.results_file import SampleRecord

    with_empty = [SampleRecord("a", "c", [2, 1]), SampleRecord("b", "c", []), SampleRecord("c", "c", [4])]
    got = request_means(with_empty)
    assert got[TAU_REQUEST_MEAN] == (1.5 + 4) / 2
    assert got[ACCEPT_LENGTH_SERVED] == (4 / 2 + 5 / 1) / 2  # (1 + tokens) / cycles, SGLang's per request
    assert all(math.isnan(v) for v in request_means([SampleRecord("b", "c", [])]).values())


def _published(tmp_path, entries):
    p = tmp_path / "pub.yaml"
    p.write_text(yaml.safe_dump({"entries": entries}))
    return p


def test_published_figures_live_under_their_conventions_metric(tmp_path):
    pf = load_published(_published(tmp_path, [
        {"name": "a", "source": "TEST", "convention": "pooled", "metrics": {"tau": 5.0, "ddtree/tau_b32": 6.0}},
        {"name": "b", "source": "TEST", "convention": "request_mean", "metrics": {"tau": 5.5}},
        {"name": "c", "source": "TEST", "convention": "served_request_mean", "metrics": {"tau": 6.5}}]))
    got = {b.name: (b.metrics, b.label) for b in pf.baselines}
    assert got["a"][0] == {TAU: 5.0, "ddtree/tau_b32": 6.0} and got["a"][1].endswith("; pooled)")
    assert got["b"][0] == {TAU_REQUEST_MEAN: 5.5} and "request_mean" in got["b"][1]
    assert got["c"][0] == {ACCEPT_LENGTH_SERVED: 6.5}
    with pytest.raises(ValueError, match=r"entry 'x' has convention None.*pooled.*request_mean"):
        load_published(_published(tmp_path, [{"name": "x", "source": "TEST", "metrics": {"tau": 5.0}}]))
    with pytest.raises(ValueError, match=r"'ddtree/tau_b32' under convention 'request_mean'"):
        load_published(_published(tmp_path, [{"name": "y", "source": "TEST", "convention": "request_mean",
                                              "metrics": {"tau": 5.0, "ddtree/tau_b32": 6.0}}]))


def test_published_figures_are_checked_naming_file_entry_and_field(tmp_path):
    """Every entry, placeholders included: a value that is not a number, one no convention allows, an
    unknown field or metric name, a non-boolean placeholder, two names under one metric key."""
    from dflash_cb.core.results.baselines import PublishedError

    base = {"source": "TEST", "convention": "pooled"}
    cases = [
        ({"name": "comma", "metrics": {"tau": "6,5"}}, "entry 'comma': metrics.tau is '6,5', not a number"),
        ({"name": "flag", "metrics": {"tau": True}}, "entry 'flag': metrics.tau is True, not a number"),
        ({"name": "low", "metrics": {"tau": 0.5}}, "entry 'low': metrics.tau is 0.5: an acceptance length is at least 1"),
        ({"name": "neg", "metrics": {"ddtree/tau_b32": -2}}, "entry 'neg': metrics.ddtree/tau_b32 is -2"),
        ({"name": "acc", "metrics": {"specforge/acc": 1.5}}, "metrics.specforge/acc is 1.5: an acceptance is a "
                                                             "fraction in [0, 1]"),
        ({"name": "depth", "metrics": {"tau": 3.0}, "per_depth": [0.9, 1.2]}, "entry 'depth': per_depth[1] is 1.2"),
        ({"name": "depths", "per_depth": "0.9, 0.8"}, "entry 'depths': per_depth is '0.9, 0.8'; expected a list"),
        ({"name": "tua", "metrics": {"tua": 6.0}}, "entry 'tua': metrics.tua: not a figure dflash-cb logs"),
        ({"name": "b032", "metrics": {"ddtree/tau_b032": 6.0}}, "metrics.ddtree/tau_b032: not a figure"),
        ({"name": "direct", "metrics": {"tau_request_mean": 6.0}},
         "metrics.tau_request_mean: give it as tau with convention: request_mean"),
        ({"name": "ph", "placeholder": "false", "metrics": {"tau": 6.0}},
         "entry 'ph': placeholder is 'false'; write true or false (unquoted)"),
        ({"name": "field", "metric": {"tau": 6.0}}, "entry 'field': unknown field(s) ['metric']"),
        ({"name": "nums", "metrics": [6.0]}, "entry 'nums': metrics is [6.0]; expected {metric: value}"),
        ({"name": "ph2", "placeholder": True, "metrics": {"tau": "6,5"}}, "entry 'ph2': metrics.tau is '6,5'"),
    ]
    for entry, needle in cases:
        path = _published(tmp_path, [{**base, **entry}])
        with pytest.raises(PublishedError) as e:
            load_published(path)
        assert str(e.value).startswith(f"{path}: ") and needle in str(e.value), (entry, str(e.value))
    path = _published(tmp_path, [{**base, "name": "paper a", "metrics": {"tau": 3.0}},
                                 {**base, "name": "paper_a", "metrics": {"tau": 4.0}}])
    with pytest.raises(PublishedError, match=r"entry 'paper_a': logged as published/paper_a/\.\.\. like entry "
                                             r"'paper a'; rename one of them"):
        load_published(path)
    path = _published(tmp_path, [{**base, "name": 7, "metrics": {"tau": 3.0}}])
    with pytest.raises(PublishedError, match="entry 0 needs at least 'name' and 'source'"):
        load_published(path)


def test_published_yaml_errors_name_the_file_and_line(tmp_path):
    from dflash_cb.core.results.baselines import PublishedError

    path = tmp_path / "pub.yaml"
    path.write_text("entries:\n  - name: a\n    source: TEST\n    metrics: {tau: 6.5\n")
    with pytest.raises(PublishedError, match=rf"^{path}:5:1: not valid YAML \(expected ',' or '}}'"):
        load_published(path)
    path.write_text("entries:\n\t- name: a\n")
    with pytest.raises(PublishedError, match=rf"^{path}:2:1: not valid YAML"):
        load_published(path)
    path.write_bytes(b"entries: \xff\xfe\n")
    with pytest.raises(PublishedError, match=rf"^{path}: not a text file"):
        load_published(path)


def test_requested_entries_must_have_numbers_and_budgets_a_live_counterpart(tmp_path):
    from dflash_cb.core.results.baselines import PublishedError

    path = _published(tmp_path, [
        {"name": "real", "source": "TEST", "convention": "pooled", "metrics": {"tau": 5.0, "ddtree/tau_b32": 6.0}},
        {"name": "unverified", "source": "TEST", "convention": "pooled", "placeholder": True, "metrics": {"tau": 6.0}},
        {"name": "empty", "source": "TEST", "convention": "pooled", "metrics": {"tau": None}}])
    pf = load_published(path)  # not requested: skipped, and said in the run config
    assert [b.name for b in pf.baselines] == ["real"] and [s.split(":")[0] for s in pf.skipped] == ["unverified",
                                                                                                     "empty"]
    for name, why in (("unverified", "placeholder: true"), ("empty", "no numbers")):
        with pytest.raises(PublishedError, match=f"entry '{name}' is requested \\(published_entries\\) but has {why}"):
            load_published(path, ["real", name])
    assert load_published(path, ["real"], budgets=[16, 32]).baselines[0].metrics["ddtree/tau_b32"] == 6.0
    with pytest.raises(PublishedError, match=r"entry 'real': metrics.ddtree/tau_b32 has no live counterpart \(the "
                                             r"DDTree budgets evaluated are \[16, 64\]\)"):
        load_published(path, budgets=[64, 16])


def test_no_figure_carries_specforges_name_unless_it_is_specforges(scored):
    _, _, report = scored
    names = [k for k in report.summary if "specforge" in k.lower()]
    assert names == [SPECFORGE_ACC] and not math.isnan(report.summary[SPECFORGE_ACC])


# -- the authors' own table, and figures per category ----------------------------------------------------------------

# z-lab/dflash README.md at commit bb48ef9 (2026-01-05), temperature 0, tau only: what the shipped file must hold.
AUTHORS_TABLE = {
    "dflash-qwen3-8b-b16": {"gsm8k": 6.55, "math500": 7.87, "aime24": 7.48, "aime25": 7.31, "humaneval": 6.55,
                            "mbpp": 6.00, "livecodebench": 7.12, "swe-bench": 3.69, "mt-bench": 4.25, "alpaca": 3.16},
    "dflash-qwen3-4b-b16": {"gsm8k": 6.50, "math500": 7.84, "aime24": 7.47, "aime25": 7.28, "humaneval": 6.63,
                            "mbpp": 6.19, "livecodebench": 6.97, "swe-bench": 3.70, "mt-bench": 4.35, "alpaca": 3.10},
}


def test_the_authors_table_ships_as_request_means_per_benchmark():
    """configs/baselines/published.yaml holds the authors' temperature-0 taus as real entries, per benchmark (the
    dataset names of their run_benchmark.sh), under the live per-category request mean; DDTree's stays a
    placeholder."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / "baselines" / "published.yaml"
    pf = load_published(path)
    got = {b.name: b for b in pf.baselines}
    assert set(got) == set(AUTHORS_TABLE)
    for name, table in AUTHORS_TABLE.items():
        b = got[name]
        assert b.metrics == {f"category/{c}/tau_request_mean": v for c, v in table.items()}
        assert "z-lab/dflash" in b.source and "bb48ef9" in b.source and b.details["convention"] == "request_mean"
        for fact in ("B200", "enable_thinking=False", "--max-new-tokens 2048", "block size 16", "temperature 0"):
            assert fact in b.details["setting"], (name, fact)
        assert "not a like-for-like comparison" in b.details["note"]
    assert any(s.startswith("ddtree-paper-qwen3-8b: placeholder") for s in pf.skipped)


def test_category_request_means_follow_dflash_benchmark(scored):
    """``category/<c>/tau_request_mean``: dflash.benchmark's figure (the mean over requests of each request's mean
    acceptance length) over the requests of one category, beside which a per-benchmark published figure stands."""
    import numpy as np

    from dflash_cb.core.figures.derived import live_metrics

    cache, _, report = scored
    res = report_to_results(report, cache)
    live = live_metrics(report.samples, [], cache.categories, n_resamples=20)
    for c in cache.categories:
        mine = [s.acceptance_lengths for s in report.samples if s.category == c and s.acceptance_lengths]
        want = float(np.mean([np.mean(x) for x in mine]))
        key = f"category/{c}/tau_request_mean"
        assert res.metrics[key] == pytest.approx(want, rel=1e-12) and live[key] == res.metrics[key]
        assert ci_low(key) in res.metrics and ci_high(key) in res.metrics


def test_published_category_figures_follow_the_convention(tmp_path):
    from dflash_cb.core.results.baselines import PublishedError

    pf = load_published(_published(tmp_path, [
        {"name": "p", "source": "TEST", "convention": "pooled", "metrics": {"category/code/tau": 5.0}},
        {"name": "r", "source": "TEST", "convention": "request_mean", "metrics": {"category/gsm8k/tau": 6.5}}]))
    assert [b.metrics for b in pf.baselines] == [{"category/code/tau": 5.0}, {"category/gsm8k/tau_request_mean": 6.5}]
    cases = [({"convention": "served_request_mean", "metrics": {"category/gsm8k/tau": 6.5}},
              "'category/gsm8k/tau' under convention 'served_request_mean': per category dflash-cb measures pooled "
              "and request_mean only"),
             ({"convention": "request_mean", "metrics": {"category/gsm8k/tau": 0.5}}, "is 0.5: an acceptance length"),
             ({"convention": "request_mean", "metrics": {"category//tau": 6.5}}, "not a figure dflash-cb logs"),
             ({"convention": "request_mean", "metrics": {"category/gsm8k/tau_request_mean": 6.5}},
              "give it as category/gsm8k/tau with convention: request_mean")]
    for entry, needle in cases:
        with pytest.raises(PublishedError) as e:
            load_published(_published(tmp_path, [{"name": "x", "source": "TEST", **entry}]))
        assert needle in str(e.value), (entry, str(e.value))
