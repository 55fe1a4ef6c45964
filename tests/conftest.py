"""Shared fixtures, the hypothesis profile, and the check that every test has a tier.

Hypothesis runs with no example database (nothing is written outside tests/) and no
deadline (the first call of a numba kernel may compile).

Tiers are markers (registered in setup.cfg), set where the tests live:

* every test module declares its tier, ``pytestmark = pytest.mark.unit`` (or ``dist``,
  ``cli``), and a test of another tier says so on itself (``@pytest.mark.cli``): a test's
  own tier replaces its module's;
* ``unit``: in one process, fast; ``dist``: spawns torch.distributed (gloo) ranks, through
  tests/dist_utils.py; ``cli``: runs the ``comm-codec`` command line in subprocesses;
* ``@pytest.mark.slow`` (on a test, or on one case with ``pytest.param(..., marks=...)``)
  leaves it out of the quick tier, ``python -m pytest tests -m "not slow"``.

A test module without a tier fails the collection, so that a new file cannot forget one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

import comm_codec as cc

settings.register_profile(
    "comm_codec",
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("comm_codec")

TESTS = Path(__file__).resolve().parent
TIER_MARKS = frozenset({"unit", "dist", "cli"})


@pytest.hookimpl(tryfirst=True)  # before -m deselects on the markers
def pytest_collection_modifyitems(config, items):
    """Give each test exactly its tier: its own tier markers if it has any, else its module's.

    Raises:
        pytest.UsageError: a test module under tests/ declares no tier.
    """
    modules = {}
    for item in items:
        module = item.getparent(pytest.Module)
        if module is None or TESTS not in Path(str(module.path)).resolve().parents:
            continue  # not one of ours (a path given on the command line outside tests/)
        modules.setdefault(module, []).append(item)
    untiered = []
    for module, module_items in modules.items():
        # The module's tier moves from the module onto each of its tests that has none of
        # its own: marks on the module node would otherwise add to a test's own tier.
        tiers = [m for m in module.own_markers if m.name in TIER_MARKS]
        module.own_markers[:] = [m for m in module.own_markers if m.name not in TIER_MARKS]
        for item in module_items:
            if any(m.name in TIER_MARKS for m in item.iter_markers()):
                continue
            if not tiers:
                untiered.append(Path(str(module.path)).name)
                break
            for mark in tiers:
                item.add_marker(mark.name)
    if untiered:
        raise pytest.UsageError(
            f"no test tier in {', '.join(sorted(set(untiered)))}: add `pytestmark = pytest.mark.unit` "
            f"(or dist, cli) after the imports, and @pytest.mark.slow on tests the quick tier cannot afford"
        )


class _SimulatorRun:
    """Starts test_cuda.py's simulator child early and checks it last
    (:func:`test_cuda.start_simulator_run`)."""

    @pytest.hookimpl(trylast=True)  # after -k / -m deselection: these items run
    def pytest_collection_modifyitems(self, config, items):
        sim = [item for item in items if item.name == "test_cuda_kernels_in_simulator"]
        if sim and not config.option.collectonly:
            items.remove(sim[0])
            items.append(sim[0])
            sim[0].module.start_simulator_run()
            self.module = sim[0].module

    def pytest_sessionfinish(self):
        if getattr(self, "module", None) is not None:
            self.module.stop_simulator_run()


def pytest_configure(config):
    config.pluginmanager.register(_SimulatorRun(), "comm_codec_simulator_run")


@pytest.fixture(scope="session")
def default_books() -> cc.CodebookSet:
    return cc.CodebookSet.default()


@pytest.fixture(scope="session")
def codec(default_books) -> cc.Codec:
    """A codec with the shipped books and default settings."""
    return cc.Codec(default_books)


@pytest.fixture(scope="session")
def small_codec(default_books) -> cc.Codec:
    """A codec with 64-element chunks, so that small inputs span many chunks."""
    return cc.Codec(default_books, chunk_elems=64)
