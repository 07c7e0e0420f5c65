"""Every instruction-set variant of the CPU kernels against the same torch references.

Variants this machine runs: the torch-free kernels through the harness (a build takes seconds)
and the whole fused step through the extension built for that variant (~1 min each, so the ones
beyond the native variant are in the slow suite). The aarch64 variants (NEON with and without the
dot-product extension) are cross-compiled with Debian's g++-aarch64-linux-gnu and run under
qemu-user; without that toolchain these tests skip and say how to install it.
"""
import platform
import shutil

import pytest
import torch

import tokenspeed
from support import block_layer, qk_blocks
from tokenspeed.kernels import cpu_decode
from tokenspeed.kernels.cpu_decode import FUSED_ROWS, VARIANTS, cpu_features, native_variant
from tokenspeed.kernels.cpu_harness import Harness, build
from tokenspeed.model import ModelArgs, Transformer
from tokenspeed.quant import Int4Linear, Int8Embedding, Int8Linear, Q4KInt4Linear, fused_ext
from tokenspeed.paths import cache_dir

ARCH = platform.machine()
RUNNABLE = [n for n, v in VARIANTS.items() if v.arch in ("", ARCH) and set(v.needs) <= cpu_features()]
ARM = ["neon-dotprod", "neon"]
CROSS, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
NO_ARM = ("needs Debian's g++-aarch64-linux-gnu and qemu-user (apt-get install -y g++-aarch64-linux-gnu qemu-user; "
          ".ci/run installs them)")


@pytest.fixture(scope="module")
def harnesses(tmp_path_factory):
    """Variant name -> built harness (native variants, and the ARM ones when the toolchain is present)."""
    out, built = tmp_path_factory.mktemp("harness"), {}
    for name in RUNNABLE:
        built[name] = Harness(build(name, out / name))
    if ARCH != "aarch64" and shutil.which(CROSS) and shutil.which(QEMU):
        for name in ARM:
            built[name] = Harness(build(name, out / name, compiler=CROSS, static=True), runner=(QEMU, "-cpu", "max"))
    return built


def _harness(harnesses, name):
    if name not in harnesses:
        pytest.skip(NO_ARM if name in ARM else f"this CPU cannot run {name}")
    return harnesses[name]


def _attention_reference(q, T, start, k, v, scale):
    """Softmax attention of rows q [R, D] where row r sees slots [0, start + r % T]."""
    end = start + T
    s = (q.double() @ k[:end].double().T) * scale
    visible = start + torch.arange(q.shape[0]) % T + 1
    s = s.masked_fill(torch.arange(end)[None, :] >= visible[:, None], float("-inf"))
    return torch.softmax(s, -1), torch.softmax(s, -1) @ v[:end].double(), torch.logsumexp(s, -1)


ALL = RUNNABLE + [n for n in ARM if n not in RUNNABLE]


@pytest.mark.parametrize("variant", ALL)
def test_harness_kernels_match_reference(harnesses, variant):
    h = _harness(harnesses, variant)
    assert h.isa() == variant
    torch.manual_seed(0)
    # W4A8: every variant computes the same exact integer sums and per-lane fused multiply-adds, so
    # its results equal the extension's bit for bit; rows 1..9 cover the register blocks and remainders
    lin = Int4Linear(torch.randn(48, 96))
    native = fused_ext()
    for rows in (1, 2, 3, 4, 6, 8, 9):  # every register block of every family (avx2: 2 rows, 2 slices a pass)
        x = torch.randn(rows, 96)
        x[0, :32] = 0  # an all-zero group: scale 0, codes 0
        y = h.int4_matmul(x, lin.codes, lin.scales)
        torch.testing.assert_close(y, lin.reference(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(y, native.int4_matmul(x, lin.codes, lin.scales))
    # a Q4_K file's blocks with their two-level scales (Q4KInt4Linear): every code, 6-bit scale and minimum
    lin = Q4KInt4Linear.from_blocks(qk_blocks(48, 512))
    for rows in (1, 2, 3, 4, 6, 8, 9):
        x = torch.randn(rows, 512)
        y = h.int4_matmul(x, lin.codes, lin.scales)
        torch.testing.assert_close(y, lin.reference(x), rtol=1e-5, atol=1e-4)
        assert torch.equal(y, native.int4_matmul(x, lin.codes, lin.scales))
    # the largest integer sums: codes 0 and 15 against activations of +-127 (avx2 sums a group in int16 lanes)
    lin = Int4Linear(torch.cat([torch.ones(16, 96), -torch.ones(16, 96)]) + torch.linspace(0, 1, 96))
    x = torch.where(torch.rand(4, 96) > 0.5, 1.0, -1.0)
    y = h.int4_matmul(x, lin.codes, lin.scales)
    torch.testing.assert_close(y, lin.reference(x), rtol=1e-5, atol=1e-4)
    assert torch.equal(y, native.int4_matmul(x, lin.codes, lin.scales))
    # W8A8 (Q8_0 x Q8_0): int8 codes times activations quantized per group of 32, exact integer sums
    # (`Int8Linear.reference`); per-row scales with K not a multiple of 32 (a shorter last group),
    # Q8_0 groups of 32, and a tied lm_head on the embedding table's own groups
    table = Int8Embedding(torch.randn(50, 64) * torch.rand(50, 2).repeat_interleave(32, 1))
    # (43 output rows and 15 token rows: every tile shape, panel and token remainder of cpu_kernels.cpp's
    # register tiles)
    for lin8, K in ((Int8Linear(torch.randn(43, 70)), 70),
                    (Int8Linear(torch.randn(43, 96) * torch.rand(43, 3).repeat_interleave(32, 1), group=32), 96),
                    (Int8Linear.tied(table), 64)):
        x = torch.randn(15, K)
        x[1, :32] = 0  # an all-zero group: scale 0, codes 0
        y = h.int8_gemv(x, lin8.qweight, lin8.scales)  # [15, 48]: the layout's rows, padded to blocks of 16
        torch.testing.assert_close(y[:, :lin8.out_features], lin8.reference(x), rtol=1e-5, atol=1e-4)
        # a row's result does not depend on the rows beside it nor on the tile it falls in (decode ==
        # verification, bit for bit), and equals the extension's whatever the variant: every family computes
        # the same exact integer sums and per-lane fused multiply-adds (no horizontal sum)
        assert all(torch.equal(h.int8_gemv(x[r:r + n], lin8.qweight, lin8.scales), y[r:r + n])
                   for r, n in ((0, 1), (4, 1), (14, 1), (1, 2), (1, 3), (3, 5), (2, 7), (5, 10)))
        assert torch.equal(native.int8_gemv(x, lin8.qweight, lin8.scales), y)
    # the largest products: codes -128 and 127 against activations of +-127 (avx2 sums byte pairs in int16)
    lin8 = Int8Linear(torch.randn(16, 64))
    lanes = lin8.qweight.view(1, 16, 16, 4)  # [block, chunk, row, byte]
    lanes[:, :, :8], lanes[:, :, 8:] = -128, 127
    x = torch.where(torch.rand(4, 64) > 0.5, 1.0, -1.0)
    torch.testing.assert_close(h.int8_gemv(x, lin8.qweight, lin8.scales), lin8.reference(x), rtol=1e-5, atol=1e-4)
    # Q5_0 interleaved by 16 rows (random codes and fifth bits; rows of 7 blocks, not whole 256-blocks; 40
    # rows: a padded block of 16): exact integer sums and per-lane fused multiply-adds, so every variant's
    # results equal the extension's bit for bit, whatever the rows beside them
    lin = block_layer("Q5_0", 40, 224)
    x = torch.randn(15, 224)
    x[1, :32] = 0
    y = h.q5_0_gemv(x, lin.blocks)
    torch.testing.assert_close(y[:, :40], lin.reference(x), rtol=1e-5, atol=1e-4)
    assert torch.equal(y, native.q5_0_gemv(x, lin.blocks))
    assert all(torch.equal(h.q5_0_gemv(x[r:r + n], lin.blocks), y[r:r + n])
               for r, n in ((0, 1), (4, 1), (14, 1), (1, 2), (1, 3), (3, 5), (2, 7), (5, 10)))
    # ... and its largest sums: codes 31 (every low and fifth bit set) against activations of +-127
    lin.blocks[..., :320] = 255
    x = torch.where(torch.rand(4, 224) > 0.5, 1.0, -1.0)
    y = h.q5_0_gemv(x, lin.blocks)
    torch.testing.assert_close(y[:, :40], lin.reference(x), rtol=1e-5, atol=1e-4)
    assert torch.equal(y, native.q5_0_gemv(x, lin.blocks))
    # GGUF blocks as stored (random codes, fifth bits, scales and minimums): the same reference on every
    # variant
    for fmt, K in (("Q4_K", 512), ("Q5_K", 512), ("Q6_K", 512)):
        lin = block_layer(fmt, 40, K)
        x = torch.randn(9, K)
        x[1, :32] = 0
        y = h.block_gemv(x, lin.blocks, lin.FORMAT.ggml_type)
        torch.testing.assert_close(y, lin.reference(x), rtol=1e-5, atol=1e-4)
        assert all(torch.equal(h.block_gemv(x[r:r + n], lin.blocks, lin.FORMAT.ggml_type), y[r:r + n])
                   for r, n in ((0, 1), (4, 1), (3, 5)))
        if variant == native_variant():
            assert torch.equal(native.block_gemv(x, lin.blocks, lin.FORMAT.ggml_type), y)
    # the largest sums: codes 31 (63) against activations of +-127 (avx2 sums byte pairs in int16), Q6_K's
    # under scales of -128 (the int16 pair sums times the scale in one vpmaddwd)
    for fmt, K, fill in (("Q5_K", 512, [(16, 176, 255)]),
                         ("Q6_K", 512, [(0, 192, 255), (192, 208, 128)])):  # (bytes [start, stop) of each block, value)
        lin = block_layer(fmt, 40, K)
        for start, stop, byte in fill:
            lin.blocks.view(40, -1, lin.FORMAT.nbytes)[..., start:stop] = byte
        x = torch.where(torch.rand(4, K) > 0.5, 1.0, -1.0)
        torch.testing.assert_close(h.block_gemv(x, lin.blocks, lin.FORMAT.ggml_type), lin.reference(x),
                                   rtol=1e-5, atol=1e-4)
    # attention: decode (1 row per query head of a group of 3), a verification chain (T = 4), head
    # sizes of every specialised width and ones that are not (40, 20: the plain loops) and prefill
    # bursts (rows in several tiles of 32, causal bounds per tile, key tiles plus a tail)
    for D, T, start in ((64, 1, 37), (64, 4, 30), (32, 5, 3), (128, 2, 9), (16, 3, 6), (40, 2, 7), (20, 3, 11),
                        (64, 45, 70), (32, 40, 0)):
        q, k, v = torch.randn(3 * T, D), torch.randn(start + T, D), torch.randn(start + T, D)
        p, out, lse = h.attend(q, T, start, k, v, D ** -0.5)
        rp, rout, rlse = _attention_reference(q, T, start, k, v, D ** -0.5)
        torch.testing.assert_close(p.double(), rp, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.double(), rout, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse.double(), rlse, rtol=1e-5, atol=1e-5)
        # a row's result does not depend on the rows beside it (decode == verification, bit for bit)
        alone = h.attend(q[:T], T, start, k, v, D ** -0.5)
        assert all(torch.equal(a, b[:T]) for a, b in zip(alone, (p, out, lse)))
        # nor on the new tokens beside it: a burst's row equals that token decoded alone after the ones before it
        for r in {0, T - 1, 2 * T + T // 2}:
            seen = start + r % T
            p1, out1, lse1 = h.attend(q[r:r + 1], 1, seen, k, v, D ** -0.5)
            assert torch.equal(p1[0], p[r, :seen + 1]) and torch.equal(out1[0], out[r]) and torch.equal(lse1[0], lse[r])


@pytest.mark.parametrize("variant", ALL)
def test_harness_swiglu_matches_reference(harnesses, variant):
    # the fused step's MLP activation silu(gate) * up against torch's (in float64): the vector body of
    # the vector families and the scalar expression (the generic family's, and a row's tail: F = 37),
    # across the exponent's clamp (|g| > 87), signed zeros and a NaN that stays NaN
    h = _harness(harnesses, variant)
    torch.manual_seed(0)
    edge = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5, 20.0, -20.0, 87.5, -87.5, 100.0, -100.0, 1e4, -1e4,
                         float("nan")])
    gate = torch.cat([torch.randn(3, 22) * 4, edge.repeat(3, 1)], 1)  # [3, 37]
    up = torch.randn(3, 37)
    ours = h.swiglu(torch.cat([gate, up], 1))
    ref = (torch.nn.functional.silu(gate.double()) * up.double()).float()
    torch.testing.assert_close(ours, ref, rtol=2e-6, atol=1e-30, equal_nan=True)


@pytest.mark.parametrize("variant", ALL)
def test_harness_half_kv_matches_reference(harnesses, variant):
    # the fp16 KV cache: the kernels' write rounds like torch's .half() (nearest-even, ties, subnormals,
    # overflow to inf, NaN), and attention over half keys and values equals attention over the same
    # values widened to fp32 bit for bit (the kernel reads them exactly; the math is the fp32 one)
    h = _harness(harnesses, variant)
    torch.manual_seed(0)
    ulp = torch.tensor([2.0 ** -10, 2.0 ** -24, 2.0 ** -14])  # at 1, the smallest subnormal, the smallest normal
    x = torch.cat([torch.randn(997) * 4, torch.randn(64) * 1e-5, torch.rand(64) * 7e4,
                   torch.tensor([0.0, -0.0, 1 + ulp[0] / 2, 1 + 3 * ulp[0] / 2, ulp[1] / 2, 3 * ulp[1] / 2,
                                 ulp[2] - ulp[1] / 2, 65504.0, 65519.0, 65520.0, -1e9, float("inf"),
                                 float("-inf"), float("nan")])])
    ours, ref = h.to_half(x), x.half()
    assert torch.equal(ours.view(torch.int16)[:-1], ref.view(torch.int16)[:-1]) and ours[-1].isnan()
    for D, T, start in ((64, 1, 37), (64, 4, 30), (32, 5, 3), (40, 2, 7), (20, 3, 11), (64, 45, 70)):
        q = torch.randn(3 * T, D)
        k, v = torch.randn(start + T, D).half(), torch.randn(start + T, D).half()
        got = h.attend(q, T, start, k, v, D ** -0.5)
        assert all(torch.equal(a, b) for a, b in zip(got, h.attend(q, T, start, k.float(), v.float(), D ** -0.5)))
        alone = h.attend(q[:T], T, start, k, v, D ** -0.5)  # verification rows == decode rows, bit for bit
        assert all(torch.equal(a, b[:T]) for a, b in zip(alone, got))
        for a, b in zip(got, _attention_reference(q, T, start, k.float(), v.float(), D ** -0.5)):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_variant_selection(monkeypatch):
    monkeypatch.setenv(cpu_decode.ISA_ENV, "avx3")
    with pytest.raises(ValueError, match="unknown variant"):
        cpu_decode.selected_variant()
    foreign = "neon" if ARCH == "x86_64" else "avx2"
    monkeypatch.setenv(cpu_decode.ISA_ENV, foreign)
    with pytest.raises(ValueError, match="lacks"):
        cpu_decode.selected_variant()
    monkeypatch.delenv(cpu_decode.ISA_ENV)
    assert cpu_decode.selected_variant() == native_variant() == RUNNABLE[0]
    assert fused_ext().isa() == native_variant()


def _assert_logits_close(a, b):
    # fp32 sums in another order: ~16 ulp of the largest logit beside 1e-4 (the fp32 Qwen3-like model's
    # logits reach ~74, where torch's AVX-512 GEMMs and an avx2 step measured 1.5e-4 apart, both paths
    # 1.4e-3 from the same forward in float64)
    assert (a - b).abs().max() <= 1e-4 + 2e-6 * a.abs().max()


def _fused_vs_python(model, new):
    """Logits of forwards of len(n) new tokens after a 37-token prefill, fused and Python path."""
    outs = {}
    for fused in (False, True):
        torch.manual_seed(1)
        ids = torch.randint(0, 1000, (37 + sum(new),))
        model.use_fused = fused
        cache = model.new_cache(37 + sum(new) + 4)
        model(ids[:37], torch.arange(37), cache, "none")
        outs[fused], at = [], 37
        for n in new:
            outs[fused].append(model(ids[at:at + n], torch.arange(at, at + n), cache, "all"))
            at += n
    model.use_fused = True
    return outs[False], outs[True]


@pytest.mark.slow
@pytest.mark.parametrize("variant", [n for n in RUNNABLE if n != RUNNABLE[0]])
def test_fused_step_of_each_variant_matches_python_path(monkeypatch, variant):
    # the extension built for `variant` (its own cache folder): the fused step equals the Python
    # path on the tiny model in every weight format, and its int4 matmul equals the native build's
    monkeypatch.setenv(cpu_decode.ISA_ENV, variant)
    ext = cpu_decode.load(cache_dir())
    assert ext is not None and ext.isa() == variant
    for quant in (None, "int8", "int4"):
        model = tokenspeed.Engine.load("tiny-random", quantize=quant).model
        assert model.fused_decode().ext is ext
        for a, b in zip(*_fused_vs_python(model, [1, 2, 5, FUSED_ROWS])):
            _assert_logits_close(a, b)
    # Qwen3's per-head Q/K norms and a layer without rotation (SmolLM3's NoPE) in the same step
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=128,
                                  vocab_size=1000, max_seq_len=256, qk_norm=True, no_rope_layers=(1,))).eval()
    for layer in model.layers:
        for w in (layer.attention.q_norm, layer.attention.k_norm):
            w.data.uniform_(0.5, 1.5)
    assert model.fused_decode().ext is ext
    for a, b in zip(*_fused_vs_python(model, [1, 2, 5, FUSED_ROWS])):
        _assert_logits_close(a, b)
    torch.manual_seed(0)
    lin, x = Int4Linear(torch.randn(64, 128)), torch.randn(5, 128)
    monkeypatch.delenv(cpu_decode.ISA_ENV)
    assert torch.equal(ext.int4_matmul(x, lin.codes, lin.scales), fused_ext().int4_matmul(x, lin.codes, lin.scales))
