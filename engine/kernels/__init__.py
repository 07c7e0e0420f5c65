"""Attention kernels that also report per-slot attention mass (for KV relevance scoring).

`attention_with_mass` is the torch reference (any device, CPU included). `triton_decode`
holds a Triton decode-attention kernel (one query token) with the same contract; it is used on
CUDA when Triton is installed and is checked on CPU under `TRITON_INTERPRET=1`.
"""
from .attention import attention_with_mass, select_attention_with_mass

__all__ = ["attention_with_mass", "select_attention_with_mass"]
