"""Attention kernels that also report per-slot attention mass (for KV relevance scoring).

`attention_with_mass` is the torch reference (any device, CPU included). `triton_decode`
holds a Triton decode-attention kernel (one query token) with the same contract, checked on CPU
under `TRITON_INTERPRET=1`; `attention_mass` (the model's default) uses it on CUDA when Triton
is installed (`tokenspeed.bench.gpu_attention` times them on a GPU). The kernels import nothing
of the engine above them.
"""
from .attention import attention_mass, attention_with_mass

__all__ = ["attention_mass", "attention_with_mass"]
