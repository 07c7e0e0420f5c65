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

// The W4A8 kernel prefetches its weight streams into L2 this many bytes of codes ahead where the family's
// kPrefetchInt4 says so (cpu_isa.h: avx2, whose decode step waited on memory with the hardware prefetchers
// alone; README, "bench scale"). The other weight kernels measured no gain or a loss with it.
constexpr int64_t kPrefetchAhead = 8192;

// Prefetches into L2 the 64-byte lines of [p + ahead, p + ahead + bytes): a hint, which never faults, so the
// address is formed as an integer (it may lie past the end of the buffer).
inline void prefetch_ahead(const void* p, int64_t bytes, int64_t ahead = kPrefetchAhead) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(ahead);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(reinterpret_cast<const void*>(a + i), 0, 2);
}

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
// probability rows and value vectors (of a row's C) per block of values: kSumRows x kSumVecs accumulators, kSumRows
// broadcast probabilities and a value vector. avx2 (16 registers), one thread, 6 and 7 rows over 4,096 half keys
// and values of 128 and 64 dims (1.5b's and 0.5b's groups): 3 x 4 took 0.6-0.8x the time of 4 x 2 (4 x 4: 0.8x,
// 2 x 4 and 6 x 2 slower).
constexpr int kSumRows = kRegs >= 32 ? 4 : 3;
constexpr int kSumVecs = 4;

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

// ---- weights interleaved by 16 output rows x int8 activations: int8 codes (W8A8, the Q8_0 x Q8_0 scheme of
// GGML/llama.cpp) and Q5_0 blocks (W5A8)
//
// The weights of 16 output rows share each 64-byte vector, one row per 32-bit lane, so one dot product adds kI
// rows' products with 4 broadcast activation bytes and no horizontal sum is needed. Activations quantized per
// group of 32 (quantize_rows: q [T, K], sx, qsum [T, K / 32]); N a multiple of 16 and K of 32 (the layers pad).
// y[t, n] = sum_g (s_w(n, g) * sx[t, g]) * (sum_{k in g} code[n, k] q[t, k] + kBase * qsum[t, g]): the group's
// sums exact int32, then one fused multiply-add per lane and group in ascending g: a row's result is its own
// data's alone, whatever the tile, T or vector width (every family computes the same lanes in the same order,
// bit for bit). A format W gives, for the kI rows of a vector (W::Lanes), each group's codes 8 input channels at
// a time (W::codes, two vectors of 4-byte runs; W::group first loads what a group shares), their products
// (W::dot) and the group's scales (w.scales_of).
//
// Int8Rows: codes [N / 16, K / 4, 64] int8 (tokenspeed.quant.pack_int8: byte 4 j + i of chunk c of block b is
// code[16 b + j, 4 c + i]), scales [N / 16, G, 16] fp32 (G = 1: one per row; G = K / 32: one per 32 input
// channels, a GGUF file's Q8_0 blocks); kBase = -kW8Offset (dot4w, see cpu_isa.h).
struct Int8Rows {
  const int8_t* w;
  const float* scales;
  int64_t K, G;
  static constexpr int32_t kBase = -kW8Offset;
  struct Lanes {
    const uint8_t* w;
    const float* s;
  };
  Lanes lanes(int64_t row) const {
    const int64_t b = row / 16, lane = row % 16;
    return {reinterpret_cast<const uint8_t*>(w) + b * (K / 4) * 64 + lane * 4, scales + b * G * 16 + lane};
  }
  static void group(Lanes&, int64_t) {}
  static void codes(const Lanes& l, int64_t g, int o, vi& c0, vi& c1) {
    const uint8_t* p = l.w + (g * (kQGroup / 4) + 2 * o) * 64;
    c0 = w8_prep(iload(p)), c1 = w8_prep(iload(p + 64));
  }
  static vi dot(vi acc, vi c0, vi a0, vi c1, vi a1) { return dot4w(dot4w(acc, c0, a0), c1, a1); }
  vf scales_of(const Lanes& l, int64_t g) const { return load(l.s + (G == 1 ? 0 : g * 16)); }
};

// Q5_0Rows: a GGUF file's Q5_0 blocks (d fp16, 32 codes 0..31, w = d (code - 16); ggml's block_q5_0)
// interleaved by 16 output rows (tokenspeed.quant.pack_q5_0): blocks [N / 16, K / 32, 352] uint8, per block of
// rows b and group g: the low 4 bits [4 octets][16 rows][4 bytes] (256; see q5_codes in cpu_isa.h), the fifth
// bits [16 rows] uint32 (64), d [16 rows] fp16 (32): 22 bytes per row and block, as stored. kBase = -16, the
// codes' bias.
struct Q5_0Rows {
  const uint8_t* blocks;
  int64_t K;
  static constexpr int64_t kBytes = 352, kBits = 256, kScales = 320;
  static constexpr int32_t kBase = -16;
  struct Lanes {
    const uint8_t *p, *d;  // the lanes' low bits and scales in group 0's block
    vi h;                  // the current group's fifth bits
  };
  Lanes lanes(int64_t row) const {
    const uint8_t* b = blocks + row / 16 * (K / kQGroup) * kBytes;
    return {b + row % 16 * 4, b + kScales + row % 16 * 2, izero()};
  }
  static void group(Lanes& l, int64_t g) { l.h = iload(l.p + g * kBytes + kBits); }
  static void codes(const Lanes& l, int64_t g, int o, vi& c0, vi& c1) { q5_codes(iload(l.p + g * kBytes + o * 64), l.h, o, c0, c1); }
  static vi dot(vi acc, vi c0, vi a0, vi c1, vi a1) { return dot8u(acc, c0, a0, c1, a1); }
  static vf scales_of(const Lanes& l, int64_t g) { return load_half(reinterpret_cast<const uint16_t*>(l.d + g * kBytes)); }
};

// Register tiles of RV vectors of kI rows x RN token rows (the scheme of the int4 kernel; llamafile's tinyBLAS
// blocks its GEMMs the same way): each step's RV weight vectors are formed once for RN tokens, each token's
// activation bytes loaded once for RV vectors. Bursts take kRowsTokens token rows and kRowsVecs vectors per
// tile, a decode step (RN = 1) kRowsDecodeVecs: RV * RN int32 and fp32 accumulators beside the weight vectors
// within the kRegs vector registers. Measured at 84 and 1 token rows, one thread (the W8A8 kernel alone): avx512
// 4 x 2 beside 6 x 2, 8 x 2, 4 x 3 and 3 x 3 (within 10% or slower), decode 4 vectors; avx2 4 x 2 took 0.8x
// the time of 4 x 1 (6 x 1, 8 x 1 and 5 x 2 slower still), decode 2 vectors.
constexpr int kRowsTokens = 4;
constexpr int kRowsVecs = 2;
constexpr int kRowsDecodeVecs = kRegs >= 32 ? 4 : 2;
constexpr int64_t kRowsPanel = 8;  // blocks of 16 output rows per panel (in_panels)

// The activations of one call of an interleaved kernel: q [T, K], sx and qsum [T, K / 32].
struct Acts8 {
  const int8_t* q;
  const float* sx;
  const int32_t* qsum;
  int64_t K;
};

// y[t0 .. t0 + RN, rows kI v0 .. kI (v0 + RV)) (row stride N).
template <class W, int RV, int RN>
inline void rows_tile(const W& w, const Acts8& a, int64_t t0, float* y, int64_t N, int64_t v0) {
  const int64_t groups = a.K / kQGroup;
  typename W::Lanes lanes[RV];
  for (int v = 0; v < RV; ++v) lanes[v] = w.lanes((v0 + v) * kI);
  vf acc[RV][RN];
  for (int v = 0; v < RV; ++v)
    for (int t = 0; t < RN; ++t) acc[v][t] = zero();
  for (int64_t g = 0; g < groups; ++g) {
    vi d[RV][RN];
    for (int t = 0; t < RN; ++t) {
      const vi base = bcast4(W::kBase * a.qsum[(t0 + t) * groups + g]);
      for (int v = 0; v < RV; ++v) d[v][t] = base;
    }
    for (int v = 0; v < RV; ++v) W::group(lanes[v], g);
    for (int o = 0; o < kQGroup / 8; ++o) {
      vi c0[RV], c1[RV];
      for (int v = 0; v < RV; ++v) W::codes(lanes[v], g, o, c0[v], c1[v]);
      for (int t = 0; t < RN; ++t) {
        const int8_t* qk = a.q + (t0 + t) * a.K + g * kQGroup + 8 * o;
        const vi a0 = bcast4(load_i32(qk)), a1 = bcast4(load_i32(qk + 4));
        for (int v = 0; v < RV; ++v) d[v][t] = W::dot(d[v][t], c0[v], a0, c1[v], a1);
      }
    }
    for (int v = 0; v < RV; ++v) {
      const vf s = w.scales_of(lanes[v], g);
      for (int t = 0; t < RN; ++t)
        acc[v][t] = fmadd(to_float(d[v][t]), mul(s, set1(a.sx[(t0 + t) * groups + g])), acc[v][t]);
    }
  }
  for (int v = 0; v < RV; ++v)
    for (int t = 0; t < RN; ++t) store(y + (t0 + t) * N + (v0 + v) * kI, acc[v][t]);
}

// Token rows t0 .. t0 + RN of the output rows of blocks [nb0, nb1), in tiles of RV vectors.
template <class W, int RN>
void rows_panel(const W& w, const Acts8& a, int64_t t0, float* y, int64_t N, int64_t nb0, int64_t nb1) {
  constexpr int RV = RN == 1 ? kRowsDecodeVecs : kRowsVecs;
  const int64_t v1 = nb1 * 16 / kI;
  int64_t v = nb0 * 16 / kI;
  for (; v + RV <= v1; v += RV) rows_tile<W, RV, RN>(w, a, t0, y, N, v);
  if (v < v1)
    with_rows<RV>(static_cast<int>(v1 - v), [&](auto rv) { rows_tile<W, decltype(rv)::value, RN>(w, a, t0, y, N, v); });
}

// x [T, K] -> per group of `group` input channels of rows Kp >= K wide (Kp = K: the last group shorter when K
// is not a multiple; Kp > K: a multiple of `group`, zero past K): int8 codes q [T, Kp] (round(x * 127 /
// max|x|)), scale sx [T, ceil(Kp / group)] (max|x| / 127) and, where not NULL, xs = sx * sum(q) and qsum =
// sum(q) per group.
void quantize_rows(const float* x, int64_t T, int64_t K, int64_t Kp, int64_t group, int8_t* q, float* sx, float* xs,
                   int32_t* qsum) {
  const int64_t G = (Kp + group - 1) / group;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t width = std::min(group, Kp - g * group), n = std::clamp<int64_t>(K - g * group, 0, width);
      const float* xg = x + t * K + g * group;
      int8_t* qg = q + t * Kp + g * group;
      float amax = 0.f;
      for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(xg[i]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        qg[i] = static_cast<int8_t>(std::nearbyint(xg[i] * inv));
        sum += qg[i];
      }
      std::fill(qg + n, qg + width, int8_t{0});
      sx[t * G + g] = amax / 127.f;
      if (xs != nullptr) xs[t * G + g] = sx[t * G + g] * static_cast<float>(sum);
      if (qsum != nullptr) qsum[t * G + g] = sum;
    }
}

// ---- GGUF blocks as stored x int8 activations (W4A8 Q4_K, W5A8 Q5_K, W6A8 Q6_K; Q5_0 runs interleaved, above)
//
// One driver (block_rows) over a format struct F per block type: F::kValues weights in F::kBytes bytes
// per block (a row of the weight: K / kValues blocks), F::kActGroup input channels per activation scale,
// F::kAuxRun per activation sum, and F::block, which adds one block's terms for TT token rows to their
// RowSums. block_quantize makes the activations F needs (q, sx, aux). A block's codes are formed once for
// the TT rows; the code x q sums are exact int32 (dot4 of the unsigned codes, at most 63 x 127 per byte
// and one dot4 per dsum, so avx2's int16 pair sums stay exact; dot4_times for Q4_K / Q5_K, dot4_scaled for Q6_K), the float sums
// fused multiply-adds per lane in ascending k, then one horizontal sum: a row's result is its own data's
// alone, whatever TT and T.
struct RowSums {
  vf acc, vneg;  // y = reduce_add(acc - vneg) - F::kBias * neg
  float neg;
};

// The activations of one call: q [T, K], sx [T, K / F::kActGroup], aux [T, K / F::kAuxRun].
struct Acts {
  const int8_t* q;
  const float* sx;
  const float* aux;
  int64_t K;
};

inline float f16_at(const uint8_t* p) { return half_scalar(static_cast<uint16_t>(p[0] | p[1] << 8)); }

// Q6_K: 256 weights in 210 bytes: ql [128] (low 4 bits), qh [64] (high 2 bits), scales [16] int8 (one
// per 16 weights), d fp16; weight i = d * scales[i / 16] * (code_i - 32), code_i = (ql[64 h + l] >> 4 (c / 2)
// & 15) | (qh[32 h + l'] >> 2 c & 3) << 4 for i = 128 h + 32 c + l', l = 32 (c % 2) + l' (ggml's
// dequantize_row_q6_K). The activations are quantized per block of 256 (one scale sx[t, b], as llama.cpp's
// Q8_K), so a block's sums stay integers: aux = off [T, K / 16] = 32 * sx[t, b] * sum of q over each run of 16,
// y[t, j] = sum over blocks b of d sx[t, b] sum_r scale_r sum_{k in r} code q - sum_r d scale_r off[t, r],
// the inner sums exact int32 lanes (dot4_scaled; a lane's sum over a block, all 256 weights in the generic
// family's one lane, is at most 256 * 63 * 127 * 128 < 2^31).
struct Q6K {
  static constexpr int64_t kValues = 256, kBytes = 210, kActGroup = 256, kAuxRun = 16, kRuns = kValues / kAuxRun;
  static constexpr float kBias = 0.f;
  static float aux_of(float sx, int32_t sum) { return 32.f * sx * static_cast<float>(sum); }
  struct Scratch {
    alignas(64) float fs[kRuns];  // d * scales
  };
  template <int TT>
  static void block(const uint8_t* b, int64_t at, const Acts& a, int64_t t0, RowSums* s, Scratch& w) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    vi sums[TT];
    for (int t = 0; t < TT; ++t) sums[t] = izero();
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < 4; c += kVecGroups)  // kVecGroups chunks (of 32 weights) per vector
        for (int k = 0; k < 32; k += kGroupBytes) {
          const int64_t at_k = 128 * h + 32 * c + k;
          vi u[kVecGroups], rs[kVecGroups];
          for (int i = 0; i < kVecGroups; ++i) {
            u[i] = q6_codes(ql + 64 * h + 32 * ((c + i) & 1) + k, qh + 32 * h + k, c + i);
            rs[i] = run_scales(sc + (at_k + 32 * i) / kAuxRun);
          }
          const vi uv = join_groups<kVecGroups>(u), rv = join_groups<kVecGroups>(rs);
          for (int t = 0; t < TT; ++t)
            sums[t] = dot4_scaled(sums[t], uv, iload_groups<kVecGroups>(a.q + (t0 + t) * a.K + at + at_k), rv);
        }
    const float d = f16_at(b + 208);
    for (int i = 0; i < kRuns; i += kW) store(w.fs + i, mul(set1(d), load_s8(sc + i)));
    const int64_t blocks = a.K / kValues, runs = a.K / kAuxRun;
    for (int t = 0; t < TT; ++t) {
      s[t].acc = fmadd(to_float(sums[t]), set1(d * a.sx[(t0 + t) * blocks + at / kValues]), s[t].acc);
      for (int64_t r = 0; r < kRuns; r += kW)
        s[t].vneg = fmadd(load(w.fs + r), load(a.aux + (t0 + t) * runs + at / kAuxRun + r), s[t].vneg);
    }
  }
};

// Q4_K and Q5_K: 256 weights as 8 sub-blocks of 32: d and dmin fp16, 12 bytes packing a 6-bit scale sc
// and minimum m per sub-block (ggml's get_scale_min_k4), Q5_K's qh [32] (bit 2c of qh[l]: the fifth bit of
// weight 64 c + l, bit 2c + 1: of 64 c + 32 + l), qs [128] (byte 32 c + l: weight 64 c + l in its low
// nibble, 64 c + 32 + l in its high one); weight = d sc code - dmin m (ggml's dequantize_row_q4_K / q5_K).
// The activations are quantized per block of 256 (one scale sx[t, b], as llama.cpp's Q8_K), so a block's
// sums stay integers: aux [T, K / 32] = the sum of q over each sub-block, and
// y[t, j] = sum over blocks b of (d sx[t, b]) sum_s sc_s sum_{k in s} code q - (dmin sx[t, b]) sum_s m_s aux[t, s],
// the inner sums exact int32 lanes (dot4_times; dot4_scaled with a sub-block pair per vector, avx512, whose
// dot4_scaled takes int32 lane scales), the minimums' sum exact in fp32 (< 2^24).
template <bool kFifthBit>
struct QK {
  static constexpr int64_t kValues = 256, kBytes = kFifthBit ? 176 : 144, kActGroup = 256, kAuxRun = 32;
  static constexpr float kBias = 1.f;
  static float aux_of(float, int32_t sum) { return static_cast<float>(sum); }
  struct Scratch {};
  template <int TT>
  static void block(const uint8_t* b, int64_t at, const Acts& a, int64_t t0, RowSums* s, Scratch&) {
    const uint8_t *sm = b + 4, *qh = b + 16, *qs = b + (kFifthBit ? 48 : 16);
    int sc[8], mn[8];
    for (int i = 0; i < 4; ++i) {
      sc[i] = sm[i] & 63;
      mn[i] = sm[i + 4] & 63;
      sc[i + 4] = (sm[i + 8] & 15) | (sm[i] >> 6) << 4;
      mn[i + 4] = (sm[i + 8] >> 4) | (sm[i + 4] >> 6) << 4;
    }
    vi sums[TT];
    for (int t = 0; t < TT; ++t) sums[t] = izero();
    for (int c = 0; c < 4; ++c)
      for (int k = 0; k < kQGroup; k += kGroupBytes) {
        const vi v = iload_s8(reinterpret_cast<const int8_t*>(qs + 32 * c + k));
        vi lo = nibbles_lo(v), hi = nibbles_hi(v);
        if constexpr (kFifthBit) {
          const vi h = iload_s8(reinterpret_cast<const int8_t*>(qh + k));
          lo = bit_or_16(lo, h, 1 << (2 * c));
          hi = bit_or_16(hi, h, 1 << (2 * c + 1));
        }
        if constexpr (kVecGroups > 1) {  // both sub-blocks in one vector, each with its scale
          const vi halves[2] = {lo, hi}, scales[2] = {bcast4(sc[2 * c]), bcast4(sc[2 * c + 1])};
          const vi uv = join_groups<2>(halves), sv = join_groups<2>(scales);
          for (int t = 0; t < TT; ++t)
            sums[t] = dot4_scaled(sums[t], uv, iload_groups<2>(a.q + (t0 + t) * a.K + at + 64 * c + k), sv);
        } else {
          for (int t = 0; t < TT; ++t) {
            const int8_t* qt = a.q + (t0 + t) * a.K + at + 64 * c + k;
            sums[t] = dot4_times(dot4_times(sums[t], lo, iload_s8(qt), sc[2 * c]), hi, iload_s8(qt + kQGroup), sc[2 * c + 1]);
          }
        }
      }
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const int64_t blocks = a.K / kValues, subs = a.K / kAuxRun;
    for (int t = 0; t < TT; ++t) {
      const float st = a.sx[(t0 + t) * blocks + at / kValues];
      const float* qsum = a.aux + (t0 + t) * subs + at / kAuxRun;
      float m = 0.f;
      for (int i = 0; i < 8; ++i) m += static_cast<float>(mn[i]) * qsum[i];
      s[t].acc = fmadd(to_float(sums[t]), set1(d * st), s[t].acc);
      s[t].neg = std::fma(dmin * st, m, s[t].neg);
    }
  }
};

// Rows t0 .. t0 + TT of y for output rows [j0, j1) of F's blocks (row j at blocks + j * K / kValues * kBytes).
template <class F, int TT>
void block_rows(const Acts& a, int64_t t0, const uint8_t* blocks, float* y, int64_t N, int64_t j0, int64_t j1) {
  const int64_t nb = a.K / F::kValues;
  typename F::Scratch scratch;
  for (int64_t j = j0; j < j1; ++j) {
    RowSums s[TT];
    for (int t = 0; t < TT; ++t) s[t] = RowSums{zero(), zero(), 0.f};
    for (int64_t b = 0; b < nb; ++b)
      F::template block<TT>(blocks + (j * nb + b) * F::kBytes, b * F::kValues, a, t0, s, scratch);
    for (int t = 0; t < TT; ++t) y[(t0 + t) * N + j] = reduce_add(sub(s[t].acc, s[t].vneg)) - F::kBias * s[t].neg;
  }
}

// x [T, K] -> q [T, K], sx [T, K / F::kActGroup] (quantize_rows) and aux [T, K / F::kAuxRun] =
// F::aux_of(sx of the run's group, sum of q over each run of kAuxRun input channels).
template <class F>
void block_quantize(const float* x, int64_t T, int64_t K, int8_t* q, float* sx, float* aux) {
  quantize_rows(x, T, K, K, F::kActGroup, q, sx, nullptr, nullptr);
  const int64_t runs = K / F::kAuxRun;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r = 0; r < runs; ++r) {
      int32_t sum = 0;
      for (int64_t k = r * F::kAuxRun; k < (r + 1) * F::kAuxRun; ++k) sum += q[t * K + k];
      aux[t * runs + r] = F::aux_of(sx[t * (K / F::kActGroup) + r * F::kAuxRun / F::kActGroup], sum);
    }
}

// Calls f(F{}) for the block format `format` (a ggml type number); false if the kernels have none.
template <typename Fn>
bool with_format(int64_t format, Fn&& f) {
  switch (format) {
    case TS_Q4_K: f(QK<false>{}); return true;
    case TS_Q5_K: f(QK<true>{}); return true;
    case TS_Q6_K: f(Q6K{}); return true;
    default: return false;
  }
}

// Calls f(t0, std::integral_constant<int, TT>{}) over the T token rows in blocks of at most M.
template <int M, typename Fn>
void token_blocks(int64_t T, Fn&& f) {
  int64_t t0 = 0;
  for (; t0 + M <= T; t0 += M) f(t0, std::integral_constant<int, M>{});
  if (t0 < T) with_rows<M>(static_cast<int>(T - t0), [&](auto tt) { f(t0, tt); });
}

constexpr int64_t kInt4Panel = 8;  // output blocks of 16 channels per panel (10 bytes per input channel each, 9.25 with SuperScales)

// Calls f(p0, p1) over the weight rows (or output blocks) [j0, j1) in panels of `panel`, or over all of
// them at once when the T token rows make one block of at most `rows`. A kernel runs every token block
// under one panel before the next, so the panel's weights stay cached and stream from memory once per
// call, however many tokens (a prefill burst); a row's result does not depend on the panels.
template <typename Fn>
void in_panels(int64_t T, int64_t rows, int64_t j0, int64_t j1, int64_t panel, Fn&& f) {
  if (T <= rows) panel = j1 - j0;
  for (int64_t p0 = j0; p0 < j1; p0 += panel) f(p0, std::min(j1, p0 + panel));
}

// y [T, N], output blocks [nb0, nb1) of 16 rows, of the interleaved format W (rows_panel under in_panels).
template <class W>
void interleaved_rows(const W& w, const Acts8& a, int64_t T, float* y, int64_t N, int64_t nb0, int64_t nb1) {
  in_panels(T, kRowsTokens, nb0, nb1, kRowsPanel, [&](int64_t p0, int64_t p1) {
    token_blocks<kRowsTokens>(T, [&](int64_t t0, auto rn) { rows_panel<W, decltype(rn)::value>(w, a, t0, y, N, p0, p1); });
  });
}

// ---- int4 weights x int8 activations (W4A8, the Q4_1 x Q8_1 scheme of GGML/llama.cpp)
//
// Weight: 4-bit codes c in 0..15 per group of 32 input channels, w[n, k] = c * s[n, g] + m[n, g].
// Codes [N / 16, K / 8, 64]: for output block nb (16 channels, one per 32-bit lane) and input
// octet o, lane j's 4 bytes hold channel nb * 16 + j's codes k = 8o + b in the low nibble and
// k = 8o + 4 + b in the high nibble (b = 0..3). s and m come in one of two layouts (GroupScales,
// SuperScales below).
// y[t, n] = sum_g s[n, g] * sx[t, g] * sum_k c * q + m[n, g] * sx[t, g] * sum_k q: the inner sums
// are exact int32 (dot4: 4 byte products per lane, dsum per group) and the float accumulation runs in a fixed
// order per lane, so a row's result depends neither on how many rows share the call
// (speculative verification == plain decoding, bit for bit) nor on the vector width.
// The kI-channel slices of an output block one pass holds at once: the most (16 / kI halved until it fits)
// whose float and integer sums for TT rows (2 TT per slice), the TT rows' two activation broadcasts and a
// vector of codes with its two nibble halves fit the kRegs registers. Where a pass then holds the whole
// block (avx2 up to 2 rows), each 64-byte row of codes is swept once; each activation broadcast serves every
// slice of the pass.
template <int TT>
constexpr int int4_slices() {
  int n = 16 / kI;
  while (n > 1 && 2 * TT * n + 2 * TT + 3 > kRegs) n /= 2;
  return n;
}

// Scales [N / 16, K / 32, 2, 16] bf16: per output block and group, s then m.
struct GroupScales {
  const uint16_t* sm;
  int64_t G;
  // s and m of lanes [lane, lane + kI) of output block nb, group g
  void load(int64_t nb, int64_t g, int lane, vf& s, vf& m) const {
    const uint16_t* p = sm + (nb * G + g) * 32 + lane;
    s = load_bf16(p);
    m = load_bf16(p + 16);
  }
  void prefetch(int64_t nb, int64_t g) const { prefetch_ahead(sm + (nb * G + g) * 32, 64, kPrefetchAhead / 4); }
};

// Q4_K's two-level scales, exact: [N / 16, K / 256, 320] bytes per output block and super-block of 256 input
// channels: fp16 d [16] and -dmin [16], then per group its 6-bit sc [16] and m [16] as int8; s = d sc and
// m = -dmin m, products exact in fp32 (11 x 6 significant bits).
struct SuperScales {
  static constexpr int64_t kBytes = 320, kGroups = 8;
  const uint8_t* b;
  int64_t G;
  const uint8_t* super(int64_t nb, int64_t g) const { return b + (nb * (G / kGroups) + g / kGroups) * kBytes; }
  void load(int64_t nb, int64_t g, int lane, vf& s, vf& m) const {
    const uint8_t* p = super(nb, g);
    const uint16_t* d = reinterpret_cast<const uint16_t*>(p) + lane;
    const int8_t* sc = reinterpret_cast<const int8_t*>(p) + 64 + (g % kGroups) * 32 + lane;
    s = mul(load_half(d), load_s8(sc));
    m = mul(load_half(d + 16), load_s8(sc + 16));
  }
  void prefetch(int64_t nb, int64_t g) const {  // a super-block's 320 bytes per 2 KiB of codes
    if (g % kGroups == 0) prefetch_ahead(super(nb, g), kBytes, kPrefetchAhead * kBytes / (kGroups * (kQGroup / 8) * 64));
  }
};

template <int TT, class Scales>
void int4_block(const int8_t* q, const float* sx, const float* xs, int64_t t0, int64_t K, const uint8_t* codes,
                const Scales& scales, float* y, int64_t N, int64_t nb0, int64_t nb1) {
  constexpr int S = int4_slices<TT>();
  static_assert(16 % kI == 0 && S >= 1 && (16 / kI) % S == 0, "slices of kI channels must tile a block of 16");
  const int64_t G = K / kQGroup, O = K / 8;
  // a panel's first token block streams its weights (prefill's later ones find them cached)
  const bool fetch = kPrefetchInt4 && t0 == 0;
  for (int64_t nb = nb0; nb < nb1; ++nb)
    for (int p0 = 0; p0 < 16 / kI; p0 += S) {  // S x kI of the block's 16 output channels
      vf acc[TT][S];
      for (int t = 0; t < TT; ++t)
        for (int p = 0; p < S; ++p) acc[t][p] = zero();
      const uint8_t* cb = codes + nb * O * 64 + p0 * 4 * kI;
      for (int64_t g = 0; g < G; ++g) {
        if (fetch && p0 == 0) {  // the group's 4 rows of codes and its scales
          prefetch_ahead(cb + g * (kQGroup / 8) * 64, kQGroup / 8 * 64);
          scales.prefetch(nb, g);
        }
        vi dot[TT][S];
        for (int t = 0; t < TT; ++t)
          for (int p = 0; p < S; ++p) dot[t][p] = izero();
        for (int64_t o = 0; o < kQGroup / 8; ++o) {
          const int8_t* qk = q + t0 * K + g * kQGroup + o * 8;
          vi qa[TT], qb[TT];
          for (int t = 0; t < TT; ++t) {
            qa[t] = bcast4(load_i32(qk + t * K));
            qb[t] = bcast4(load_i32(qk + t * K + 4));
          }
          for (int p = 0; p < S; ++p) {
            const vi v = iload(cb + (g * (kQGroup / 8) + o) * 64 + p * 4 * kI);
            const vi lo = nibbles_lo(v), hi = nibbles_hi(v);
            for (int t = 0; t < TT; ++t) dot[t][p] = dot4(dot4(dot[t][p], lo, qa[t]), hi, qb[t]);
          }
        }
        for (int p = 0; p < S; ++p) {
          vf s, m;
          scales.load(nb, g, (p0 + p) * kI, s, m);
          for (int t = 0; t < TT; ++t) {
            const int64_t i = (t0 + t) * G + g;
            acc[t][p] = fmadd(to_float(dsum(dot[t][p])), mul(s, set1(sx[i])), acc[t][p]);
            acc[t][p] = fmadd(m, set1(xs[i]), acc[t][p]);
          }
        }
      }
      for (int t = 0; t < TT; ++t)
        for (int p = 0; p < S; ++p) store(y + (t0 + t) * N + nb * 16 + (p0 + p) * kI, acc[t][p]);
    }
}

// y [T, N], output blocks [nb0, nb1) of 16 rows, of the W4A8 weight (codes and either scale layout).
template <class Scales>
void int4_rows(const int8_t* q, const float* sx, const float* xs, int64_t T, int64_t K, const uint8_t* codes,
               const Scales& scales, float* y, int64_t N, int64_t nb0, int64_t nb1) {
  in_panels(T, isa::kMaxRows, nb0, nb1, kInt4Panel, [&](int64_t p0, int64_t p1) {
    token_blocks<isa::kMaxRows>(T, [&](int64_t t0, auto tt) {
      int4_block<decltype(tt)::value>(q, sx, xs, t0, K, codes, scales, y, N, p0, p1);
    });
  });
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

// out [n] = silu(gate) * up. Vector families: silu(g) = max(g, 0) - |g| e / (1 + e) with e = exp(-|g|)
// <= 1, inside exp_neg's range for any g. The generic family and a row's tail: g / (1 + e^-g) with
// std::exp (e^-g = inf for g < -88 gives -0), the expression torch's silu evaluates: the generic
// family's results stay those of the scalar loop this replaced (an int8 step rounds its input
// activations to codes, where a 1-ulp change can move one code).
void swiglu_row(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  if constexpr (kW > 1) {
    const vf z = zero(), one = set1(1.f);
    for (; i + kW <= n; i += kW) {
      const vf g = load(gate + i), a = max(g, sub(z, g));
      const vf e = exp_neg(sub(z, a));
      store(out + i, mul(sub(max(g, z), div(mul(a, e), add(one, e))), load(up + i)));
    }
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
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
  ts::quantize_rows(x, T, K, K, ts::kQGroup, q, sx, xs, nullptr);
}

void ts_int4_rows(const int8_t* q, const float* sx, const float* xs, int64_t T, int64_t K, const uint8_t* codes,
                  const uint16_t* scales, float* y, int64_t N, int64_t nb0, int64_t nb1) {
  ts::int4_rows(q, sx, xs, T, K, codes, ts::GroupScales{scales, K / ts::kQGroup}, y, N, nb0, nb1);
}

void ts_int4_super_rows(const int8_t* q, const float* sx, const float* xs, int64_t T, int64_t K, const uint8_t* codes,
                        const uint8_t* scales, float* y, int64_t N, int64_t nb0, int64_t nb1) {
  ts::int4_rows(q, sx, xs, T, K, codes, ts::SuperScales{scales, K / ts::kQGroup}, y, N, nb0, nb1);
}

void ts_int8_quantize(const float* x, int64_t T, int64_t K, int64_t Kp, int8_t* q, float* sx, int32_t* qsum) {
  ts::quantize_rows(x, T, K, Kp, ts::kQGroup, q, sx, nullptr, qsum);
}

void ts_int8_rows(const int8_t* q, const float* sx, const int32_t* qsum, int64_t T, int64_t K, const int8_t* w,
                  const float* scales, int64_t G, float* y, int64_t N, int64_t nb0, int64_t nb1) {
  ts::interleaved_rows(ts::Int8Rows{w, scales, K, G}, ts::Acts8{q, sx, qsum, K}, T, y, N, nb0, nb1);
}

void ts_q5_0_rows(const int8_t* q, const float* sx, const int32_t* qsum, int64_t T, int64_t K, const uint8_t* blocks,
                  float* y, int64_t N, int64_t nb0, int64_t nb1) {
  ts::interleaved_rows(ts::Q5_0Rows{blocks, K}, ts::Acts8{q, sx, qsum, K}, T, y, N, nb0, nb1);
}

int ts_block_format(int64_t format, int64_t* values, int64_t* bytes, int64_t* act_group, int64_t* aux_run) {
  return ts::with_format(format, [&](auto f) {
    using F = decltype(f);
    *values = F::kValues, *bytes = F::kBytes, *act_group = F::kActGroup, *aux_run = F::kAuxRun;
  });
}

void ts_block_quantize(int64_t format, const float* x, int64_t T, int64_t K, int8_t* q, float* sx, float* aux) {
  ts::with_format(format, [&](auto f) { ts::block_quantize<decltype(f)>(x, T, K, q, sx, aux); });
}

void ts_block_rows(int64_t format, const int8_t* q, const float* sx, const float* aux, int64_t T, int64_t K,
                   const uint8_t* blocks, float* y, int64_t N, int64_t j0, int64_t j1) {
  const ts::Acts a{q, sx, aux, K};
  ts::with_format(format, [&](auto f) {
    ts::token_blocks<ts::isa::kMaxRows>(T, [&](int64_t t0, auto tt) {
      ts::block_rows<decltype(f), decltype(tt)::value>(a, t0, blocks, y, N, j0, j1);
    });
  });
}

void ts_attend_rows(const float* q, int64_t T, int64_t start, const float* k, const float* v, int64_t D, float scale,
                    float* scores, float* out, float* lse, int64_t r0, int64_t r1) {
  ts::attend_rows(q, T, start, k, v, D, scale, scores, out, lse, r0, r1);
}

void ts_attend_rows_half(const float* q, int64_t T, int64_t start, const uint16_t* k, const uint16_t* v, int64_t D,
                         float scale, float* scores, float* out, float* lse, int64_t r0, int64_t r1) {
  ts::attend_rows(q, T, start, k, v, D, scale, scores, out, lse, r0, r1);
}

void ts_swiglu(const float* gu, int64_t T, int64_t F, float* out) {
  for (int64_t t = 0; t < T; ++t) ts::swiglu_row(gu + 2 * F * t, gu + 2 * F * t + F, out + F * t, F);
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
