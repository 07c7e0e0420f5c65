// The numerical core of the fused CPU decode step (contract: cpu_kernels.h), written once over
// the ISA layer of cpu_isa.h and compiled per instruction-set family. No torch: the kernel
// harness builds it alone.
#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "cpu_isa.h"

namespace ts {
namespace {

using namespace isa;

constexpr int64_t kQGroup = 32;
constexpr int64_t kAttendTile = 32;  // query rows per attention tile (ts_attend_rows)

// Calls f(std::integral_constant<int, n>) for 1 <= n <= M: runtime row counts to the
// compile-time ones the register-blocked kernels take.
template <int M, typename F>
inline void with_rows(int n, F&& f) {
  if constexpr (M > 1) {
    if (n < M) return with_rows<M - 1>(n, f);
  }
  f(std::integral_constant<int, M>{});
}

// KV cache elements: fp32, or IEEE half as raw bits (uint16_t); the kernels read both as fp32.
inline vf load_kv(const float* p) { return load(p); }
inline vf load_kv(const uint16_t* p) { return load_half(p); }
inline float kv_float(float x) { return x; }
inline float kv_float(uint16_t h) { return half_to_float(h); }

template <typename KV>
inline float dot(const float* a, const KV* b, int64_t n) {
  int64_t i = 0;
  float acc = 0.f;
  if constexpr (kW > 1) {
    vf v = zero();
    for (; i + kW <= n; i += kW) v = fmadd(load(a + i), load_kv(b + i), v);
    acc = reduce_add(v);
  }
  for (; i < n; ++i) acc = std::fma(a[i], kv_float(b[i]), acc);  // explicit: fp32 and half contract alike
  return acc;
}

// Register blocks of the attention kernels (rows x vectors of accumulators that fit the registers).
constexpr int kScoreRows = std::clamp((kRegs - 4) / 5, 1, 4);  // query rows per block of 4 keys
constexpr int kSumRows = 4;                                    // probability rows per block of values
constexpr int kSumVecs = kRegs >= 32 ? 4 : 2;                  // value vectors per block (of a row's C)

// s[r, j .. j + 4) = q_r . k_{j .. j + 4) for RB rows q [RB, kW C] (row stride kW C) and 4 keys k
// [4, kW C] (fp32 or half, see load_kv): lane-wise fused multiply-adds over the C vectors, then
// one lane of `hsum4` per key, so a row's scores do not depend on the rows beside it.
template <int C, int RB, typename KV>
inline void scores_block(const float* q, const KV* k, float* s, int64_t ld) {
  constexpr int64_t D = kW * C;
  vf p[RB][4];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < 4; ++i) p[r][i] = zero();
  for (int c = 0; c < C; ++c) {
    vf qc[RB];
    for (int r = 0; r < RB; ++r) qc[r] = load(q + r * D + kW * c);
    for (int i = 0; i < 4; ++i) {
      const vf kc = load_kv(k + i * D + kW * c);
      for (int r = 0; r < RB; ++r) p[r][i] = fmadd(qc[r], kc, p[r][i]);
    }
  }
  for (int r = 0; r < RB; ++r) hsum4(p[r][0], p[r][1], p[r][2], p[r][3], s + r * ld);
}

// s[r, j] = q_r . k_j for R query rows q [R, kW C] and the n keys k [n, kW C]; row r of s starts
// at s + r * ld. Each block of 4 keys is read once for all R rows (L1-resident meanwhile); every
// score is one lane of `hsum4` wherever it falls, so a row's scores depend neither on R nor on n.
template <int C, typename KV>
void scores_rows(const float* q, int64_t R, const KV* k, float* s, int64_t ld, int64_t n) {
  constexpr int64_t D = kW * C;
  constexpr int RB = kScoreRows;
  const vf z = zero();
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    int64_t r = 0;
    for (; r + RB <= R; r += RB) scores_block<C, RB, KV>(q + r * D, k + j * D, s + r * ld + j, ld);
    if (r < R)
      with_rows<RB>(static_cast<int>(R - r),
                    [&](auto rr) { scores_block<C, decltype(rr)::value, KV>(q + r * D, k + j * D, s + r * ld + j, ld); });
  }
  for (; j < n; ++j)
    for (int64_t r = 0; r < R; ++r) {
      vf p = z;
      for (int c = 0; c < C; ++c) p = fmadd(load(q + r * D + kW * c), load_kv(k + j * D + kW * c), p);
      float out[4];
      hsum4(p, z, z, z, out);
      s[r * ld + j] = out[0];
    }
}

// o[r, vectors c0 .. c0 + CC) (+)= sum_{j0 <= j < j1} p[r, j] v_j for RB rows of weights p (row
// stride ld) and values v [n, kW C] (row stride kW C); first: start from zero instead of o. Each
// value vector is loaded once for the RB rows; j ascends, so the sum is the same whatever the
// blocking: one chain of fused multiply-adds per output lane, from j = 0 up.
template <int C, int RB, int CC, typename KV>
void weighted_block(const float* p, int64_t ld, const KV* v, float* o, int64_t j0, int64_t j1, int c0, bool first) {
  constexpr int64_t D = kW * C;
  vf acc[RB][CC];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CC; ++c) acc[r][c] = first ? zero() : load(o + r * D + (c0 + c) * kW);
  for (int64_t j = j0; j < j1; ++j) {
    vf pj[RB];
    for (int r = 0; r < RB; ++r) pj[r] = set1(p[r * ld + j]);
    for (int c = 0; c < CC; ++c) {
      const vf vj = load_kv(v + j * D + (c0 + c) * kW);
      for (int r = 0; r < RB; ++r) acc[r][c] = fmadd(pj[r], vj, acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CC; ++c) store(o + r * D + (c0 + c) * kW, acc[r][c]);
}

// o [R, kW C] = p [R, ld] v over the first n values v [n, kW C], in tiles of keys whose values
// (~16 KB) stay in L1 while every row block and value-vector block of the R rows uses them: the
// values are read from memory once per call, however many rows. Results as `weighted_block`'s.
template <int C, typename KV>
void weighted_rows(const float* p, int64_t R, int64_t ld, const KV* v, float* o, int64_t n) {
  constexpr int64_t D = kW * C;
  constexpr int RB = kSumRows, CC = std::min(C, kSumVecs);
  static_assert(C % CC == 0, "value vectors per block must divide the row");
  constexpr int64_t JT = std::max<int64_t>(16, 4096 / D);  // keys per tile
  if (n <= 0) {
    std::fill(o, o + R * D, 0.f);
    return;
  }
  for (int64_t j0 = 0; j0 < n; j0 += JT) {
    const int64_t j1 = std::min(n, j0 + JT);
    const bool first = j0 == 0;
    int64_t r = 0;
    for (; r + RB <= R; r += RB)
      for (int c0 = 0; c0 < C; c0 += CC) weighted_block<C, RB, CC, KV>(p + r * ld, ld, v, o + r * D, j0, j1, c0, first);
    if (r < R)
      with_rows<RB>(static_cast<int>(R - r), [&](auto rr) {
        for (int c0 = 0; c0 < C; c0 += CC)
          weighted_block<C, decltype(rr)::value, CC, KV>(p + r * ld, ld, v, o + r * D, j0, j1, c0, first);
      });
  }
}

// s [R, ld] = q [R, D] k^T over the first n keys k [n, D].
template <typename KV>
void scores_of(const float* q, int64_t R, const KV* k, float* s, int64_t ld, int64_t n, int64_t D) {
  switch (D) {
    case 16: return scores_rows<16 / kW, KV>(q, R, k, s, ld, n);
    case 32: return scores_rows<32 / kW, KV>(q, R, k, s, ld, n);
    case 64: return scores_rows<64 / kW, KV>(q, R, k, s, ld, n);
    case 128: return scores_rows<128 / kW, KV>(q, R, k, s, ld, n);
    default: break;
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < n; ++j) s[r * ld + j] = dot(q + r * D, k + j * D, D);
}

// o [R, D] = p [R, ld] v over the first n values v [n, D].
template <typename KV>
void weighted_sum_of(const float* p, int64_t R, int64_t ld, const KV* v, float* o, int64_t n, int64_t D) {
  switch (D) {
    case 16: return weighted_rows<16 / kW, KV>(p, R, ld, v, o, n);
    case 32: return weighted_rows<32 / kW, KV>(p, R, ld, v, o, n);
    case 64: return weighted_rows<64 / kW, KV>(p, R, ld, v, o, n);
    case 128: return weighted_rows<128 / kW, KV>(p, R, ld, v, o, n);
    default: break;
  }
  std::fill(o, o + R * D, 0.f);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < n; ++j) {
      const float a = p[r * ld + j];
      for (int64_t i = 0; i < D; ++i) o[r * D + i] = std::fma(a, kv_float(v[j * D + i]), o[r * D + i]);
    }
}

// ---- int8 weights x int8 activations (W8A8, the Q8_0 x Q8_0 scheme of GGML/llama.cpp)
//
// Weight rows as stored, w [N, K] int8 row-major (a GGUF file's Q8_0 codes; the same tensor a tied
// lm_head shares with the embedding's row lookups), scales [N, G] fp32: G = 1 one per row, G = K / 32
// one per Q8_0 block. Activations quantized per group of 32 (ts_quantize_rows: q, sx; the last group
// may be shorter when K is not a multiple of 32).
// y[t, j] = sum_g (s_w(j, g) * sx[t, g]) * sum_{k in g} w[j, k] q[t, k], the inner sums exact int32
// (dot4s), the outer ones fused multiply-adds per lane in ascending g, then one horizontal sum: a
// row's result is its own data's alone, whatever the tile and T (verification == plain decoding, bit
// for bit).
//
// Register tiles of RM weight rows x RN token rows (llamafile's tinyBLAS blocks its Q8_0 GEMM the
// same way): per group of 32, RM weight vectors and RN activation vectors are loaded once for RM * RN
// dot products. Bursts take kInt8Tokens token rows per tile and kInt8Accs / RN weight rows (1 to 4:
// RM * RN fp32 accumulators, and as many int32 ones where a group takes several dot4s, beside the
// weight vectors within the kRegs vector registers); a decode step (RN = 1) streams one weight row at
// a time. Measured on avx2 (16 registers; a dot4s is 3 integer ops whose operands stay live): 1 x 6
// fastest for bursts (0.92x the time of the old 1 x 4 blocks at 84 rows), 2 or 3 weight rows per tile
// spill; for a decode step, 4 weight rows per tile ranged from 0.72x (K = 8960) to 1.35x (K = 1536).
constexpr int kGroupDots = kQGroup / kGroupBytes;  // dot4s per group of 32
constexpr int kInt8Accs = kRegs >= 32 ? (kGroupDots > 1 ? 8 : 16) : 3;
constexpr int kInt8Tokens = kRegs >= 32 ? 4 : 6;
constexpr int64_t kInt8Panel = 12;  // weight rows per panel: every tile height (1 to 4) divides it

constexpr int int8_tile_rows(int rn) { return rn == 1 ? 1 : std::clamp(kInt8Accs / rn, 1, 4); }

// y[t0 .. t0 + RN, j0 .. j1) (row stride N), j1 - j0 a multiple of RM: one tile per RM rows.
template <int RM, int RN, bool kGroupScales>
void int8_tiles(const int8_t* q, const float* sx, int64_t t0, int64_t K, const int8_t* w, const float* scales,
                int64_t G, float* y, int64_t N, int64_t j0, int64_t j1) {
  const int64_t full = K / kQGroup, groups = (K + kQGroup - 1) / kQGroup;
  const int8_t* qt = q + t0 * K;
  const float* st = sx + t0 * groups;
  for (int64_t j = j0; j < j1; j += RM) {
    const int8_t* wr = w + j * K;
    vf acc[RM][RN];
    for (int r = 0; r < RM; ++r)
      for (int t = 0; t < RN; ++t) acc[r][t] = zero();
    for (int64_t g = 0; g < full; ++g) {
      vi d[RM][RN];
      for (int r = 0; r < RM; ++r)
        for (int t = 0; t < RN; ++t) d[r][t] = izero();
      for (int64_t k = g * kQGroup; k < (g + 1) * kQGroup; k += kGroupBytes) {
        vi wv[RM];
        for (int r = 0; r < RM; ++r) wv[r] = iload_s8(wr + r * K + k);
        for (int t = 0; t < RN; ++t) {
          const vi qv = iload_s8(qt + t * K + k);
          for (int r = 0; r < RM; ++r) d[r][t] = dot4s(d[r][t], wv[r], qv);
        }
      }
      // the scale of output (r, t): sw[r] * sx[t], a broadcast product (the same bits as the scalar one)
      vf sw[RM];
      for (int r = 0; r < RM; ++r) sw[r] = set1(scales[(j + r) * G + (kGroupScales ? g : 0)]);
      for (int t = 0; t < RN; ++t) {
        const vf s = set1(st[t * groups + g]);
        for (int r = 0; r < RM; ++r) acc[r][t] = fmadd(to_float(d[r][t]), mul(sw[r], s), acc[r][t]);
      }
    }
    for (int r = 0; r < RM; ++r)
      for (int t = 0; t < RN; ++t) {
        float a = reduce_add(acc[r][t]);
        if (full < groups) {  // a shorter last group (G = 1 only: K / G groups are whole)
          int32_t d = 0;
          for (int64_t k = full * kQGroup; k < K; ++k) d += static_cast<int32_t>(wr[r * K + k]) * qt[t * K + k];
          a += static_cast<float>(d) * (scales[(j + r) * G] * st[t * groups + full]);
        }
        y[(t0 + t) * N + j + r] = a;
      }
  }
}

// Token rows t0 .. t0 + RN of output rows [j0, j1), in tiles of int8_tile_rows(RN) weight rows.
template <int RN>
void int8_panel(const int8_t* q, const float* sx, int64_t t0, int64_t K, const int8_t* w, const float* scales,
                int64_t G, float* y, int64_t N, int64_t j0, int64_t j1) {
  constexpr int RM = int8_tile_rows(RN);
  const auto tiles = [&](auto rm, int64_t a, int64_t b) {
    if (G == 1)
      int8_tiles<decltype(rm)::value, RN, false>(q, sx, t0, K, w, scales, G, y, N, a, b);
    else
      int8_tiles<decltype(rm)::value, RN, true>(q, sx, t0, K, w, scales, G, y, N, a, b);
  };
  const int64_t j = j0 + (j1 - j0) / RM * RM;
  if (j > j0) tiles(std::integral_constant<int, RM>{}, j0, j);
  if (j < j1) with_rows<RM>(static_cast<int>(j1 - j), [&](auto rm) { tiles(rm, j, j1); });
}

// ---- Q6_K weights x int8 activations (W6A8: ggml's Q6_K blocks as stored x Q8 activations per 32)
//
// A Q6_K block holds 256 weights in 210 bytes: ql [128] (low 4 bits), qh [64] (high 2 bits), scales
// [16] int8 (one per 16 weights), d fp16; weight i = d * scales[i / 16] * (code_i - 32), code_i =
// (ql[64 h + l] >> 4 (c / 2) & 15) | (qh[32 h + l'] >> 2 c & 3) << 4 for i = 128 h + 32 c + l',
// l = 32 (c % 2) + l' (ggml's dequantize_row_q6_K; gguf.quants.Q6_K).
constexpr int64_t kQ6Block = 256, kQ6Bytes = 210, kQ6Run = 16;

// One block b [210] -> its codes u [256] (0..63) and the scale of each run of 16 weights, fs [16]
// (d * scales[i]): plain loops the compiler vectorises.
inline void q6k_unpack(const uint8_t* b, uint8_t* u, float* fs) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_to_float(static_cast<uint16_t>(b[208] | b[209] << 8));
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < 4; ++c) {
      const uint8_t* lo = ql + 64 * h + 32 * (c & 1);
      const int shift = 4 * (c >> 1);
      uint8_t* out = u + 128 * h + 32 * c;
      for (int l = 0; l < 32; ++l) out[l] = ((lo[l] >> shift) & 15) | ((qh[32 * h + l] >> (2 * c)) & 3) << 4;
    }
  const vf vd = set1(d);
  for (int i = 0; i < kQ6Block / kQ6Run; i += kW) store(fs + i, mul(vd, load_s8(sc + i)));
}

// Rows t0 .. t0 + TT of y for output rows [j0, j1) of Q6_K weights (row j: K / 256 blocks of 210
// bytes at blocks + j * K / 256 * 210) and activations quantized per group of 32 (ts_quantize_rows),
// with off [T, K / 16] = 32 * sx[t, group(run)] * sum_{k in run} q[t, k] per run of 16 (q6k_offsets):
// y[t, j] = sum over 4-byte lanes c of (d scale(c) * sx[t, group(c)]) * sum_{k in c} code[j, k] q[t, k]
//           - sum over runs r of d scale(r) * off[t, r],
// the lane sums exact int32 (dot4 of the unsigned codes; a lane never straddles a run of 16, lane_scales
// gives its scale), the float sums fused multiply-adds per lane in ascending k, then one horizontal sum:
// a row's result is its own data's alone, whatever TT and T. Each block is unpacked once for the TT rows.
template <int TT>
void q6k_block(const int8_t* q, const float* sx, const float* off, int64_t t0, int64_t K, const uint8_t* blocks,
               float* y, int64_t N, int64_t j0, int64_t j1) {
  const int64_t nb = K / kQ6Block, groups = K / kQGroup, runs = K / kQ6Run;
  alignas(64) uint8_t u[kQ6Block + 64];  // + 64: avx512's iload reads 64 bytes (the dot uses 32)
  alignas(64) float fs[kQ6Block / kQ6Run + 1];  // + 1: lane_scales reads two
  fs[kQ6Block / kQ6Run] = 0.f;
  for (int64_t j = j0; j < j1; ++j) {
    vf acc[TT], neg[TT];
    for (int t = 0; t < TT; ++t) acc[t] = neg[t] = zero();
    for (int64_t b = 0; b < nb; ++b) {
      q6k_unpack(blocks + (j * nb + b) * kQ6Bytes, u, fs);
      for (int64_t k = 0; k < kQ6Block; k += kGroupBytes) {
        const vi uv = iload(u + k);
        const vf s = lane_scales(fs + k / kQ6Run);
        const int64_t at = b * kQ6Block + k, g = at / kQGroup;
        for (int t = 0; t < TT; ++t) {
          const vi d = dsum(dot4(izero(), uv, iload_s8(q + (t0 + t) * K + at)));
          acc[t] = fmadd(to_float(d), mul(s, set1(sx[(t0 + t) * groups + g])), acc[t]);
        }
      }
      for (int64_t r = 0; r < kQ6Block / kQ6Run; r += kW)
        for (int t = 0; t < TT; ++t) neg[t] = fmadd(load(fs + r), load(off + (t0 + t) * runs + b * 16 + r), neg[t]);
    }
    for (int t = 0; t < TT; ++t) y[(t0 + t) * N + j] = reduce_add(sub(acc[t], neg[t]));
  }
}

// ---- Q5_0 weights x int8 activations (W5A8: ggml's Q5_0 blocks as stored x Q8 activations per 32)
//
// A Q5_0 block holds 32 weights in 22 bytes: d fp16, qh [4] (bit i of the little-endian uint32: weight
// i's fifth bit), qs [16] (weight l's low 4 bits in qs[l]'s low nibble, weight 16 + l's in its high
// nibble); weight i = d * (code_i - 16), codes 0..31 (ggml's dequantize_row_q5_0; gguf.quants.Q5_0).
// A block is exactly one group of the activations' quantization.
constexpr int64_t kQ5Bytes = 22;

// Rows t0 .. t0 + TT of y for output rows [j0, j1) of Q5_0 weights (row j: K / 32 blocks of 22 bytes
// at blocks + j * K / 32 * 22) and activations quantized per group of 32 (ts_quantize_rows: q, sx and
// xs = sx * sum of the group's q):
// y[t, j] = sum over groups g of d_g * (sx[t, g] * sum_{k in g} code[j, k] q[t, k] - 16 xs[t, g]),
// the code x q sums exact int32 (dot4 of the unsigned codes; the bias of 16 subtracted once per group
// through xs), the first term's float sums fused multiply-adds per lane in ascending g, then one
// horizontal sum; the second a scalar fused multiply-add chain in ascending g: a row's result is its
// own data's alone, whatever TT and T. Each block's codes (q5_codes) are formed once for the TT rows.
template <int TT>
void q5_0_block(const int8_t* q, const float* sx, const float* xs, int64_t t0, int64_t K, const uint8_t* blocks,
                float* y, int64_t N, int64_t j0, int64_t j1) {
  const int64_t nb = K / kQGroup;
  for (int64_t j = j0; j < j1; ++j) {
    vf acc[TT];
    float neg[TT];
    for (int t = 0; t < TT; ++t) acc[t] = zero(), neg[t] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = blocks + (j * nb + b) * kQ5Bytes;
      const float d = half_to_float(static_cast<uint16_t>(blk[0] | blk[1] << 8));
      const uint32_t qh = static_cast<uint32_t>(load_i32(blk + 2));
      for (int k = 0; k < kQGroup; k += kGroupBytes) {
        const vi uv = q5_codes(blk + 6, qh, k);
        for (int t = 0; t < TT; ++t) {
          const vi s = dsum(dot4(izero(), uv, iload_s8(q + (t0 + t) * K + b * kQGroup + k)));
          acc[t] = fmadd(to_float(s), set1(d * sx[(t0 + t) * nb + b]), acc[t]);
        }
      }
      for (int t = 0; t < TT; ++t) neg[t] = std::fma(d, xs[(t0 + t) * nb + b], neg[t]);
    }
    for (int t = 0; t < TT; ++t) y[(t0 + t) * N + j] = reduce_add(acc[t]) - 16.f * neg[t];
  }
}

// ---- int4 weights x int8 activations (W4A8, the Q4_1 x Q8_1 scheme of GGML/llama.cpp)
//
// Weight: 4-bit codes c in 0..15 per group of 32 input channels, w[n, k] = c * s[n, g] + m[n, g].
// Codes [N / 16, K / 8, 64]: for output block nb (16 channels, one per 32-bit lane) and input
// octet o, lane j's 4 bytes hold channel nb * 16 + j's codes k = 8o + b in the low nibble and
// k = 8o + 4 + b in the high nibble (b = 0..3). Scales [N / 16, K / 32, 2, 16] bf16: s then m.
// y[t, n] = sum_g s[n, g] * sx[t, g] * sum_k c * q + m[n, g] * sx[t, g] * sum_k q: the inner sums
// are exact int32 (dot4: 4 byte products per lane, dsum per group) and the float accumulation runs in a fixed
// order per lane, so a row's result depends neither on how many rows share the call
// (speculative verification == plain decoding, bit for bit) nor on the vector width.
template <int TT>
void int4_block(const int8_t* q, const float* sx, const float* xs, int64_t t0, int64_t K, const uint8_t* codes,
                const uint16_t* sm, float* y, int64_t N, int64_t nb0, int64_t nb1) {
  const int64_t G = K / kQGroup, O = K / 8;
  for (int64_t nb = nb0; nb < nb1; ++nb)
    for (int p = 0; p < 16 / kI; ++p) {  // kI of the block's 16 output channels
      vf acc[TT];
      for (int t = 0; t < TT; ++t) acc[t] = zero();
      const uint8_t* cb = codes + nb * O * 64 + p * 4 * kI;
      const uint16_t* sb = sm + nb * G * 32 + p * kI;
      for (int64_t g = 0; g < G; ++g) {
        vi dot[TT];
        for (int t = 0; t < TT; ++t) dot[t] = izero();
        for (int64_t o = 0; o < kQGroup / 8; ++o) {
          const vi v = iload(cb + (g * (kQGroup / 8) + o) * 64);
          const vi lo = nibbles_lo(v), hi = nibbles_hi(v);
          const int8_t* qk = q + t0 * K + g * kQGroup + o * 8;
          for (int t = 0; t < TT; ++t)
            dot[t] = dot4(dot4(dot[t], lo, bcast4(load_i32(qk + t * K))), hi, bcast4(load_i32(qk + t * K + 4)));
        }
        const vf s = load_bf16(sb + g * 32), m = load_bf16(sb + g * 32 + 16);
        for (int t = 0; t < TT; ++t) {
          const int64_t i = (t0 + t) * G + g;
          acc[t] = fmadd(to_float(dsum(dot[t])), mul(s, set1(sx[i])), acc[t]);
          acc[t] = fmadd(m, set1(xs[i]), acc[t]);
        }
      }
      for (int t = 0; t < TT; ++t) store(y + (t0 + t) * N + nb * 16 + p * kI, acc[t]);
    }
}

// s [n] (raw scores) -> softmax(scale * s) in place; returns the log-sum-exp of scale * s.
float softmax_row(float* s, int64_t n, float scale) {
  float m = -INFINITY, sum = 0.f;
  int64_t j = 0;
  if constexpr (kW > 1) {
    vf vm = set1(-INFINITY), vs = zero();
    const vf vscale = set1(scale);
    for (; j + kW <= n; j += kW) {
      const vf x = mul(load(s + j), vscale);
      store(s + j, x);
      vm = max(vm, x);
    }
    m = reduce_max(vm);
    for (int64_t i = j; i < n; ++i) { s[i] *= scale; m = std::max(m, s[i]); }
    const vf vmax = set1(m);
    for (j = 0; j + kW <= n; j += kW) {
      const vf e = exp_neg(sub(load(s + j), vmax));
      store(s + j, e);
      vs = add(vs, e);
    }
    sum = reduce_add(vs);
  } else {
    for (; j < n; ++j) { s[j] *= scale; m = std::max(m, s[j]); }
    j = 0;
  }
  for (; j < n; ++j) { s[j] = std::exp(s[j] - m); sum += s[j]; }
  const float inv = 1.f / sum;
  for (j = 0; j < n; ++j) s[j] *= inv;
  return m + std::log(sum);
}

// ts_attend_rows over fp32 or half keys and values (see cpu_kernels.h).
template <typename KV>
void attend_rows(const float* q, int64_t T, int64_t start, const KV* k, const KV* v, int64_t D, float scale, float* scores,
                 float* out, float* lse, int64_t r0, int64_t r1) {
  const int64_t end = start + T;
  // Tiles of kAttendTile rows: each key and value is read once per tile (scores and
  // probabilities of the tile stay in L2), and only up to the tile's last visible slot; a row's
  // result depends neither on the tile nor on R (see scores_rows and weighted_rows).
  for (int64_t a = r0; a < r1; a += kAttendTile) {
    const int64_t b = std::min(r1, a + kAttendTile);
    int64_t n = 0;
    for (int64_t r = a; r < b; ++r) n = std::max(n, start + r % T + 1);
    scores_of(q + a * D, b - a, k, scores + a * end, end, n, D);
    for (int64_t r = a; r < b; ++r) {
      const int64_t visible = start + r % T + 1;
      float* srow = scores + r * end;
      const float row_lse = softmax_row(srow, visible, scale);
      std::fill(srow + visible, srow + end, 0.f);
      if (lse != nullptr) lse[r] = row_lse;
    }
    weighted_sum_of(scores + a * end, b - a, end, v, out + a * D, n, D);
  }
}

}  // namespace
}  // namespace ts

extern "C" {

const char* ts_isa_name(void) { return ts::isa::kName; }

void ts_quantize_rows(const float* x, int64_t T, int64_t K, int8_t* q, float* sx, float* xs) {
  const int64_t G = (K + ts::kQGroup - 1) / ts::kQGroup;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t n = std::min(ts::kQGroup, K - g * ts::kQGroup);
      const float* xg = x + t * K + g * ts::kQGroup;
      int8_t* qg = q + t * K + g * ts::kQGroup;
      float amax = 0.f;
      for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(xg[i]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        qg[i] = static_cast<int8_t>(std::nearbyint(xg[i] * inv));
        sum += qg[i];
      }
      sx[t * G + g] = amax / 127.f;
      if (xs != nullptr) xs[t * G + g] = sx[t * G + g] * static_cast<float>(sum);
    }
}

void ts_int4_rows(const int8_t* q, const float* sx, const float* xs, int64_t T, int64_t K, const uint8_t* codes,
                  const uint16_t* scales, float* y, int64_t N, int64_t nb0, int64_t nb1) {
  constexpr int M = ts::isa::kMaxRows;
  int64_t t0 = 0;
  for (; t0 + M <= T; t0 += M) ts::int4_block<M>(q, sx, xs, t0, K, codes, scales, y, N, nb0, nb1);
  if (t0 < T)
    ts::with_rows<M>(static_cast<int>(T - t0),
                     [&](auto tt) { ts::int4_block<decltype(tt)::value>(q, sx, xs, t0, K, codes, scales, y, N, nb0, nb1); });
}

void ts_int8_rows(const int8_t* q, const float* sx, int64_t T, int64_t K, const int8_t* w, const float* scales,
                  int64_t G, float* y, int64_t N, int64_t j0, int64_t j1) {
  // panels of kInt8Panel weight rows (L1/L2-resident) under every token tile in turn: the weights
  // stream from memory once per call, however many tokens
  constexpr int RN = ts::kInt8Tokens;
  const int64_t panel = T < RN ? j1 - j0 : ts::kInt8Panel;  // one token tile: no panels needed
  for (int64_t p0 = j0; p0 < j1; p0 += panel) {
    const int64_t p1 = std::min(j1, p0 + panel);
    int64_t t0 = 0;
    for (; t0 + RN <= T; t0 += RN) ts::int8_panel<RN>(q, sx, t0, K, w, scales, G, y, N, p0, p1);
    if (t0 < T)
      ts::with_rows<RN>(static_cast<int>(T - t0), [&](auto rn) {
        ts::int8_panel<decltype(rn)::value>(q, sx, t0, K, w, scales, G, y, N, p0, p1);
      });
  }
}

void ts_q6k_offsets(const int8_t* q, const float* sx, int64_t T, int64_t K, float* off) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r = 0; r < K / ts::kQ6Run; ++r) {
      int32_t sum = 0;
      for (int64_t k = r * ts::kQ6Run; k < (r + 1) * ts::kQ6Run; ++k) sum += q[t * K + k];
      off[t * (K / ts::kQ6Run) + r] = 32.f * sx[t * (K / ts::kQGroup) + r * ts::kQ6Run / ts::kQGroup] * static_cast<float>(sum);
    }
}

void ts_q6k_rows(const int8_t* q, const float* sx, const float* off, int64_t T, int64_t K, const uint8_t* blocks,
                 float* y, int64_t N, int64_t j0, int64_t j1) {
  constexpr int M = ts::isa::kMaxRows;
  int64_t t0 = 0;
  for (; t0 + M <= T; t0 += M) ts::q6k_block<M>(q, sx, off, t0, K, blocks, y, N, j0, j1);
  if (t0 < T)
    ts::with_rows<M>(static_cast<int>(T - t0),
                     [&](auto tt) { ts::q6k_block<decltype(tt)::value>(q, sx, off, t0, K, blocks, y, N, j0, j1); });
}

void ts_q5_0_rows(const int8_t* q, const float* sx, const float* xs, int64_t T, int64_t K, const uint8_t* blocks,
                  float* y, int64_t N, int64_t j0, int64_t j1) {
  constexpr int M = ts::isa::kMaxRows;
  int64_t t0 = 0;
  for (; t0 + M <= T; t0 += M) ts::q5_0_block<M>(q, sx, xs, t0, K, blocks, y, N, j0, j1);
  if (t0 < T)
    ts::with_rows<M>(static_cast<int>(T - t0),
                     [&](auto tt) { ts::q5_0_block<decltype(tt)::value>(q, sx, xs, t0, K, blocks, y, N, j0, j1); });
}

void ts_attend_rows(const float* q, int64_t T, int64_t start, const float* k, const float* v, int64_t D, float scale,
                    float* scores, float* out, float* lse, int64_t r0, int64_t r1) {
  ts::attend_rows(q, T, start, k, v, D, scale, scores, out, lse, r0, r1);
}

void ts_attend_rows_half(const float* q, int64_t T, int64_t start, const uint16_t* k, const uint16_t* v, int64_t D,
                         float scale, float* scores, float* out, float* lse, int64_t r0, int64_t r1) {
  ts::attend_rows(q, T, start, k, v, D, scale, scores, out, lse, r0, r1);
}

void ts_to_half(const float* x, int64_t n, uint16_t* y) {
  int64_t i = 0;
  for (; i + ts::isa::kW <= n; i += ts::isa::kW) ts::isa::store_half(y + i, ts::isa::load(x + i));
  for (; i < n; ++i) y[i] = ts::isa::half_from_float(x[i]);
}

void ts_attend(const float* q, int64_t R, int64_t T, int64_t start, const float* k, const float* v, int64_t D,
               float scale, float* scores, float* out, float* lse) {
  ts_attend_rows(q, T, start, k, v, D, scale, scores, out, lse, 0, R);
}

}  // extern "C"
