"""Shared fixtures and helpers for the codec-core tests.

Hypothesis runs with no example database (nothing is written outside tests/) and no
deadline (the first call of a numba kernel may compile).
"""

from __future__ import annotations

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


