"""Triton kernels that move KV objects between SGLang's paged device pools and contiguous staging.

Installed as ``tutti_hicache.triton_kernels`` (the bare name ``triton_kernels`` belongs to another package), so
modules here import each other relatively and never import ``tutti_hicache``.

* ``scatter_layer`` / ``scatter_layer_mla`` / ``scatter_pages`` / ``scatter_pages_mla``: staging -> pool (restore).
* ``gather_layer`` / ``gather_layer_mla`` / ``gather_pages`` / ``gather_pages_mla``: pool -> staging (offload).
* ``*_ref``: plain-torch references with the same contracts (``v_buf(s)=None`` for MLA).
"""

from .gather import (gather_layer, gather_layer_mla, gather_layer_ref, gather_pages, gather_pages_mla,
                     gather_pages_ref)
from .scatter import (scatter_layer, scatter_layer_mla, scatter_layer_ref, scatter_pages, scatter_pages_mla,
                      scatter_pages_ref)

__all__ = [
    "gather_layer", "gather_layer_mla", "gather_layer_ref", "gather_pages", "gather_pages_mla", "gather_pages_ref",
    "scatter_layer", "scatter_layer_mla", "scatter_layer_ref", "scatter_pages", "scatter_pages_mla",
    "scatter_pages_ref",
]
