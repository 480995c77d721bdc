"""Triton kernels that move KV objects between SGLang's paged device pools and contiguous staging.

The package ``tutti_kernels``, rooted in the repository's ``triton_kernels/`` folder (the bare name
``triton_kernels`` belongs to sglang-kernel's package); its modules import each other relatively and never
import ``tutti_hicache``.

* ``scatter_layer`` / ``scatter_pages``: staging -> pool (restore); ``scatter_rows``: rows of a larger
  source (the linker's DRAM tier) -> pool, no staging.
* ``copy_pages``: pool pages -> other pages of the same pool (one request's restored pages into another's).
* ``gather_layer`` / ``gather_pages``: pool -> staging (offload).
* ``*_ref``: plain-torch references with the same contracts.

One signature for MHA and MLA: ``(staging, k_buf(s), v_buf(s), page_ids, page_size, obj_stride=None)``, with
``v_buf(s)=None`` for MLA, whose single latent buffer per layer is passed as ``k_buf(s)``.
The page ids a scatter writes must be distinct: an object over 16 KiB is copied in chunks by
several programs, so two sources for one page could leave it holding chunks of both (the callers'
ids are SGLang's slots, distinct, and the loader's dedupe keeps copies' sources and destinations
apart). Nothing checks it.
"""

from .gather import gather_layer, gather_layer_ref, gather_pages, gather_pages_ref
from .scatter import (copy_pages, copy_pages_ref, scatter_layer, scatter_layer_ref, scatter_pages,
                      scatter_pages_ref, scatter_rows, scatter_rows_ref)

__all__ = ["copy_pages", "copy_pages_ref", "gather_layer", "gather_layer_ref", "gather_pages", "gather_pages_ref",
           "scatter_layer", "scatter_layer_ref", "scatter_pages", "scatter_pages_ref", "scatter_rows",
           "scatter_rows_ref"]
