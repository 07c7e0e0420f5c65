"""Kernels: attention that also reports per-slot attention mass (for KV relevance scoring), RMSNorm
with the residual add, and the fused CPU decode step.

`attention_with_mass` and `rms_norm` / `add_rms_norm` are the torch references (any device, CPU
included). On CUDA, `attention_mass` (the pruned cache's attention) runs the Triton kernel of
`triton_decode` for decode and verification rows, and `add_rms_norm(..., triton=True)` the fused
kernel of `triton_norm`; both Triton kernels are checked on CPU under `TRITON_INTERPRET=1`, and
`tokenspeed bench gpu` checks and times them on a GPU. The kernels import nothing of the engine
above them.
"""
from .attention import attention_mass, attention_with_mass
from .norm import add_rms_norm, rms_norm

__all__ = ["attention_mass", "attention_with_mass", "add_rms_norm", "rms_norm"]
