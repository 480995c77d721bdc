"""SGLang's settings that cut or time out the host tier's hits, found once at attach.

At a glance:
    server_args() -> (memory, model) | None   the server's settings in this process
    spec_bag() -> settings | None         its speculative-decoding settings (the draft model)
    published_weights() -> (model, weights)   identity.weights_of over those ("", {}: none)
    server_settings() -> dict | None      SGLang's HiCache settings in effect in this process
                                          (None outside a server: nothing to check)
    cuts(settings, host_tokens, device_tokens, bytes_per_token) -> [str]
                                          each setting that will cut L3 hits, with the flag
                                          to change (pure)
    warn_cuts(pool)                       one warning at attach naming them all (never raises)

What SGLang 0.5.23 does with a hit the store reports (sglang/srt/...):
  - prefetch policy (mem_cache/unified_radix_cache.py, _can_terminate_prefetch): best_effort ends
    a prefetch when its request is scheduled; timeout when it has waited prefetch_timeout_base +
    prefetch_timeout_per_ki_token per 1024 tokens (1 s + 0.25 s, extra-config keys); either
    way the pages not yet landed are recomputed. wait_complete waits for every page.
  - host memory (mem_cache/hybrid_cache/hybrid_cache_controller.py, allocate_storage_hit): a
    hit is cut to the host pool's free tokens after evicting host-only pages; under
    write_through every page on the GPU keeps its host copy (a host page is evictable only
    once its GPU copy is gone), so once the GPU holds as many tokens as the host pool, hits
    shrink to what is left. The pool must hold the GPU's pages plus the prefix restored.
  - SGLang also starts no new prefetch while half the host pool is being prefetched into
    (managers/cache_controller.py, prefetch_capacity_limit): one long prefix still goes ahead.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

logger = logging.getLogger("tutti_hicache.storage")

_TIMEOUT_BASE_S, _TIMEOUT_PER_KI_S = 1.0, 0.25  # SGLang's defaults for the timeout policy


def server_args() -> Optional[tuple]:
    """(memory settings, model settings) of the server in this process: 0.5.23's runtime
    context bags, else 0.5.17's global server args (both); None when no server published them
    (a test, a tool)."""
    try:
        from sglang.srt.runtime_context import get_memory, get_model
        bag, model = get_memory(), get_model()
    except ImportError:  # 0.5.17
        try:
            from sglang.srt.server_args import get_global_server_args
            bag = model = get_global_server_args()
        except Exception:
            return None
    except (ValueError, RuntimeError):  # not published in this process
        return None
    return None if bag is None else (bag, model)


def spec_bag():
    """The speculative-decoding settings of the server in this process (0.5.23's `spec` bag,
    0.5.17's global server args); None when none were published."""
    try:
        from sglang.srt.runtime_context import get_spec
        return get_spec()
    except ImportError:  # 0.5.17
        found = server_args()
        return found[1] if found else None
    except (ValueError, RuntimeError):
        return None


def published_weights() -> tuple[str, dict]:
    """identity.weights_of for the server in this process, from its published settings."""
    from .identity import weights_of
    found = server_args()
    return weights_of(found[1], spec_bag()) if found else ("", {})


def server_settings() -> Optional[dict]:
    """The HiCache settings of the server in this process; None when no server published them."""
    found = server_args()
    if found is None:
        return None
    bag, model = found
    extra = getattr(bag, "hicache_storage_backend_extra_config", None)
    try:
        extra = json.loads(extra) if isinstance(extra, str) and not extra.startswith("@") else {}
    except ValueError:
        extra = {}
    return {"prefetch_policy": getattr(bag, "hicache_storage_prefetch_policy", None),
            "host_memory_mode": getattr(bag, "hicache_host_memory_mode", "cache"),
            "hicache_size": getattr(bag, "hicache_size", 0) or 0,
            "hicache_ratio": getattr(bag, "hicache_ratio", None),
            "context_length": getattr(model, "context_length", None) or 0,
            "timeout_base_s": float(extra.get("prefetch_timeout_base", _TIMEOUT_BASE_S)),
            "timeout_per_ki_s": float(extra.get("prefetch_timeout_per_ki_token",
                                                _TIMEOUT_PER_KI_S))}


def cuts(s: dict, host_tokens: int, device_tokens: int, bytes_per_token: int) -> list[str]:
    """What in settings `s` will cut L3 hits, one phrase each naming the flag to change."""
    out = []
    policy = s.get("prefetch_policy")
    if policy == "best_effort":
        out.append("--hicache-storage-prefetch-policy best_effort ends each prefetch when its "
                   "request is scheduled and recomputes the pages not yet read (use "
                   "wait_complete)")
    elif policy == "timeout":
        out.append(f"--hicache-storage-prefetch-policy timeout (SGLang's default) recomputes "
                   f"the pages not read within {s['timeout_base_s']:g} s + "
                   f"{s['timeout_per_ki_s']:g} s per 1024 tokens of waiting (use wait_complete)")
    if s.get("host_memory_mode", "cache") != "cache":
        return out
    need = device_tokens + s.get("context_length", 0)
    if host_tokens < max(need, device_tokens + 1):
        gb = -(-need * bytes_per_token // 10**9)  # --hicache-size: whole GB of 10^9 bytes
        flag = (f"--hicache-size {s['hicache_size']}" if s.get("hicache_size")
                else f"--hicache-ratio {s.get('hicache_ratio') or 2:g}")
        out.append(f"the host pool ({flag}: {host_tokens} tokens) is smaller than the GPU's KV "
                   f"pool ({device_tokens} tokens)"
                   + (f" plus one {s['context_length']}-token context" if s.get("context_length")
                      else "")
                   + f", and every page on the GPU keeps its host copy, so hits are cut to the "
                     f"host memory left (raise --hicache-size to at least {gb}, or lower "
                     f"--mem-fraction-static for a smaller GPU pool)")
    return out


def warn_cuts(pool: Any) -> None:
    """One warning when the server's settings will cut the hits of the store attached to
    `pool` (SGLang's host KV pool); silent outside a server. Never raises."""
    try:
        s = server_settings()
        if s is None:
            return
        device = getattr(pool, "device_capacity_tokens", None)
        if device is None:  # 0.5.17: the host pool holds its device pool
            device = pool.device_pool.size
        found = cuts(s, int(pool.size), int(device), int(pool.size_per_token))
    except Exception:
        logger.debug("tutti: could not read SGLang's HiCache settings", exc_info=True)
        return
    if found:
        logger.warning("tutti: SGLang's settings will cut this store's hits: %s",
                       "; ".join(found))
