"""Shared by the cluster tests: the `mooncake` fixture (tutti_hicache.testing.cluster once SGLang
and the Mooncake client import; a skip with the reason otherwise)."""

import importlib.util

import pytest


@pytest.fixture(scope="module")
def mooncake():
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (scripts/setup_env.sh installs it)")
    from tutti_hicache.cluster import mooncake_missing
    from tutti_hicache.testing.sglang import ensure_sglang

    ensure_sglang()

    reason = mooncake_missing()
    if reason:
        pytest.skip(f"the Mooncake client does not import: {reason}")
    from tutti_hicache.testing import cluster

    return cluster
