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

// ts_int4_rows with Q4_K's two-level scales as stored, exact (K a multiple of 256): scales [N / 16, K / 256, 320]
// bytes per output block and super-block, fp16 d [16] and -dmin [16], then per group of 32 the 6-bit sc [16] and
// m [16] as int8, for s = d sc and m = -dmin m (layout: tokenspeed.quant.Q4KInt4Linear.pack_super).
void ts_int4_super_rows(const int8_t* q, const float* sx, const float* xs, int64_t T, int64_t K, const uint8_t* codes,
                        const uint8_t* scales, float* y, int64_t N, int64_t nb0, int64_t nb1);

// Activations x [T, K] fp32 -> the int8 kernel's, for a weight of Kp >= K input channels (a multiple of 32;
// Kp - K < 32): per group of 32 (G = Kp / 32 per row; the last one shorter when K is not a multiple of 32),
// int8 codes q [T, Kp] (round(x * 127 / max|x|), zero past K), scale sx [T, G] (max|x| / 127) and the sum of
// the group's codes qsum [T, G] int32.
void ts_int8_quantize(const float* x, int64_t T, int64_t K, int64_t Kp, int8_t* q, float* sx, int32_t* qsum);

// y [T, N] fp32, output blocks [nb0, nb1) of 16 rows: the W8A8 product of the quantized activations
// (ts_int8_quantize: q [T, K], sx and qsum [T, K / 32]) with int8 weights interleaved by 16 output rows,
// w [N / 16, K / 4, 64] (byte 4 j + i of chunk c of block b: code[16 b + j, 4 c + i]; layout:
// tokenspeed.quant.pack_int8), and fp32 scales [N / 16, G, 16]: G = 1 one per row, or G = K / 32 one per 32
// input channels (a GGUF file's Q8_0 blocks); N a multiple of 16, K of 32:
// y[t, n] = sum_g s_w(n, g) * sx[t, g] * sum_{k in group g} q[t, k] * w[n, k], the inner sums exact int32.
// Each row's result is bit-identical whatever T is, and across instruction-set families.
void ts_int8_rows(const int8_t* q, const float* sx, const int32_t* qsum, int64_t T, int64_t K, const int8_t* w,
                  const float* scales, int64_t G, float* y, int64_t N, int64_t nb0, int64_t nb1);

// y [T, N] fp32, output blocks [nb0, nb1) of 16 rows: the product of the quantized activations (ts_int8_quantize
// with Kp = K) with a GGUF file's Q5_0 blocks (ggml's block_q5_0: d fp16, 32 codes 0..31, w = d (code - 16))
// interleaved by 16 output rows, blocks [N / 16, K / 32, 352] uint8 (layout: tokenspeed.quant.pack_q5_0; per
// block of rows and group of 32 input channels: the low 4 bits, 256 bytes, the fifth bits, 16 uint32, and d, 16
// fp16); N a multiple of 16, K of 32: y[t, n] = sum_g d(n, g) * sx[t, g] * (sum_{k in g} code[n, k] q[t, k] -
// 16 qsum[t, g]), the inner sums exact int32. Each row's result is bit-identical whatever T is, and across
// instruction-set families.
void ts_q5_0_rows(const int8_t* q, const float* sx, const int32_t* qsum, int64_t T, int64_t K, const uint8_t* blocks,
                  float* y, int64_t N, int64_t nb0, int64_t nb1);

// GGUF block formats the kernels run as stored, by ggml type number (ggml.h's enum ggml_type); Q5_0 runs
// interleaved (ts_q5_0_rows).
enum { TS_Q4_K = 12, TS_Q5_K = 13, TS_Q6_K = 14 };

// The geometry of block format `format`: values (weights) and bytes per block, input channels per
// activation scale and per activation sum of ts_block_quantize. Returns 0 (and writes nothing) for a
// format the kernels do not run.
//   Q4_K: 256 in 144 (fp16 d, dmin, 12 bytes of 6-bit sub-block scales sc and minimums m, qs [128]),
//         w = d sc code - dmin m per sub-block of 32, codes 0..15
//   Q5_K: 256 in 176 (as Q4_K, with qh [32] fifth bits before qs), codes 0..31
//   Q6_K: 256 in 210 (ql [128], qh [64], int8 scales [16] per 16 weights, fp16 d), w = d scale (code - 32)
// (ggml's block_q4_K, block_q5_K, block_q6_K; ggml-quants.c's dequantize_row_*).
int ts_block_format(int64_t format, int64_t* values, int64_t* bytes, int64_t* act_group, int64_t* aux_run);

// Activations x [T, K] fp32 quantized for block format `format`'s kernel: as ts_quantize_rows per group of
// act_group input channels (256, llama.cpp's Q8_K), q [T, K], sx [T, K / act_group], and aux [T, K / aux_run],
// the sums of q over each run of aux_run input channels (Q6_K: times 32 sx, the codes' bias). K a multiple of the format's block values.
void ts_block_quantize(int64_t format, const float* x, int64_t T, int64_t K, int8_t* q, float* sx, float* aux);

// y [T, N] fp32, output rows [j0, j1): the product of the quantized activations (ts_block_quantize: q, sx,
// aux) with a GGUF file's blocks as stored, blocks [N, K / values * bytes]
// uint8 (row j: its K / values blocks): y[t, j] = sum over blocks (or sub-blocks, runs) of the weights'
// scale * sx[t, group] * sum_k code_k q[t, k], minus the codes' bias or minimums times aux; the code x q
// sums exact int32. Each row's result is bit-identical whatever T is; across instruction-set families it
// agrees to rounding (the float sums run in the vector's lanes).
void ts_block_rows(int64_t format, const int8_t* q, const float* sx, const float* aux, int64_t T, int64_t K,
                   const uint8_t* blocks, float* y, int64_t N, int64_t j0, int64_t j1);

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

// out [T, F] = silu(gate) * up for gu [T, 2F] (row t: gate [F], then up [F]; the fused gate and up
// projection's output), silu(g) = g / (1 + e^-g): the SwiGLU MLP's activation (Shazeer 2020, "GLU
// Variants Improve Transformer"). Elementwise; agrees with the exact function to a few ulp of fp32 on
// every family.
void ts_swiglu(const float* gu, int64_t T, int64_t F, float* out);

#ifdef __cplusplus
}
#endif
