// The numerical core of the fused CPU decode step: a small C ABI, no torch (cpu_kernels.cpp).
// cpu_decode.cpp binds it to torch and splits the work over threads; kernel_harness.cpp runs it
// alone (cross-compiled for aarch64 under qemu in the tests). All arrays are contiguous, row-major.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// The instruction-set family this build was compiled for ("avx512", "avx2-vnni", "avx2",
// "neon-dotprod", "neon" or "generic"; see cpu_isa.h).
const char* ts_isa_name(void);

// Activations x [T, K] fp32 -> per group of 32 (the last one shorter when K is not a multiple of
// 32; G = ceil(K / 32) groups per row): int8 codes q [T, K] (round(x * 127 / max|x|)), scale sx
// [T, G] (max|x| / 127) and sx * sum(q) xs [T, G] (xs may be NULL: not written).
void ts_quantize_rows(const float* x, int64_t T, int64_t K, int8_t* q, float* sx, float* xs);

// y [T, N] fp32, output blocks [nb0, nb1) of 16 channels: the W4A8 product of the quantized
// activations (ts_quantize_rows) with int4 codes [N / 16, K / 8, 64] uint8 and bf16 scales
// [N / 16, K / 32, 2, 16] (layout: tokenspeed.quant.Int4Linear.pack). Each row's result is
// bit-identical whatever T is, and across instruction-set families.
void ts_int4_rows(const int8_t* q, const float* sx, const float* xs, int64_t T, int64_t K, const uint8_t* codes,
                  const uint16_t* scales, float* y, int64_t N, int64_t nb0, int64_t nb1);

// y [T, N] fp32, output rows [j0, j1): the W8A8 product of the quantized activations (ts_quantize_rows:
// q [T, K], sx [T, ceil(K / 32)]) with int8 weights w [N, K] (row-major) and fp32 scales [N, G]: G = 1
// one per row, or G = K / 32 one per 32 input channels (a GGUF file's Q8_0 blocks):
// y[t, j] = sum_g s_w(j, g) * sx[t, g] * sum_{k in group g} q[t, k] * w[j, k], the inner sums exact int32.
// Each row's result is bit-identical whatever T is; across instruction-set families it agrees to
// rounding (the float sum over groups runs in the vector's lanes).
void ts_int8_rows(const int8_t* q, const float* sx, int64_t T, int64_t K, const int8_t* w, const float* scales,
                  int64_t G, float* y, int64_t N, int64_t j0, int64_t j1);

// The Q6_K kernel's activation offsets: off [T, K / 16] = 32 * sx[t, r / 2] * sum of q[t, k] over run r
// of 16 channels (the codes' bias of 32, subtracted once per run instead of per weight). K a multiple of 32.
void ts_q6k_offsets(const int8_t* q, const float* sx, int64_t T, int64_t K, float* off);

// y [T, N] fp32, output rows [j0, j1): the W6A8 product of the quantized activations (ts_quantize_rows:
// q [T, K], sx [T, K / 32]; ts_q6k_offsets: off [T, K / 16]) with a GGUF file's Q6_K blocks as stored,
// blocks [N, K / 256 * 210] uint8 (ggml's block_q6_K: ql [128], qh [64], int8 scales [16], fp16 d; K a
// multiple of 256): y[t, j] = sum over runs r of 16 weights of d * scale(r) * sx[t, r / 2] *
// sum_{k in r} (code_k - 32) q[t, k], the code x q sums exact int32. Each row's result is
// bit-identical whatever T is; across instruction-set families it agrees to rounding (the float sums
// run in the vector's lanes).
void ts_q6k_rows(const int8_t* q, const float* sx, const float* off, int64_t T, int64_t K, const uint8_t* blocks,
                 float* y, int64_t N, int64_t j0, int64_t j1);

// y [T, N] fp32, output rows [j0, j1): the W5A8 product of the quantized activations (ts_quantize_rows:
// q [T, K], sx and xs [T, K / 32]) with a GGUF file's Q5_0 blocks as stored, blocks [N, K / 32 * 22] uint8
// (ggml's block_q5_0: fp16 d, qh [4] fifth bits, qs [16] low nibbles; K a multiple of 32):
// y[t, j] = sum over groups g of 32 of d_g * (sx[t, g] * sum_{k in g} code_k q[t, k] - 16 xs[t, g]), the
// code x q sums exact int32. Each row's result is bit-identical whatever T is; across instruction-set
// families it agrees to rounding (the float sums run in the vector's lanes).
void ts_q5_0_rows(const int8_t* q, const float* sx, const float* xs, int64_t T, int64_t K, const uint8_t* blocks,
                  float* y, int64_t N, int64_t j0, int64_t j1);

// Attention of R query rows q [R, D] over one KV head's keys k and values v [>= start + T, D]:
// row r sees slots [0, start + r % T] (the cached prefix, then causal among T new tokens; r =
// head-in-group * T + token). scores [R, start + T] receives the softmax probabilities (0 past a
// row's visible slots), out [R, D] the weighted values, lse [R] (may be NULL) the log-sum-exp of
// the scaled scores. Rows go in tiles of 32: each key and value is read once per tile, and only up
// to the tile's last visible slot; a row's result does not depend on R.
void ts_attend(const float* q, int64_t R, int64_t T, int64_t start, const float* k, const float* v, int64_t D,
               float scale, float* scores, float* out, float* lse);

// ts_attend for rows [r0, r1) only (the arrays as there, indexed from row 0): calls over disjoint
// row ranges may run in parallel, and give the same results as one call over all rows.
void ts_attend_rows(const float* q, int64_t T, int64_t start, const float* k, const float* v, int64_t D, float scale,
                    float* scores, float* out, float* lse, int64_t r0, int64_t r1);

// ts_attend_rows over keys k and values v stored as IEEE half floats (binary16 bits, the CPU KV
// cache's format): read exactly as fp32, every computation as there, so the results equal
// ts_attend_rows over the same values widened to fp32, bit for bit.
void ts_attend_rows_half(const float* q, int64_t T, int64_t start, const uint16_t* k, const uint16_t* v, int64_t D,
                         float scale, float* scores, float* out, float* lse, int64_t r0, int64_t r1);

// y [n] = x [n] rounded to IEEE half floats (to nearest-even, as torch's .half()): a KV cache write.
void ts_to_half(const float* x, int64_t n, uint16_t* y);

#ifdef __cplusplus
}
#endif
