"""Shared fixtures: a tiny Qwen3 target and a cache of its states, built once per test session
through the real precompute (``--reference local --dtype float32``)."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The tests' helpers (tests/support/), and every test folder: a test module reads another's fixtures by its module
# name (``from test_dflash2 import SELECTOR``) whichever file is run alone.
for _folder in ("support", "cache", "core", "integrations", "demo", "families"):
    sys.path.insert(0, str(Path(__file__).resolve().parent / _folder))

from tiny_target import TINY_LAYER_IDS, TINY_MASK, build_tiny_cache  # noqa: E402

# Keep W&B local and quiet in every test, whatever the machine's configuration.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# One thread everywhere (the session's torch, the tools' --threads default, subprocesses): the tests compare
# tensors bit for bit across runs, which needs one reduction order, and tiny models gain nothing from more.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The cyclic collector walked every live object (millions once torch and transformers are imported) every few
# seconds: about a tenth of the fast subset's time. Run it less often; reference counting frees as before, and
# no test reads the collector.
gc.set_threshold(100_000, 50, 50)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Once the test modules (and torch, transformers, ...) are imported, their long-lived objects leave the
    cyclic collector's view (``gc.freeze``): its full collections stop walking them."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests marked ``engine`` start a real vLLM from its own venv (``python dev.py test-engine`` makes it): a run
    whose ``-m`` does not name them leaves them out (deselected, not skipped), so ``python dev.py test`` and a plain
    ``pytest`` never need that venv."""
    if "engine" in (config.getoption("markexpr", "") or ""):
        return
    engine = [item for item in items if item.get_closest_marker("engine")]
    if engine:
        config.hook.pytest_deselected(items=engine)
        items[:] = [item for item in items if not item.get_closest_marker("engine")]


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a busy CI box spinning OpenMP threads cost seconds."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def threads_as_found():
    """A tool's main() run in this process sets torch's thread count (--threads): each test leaves it as it
    found it, so the next one runs with the session's one thread."""
    import torch

    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_cache(tmp_path_factory.mktemp("tiny_cache"))


@pytest.fixture(scope="session")
def tiny_drafter_config(tiny_cache: Path) -> dict:
    from dflash_cb.cache.states import StateCache
    from dflash_cb.demo.lightning_module import tiny_drafter_config

    m = StateCache(tiny_cache).manifest
    return tiny_drafter_config(m.vocab_size, m.hidden_size, int(m.target["num_layers"]), TINY_LAYER_IDS, TINY_MASK,
                               block_size=6)


@pytest.fixture(scope="session")
def tiny_dflash2_config(tiny_cache: Path) -> dict:
    """The tiny drafter as a DFlash 2 one (convolutions, a selector of 4 candidates of rank 8)."""
    from dflash_cb.cache.states import StateCache
    from dflash_cb.demo.lightning_module import tiny_drafter_config

    m = StateCache(tiny_cache).manifest
    return tiny_drafter_config(m.vocab_size, m.hidden_size, int(m.target["num_layers"]), TINY_LAYER_IDS, TINY_MASK,
                               block_size=6, family="dflash2", selector_top_k=4, selector_rank=8)


@pytest.fixture(scope="session")
def trained_tiny_drafter(tiny_cache: Path, tiny_drafter_config: dict):
    """A maker of the tiny drafter (seed 0) after ``tiny_target.train_briefly`` on the tiny cache (partial
    acceptance): trained once per session, each call a module of its own with those weights."""
    import torch
    from tiny_target import train_briefly

    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter

    torch.manual_seed(0)
    state = train_briefly(DFlashDrafter.from_config_dict(tiny_drafter_config), StateCache(tiny_cache)).state_dict()

    def make() -> DFlashDrafter:
        drafter = DFlashDrafter.from_config_dict(tiny_drafter_config)
        drafter.load_state_dict(state)
        return drafter.eval()

    return make


@pytest.fixture(scope="session")
def drafter_dir(tiny_drafter_config: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved drafter folder (random weights, seed 0) for the tiny cache."""
    import torch

    from dflash_cb.core.drafters.dflash.model import DFlashDrafter

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("drafter") / "drafter"
    DFlashDrafter.from_config_dict(tiny_drafter_config).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def oracle_world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny target, prompts and caches the exactness tests against a reference loop share
    (``tiny_target.build_oracle_world``). Read them, never change them."""
    from tiny_target import build_oracle_world

    return build_oracle_world(tmp_path_factory.mktemp("oracle_world"))


@pytest.fixture(scope="session")
def served_world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The served-check tests' world (tests/support/served_world.py), shared by the SGLang and vLLM ones: a tiny target, the
    served drafter (trained) and another, and the reference loop's runs as the fake servers compute them."""
    from served_world import build_world

    return build_world(tmp_path_factory.mktemp("served"))


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch) -> Iterator[str]:
    """A local MLflow file store in ``tmp_path``: its tracking URI, current (and in the environment, where Hugging
    Face's ``MLflowCallback`` reads it); MLflow 3 asks for the opt-in to write one."""
    import mlflow  # the dev extra installs it (mlflow-skinny)

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    previous = mlflow.get_tracking_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    yield uri
    mlflow.set_tracking_uri(previous)
