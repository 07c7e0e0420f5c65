"""Attention-with-mass kernels: the torch path against SDPA, the Triton decode kernel (run by the
Triton interpreter on CPU) against the torch path."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read by triton when kernels are decorated

import pytest
import torch
import torch.nn.functional as F

from tokenspeed.kernels import attention_with_mass


def _qkv(H=9, Hkv=3, T=5, S=40, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, H, T, D, generator=g), torch.randn(1, Hkv, S, D, generator=g),
            torch.randn(1, Hkv, S, D, generator=g))


@pytest.mark.parametrize("masked", [False, True])
def test_torch_path_matches_sdpa_and_mass_sums_to_queries(masked):
    q, k, v = _qkv()
    T, S = q.shape[2], k.shape[2]
    mask = None
    if masked:  # cached slots visible, causal among the new tokens (as Transformer.forward builds it)
        mask = torch.ones(T, S, dtype=torch.bool)
        mask[:, S - T:] = torch.ones(T, T, dtype=torch.bool).tril()
    out, mass, lse = attention_with_mass(q, k, v, mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert mass.shape == (S,) and lse.shape == (9, T)
    torch.testing.assert_close(mass.sum(), torch.tensor(9.0 * T))  # each (head, query) spreads 1
    if masked:
        assert float(mass[-1]) > 0 and torch.all(mass >= 0)
    # mass is the sum of softmax probabilities: check one slot by hand
    s = (q[0] @ k[0].repeat_interleave(3, 0).transpose(-1, -2)) / 8.0
    if masked:
        s = s.masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(mass[3], s.softmax(-1)[..., 3].sum(), atol=1e-5, rtol=1e-5)


def test_torch_path_rejects_bad_shapes():
    q, k, v = _qkv(H=8, Hkv=3)
    with pytest.raises(ValueError):
        attention_with_mass(q, k, v, None)


@pytest.mark.parametrize("S", [1, 70, 300])
def test_triton_decode_matches_torch_path(S):
    pytest.importorskip("triton")
    from tokenspeed.kernels import triton_decode
    q, _, _ = _qkv(T=1)
    _, kc, vc = _qkv(T=1, S=320, seed=1)
    k, v = kc[:, :, :S], vc[:, :, :S]  # a prefix slice of a larger cache, as the model passes it
    out, mass, lse = triton_decode.decode_attention_with_mass(q, k, v, block_s=32, slots_per_split=128)
    ref_out, ref_mass, ref_lse = attention_with_mass(q, k, v, None)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass, ref_mass, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        triton_decode.decode_attention_with_mass(_qkv(T=2)[0], k, v)
