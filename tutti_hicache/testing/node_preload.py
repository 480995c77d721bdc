"""Imported once by the fork server of testing/cluster.py: SGLang (torchvision stub first), the
Mooncake client and the tiered backend. Only imports: no thread, no client is started here."""

from .sglang import ensure_sglang

ensure_sglang()

import mooncake.store  # noqa: E402,F401

import tutti_hicache.tiered  # noqa: E402,F401
