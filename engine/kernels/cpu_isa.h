// The thin ISA layer under cpu_kernels.cpp: one set of vector types and operations per
// instruction-set family, chosen at compile time from the compiler's target macros (the build
// passes the variant's -m flags, see cpu_decode.py VARIANTS). The kernels are written once over
// these names and instantiated for whichever family is compiled.
//
//   family        float vector     int8 dot product (u8 x s8 -> s32, 4 bytes per 32-bit lane)
//   avx512        __m512 (16)      vpdpbusd (AVX512-VNNI)
//   avx2-vnni     __m256 (8)       vpdpbusd (AVX-VNNI, 256-bit)
//   avx2          __m256 (8)       vpmaddubsw into int16 lanes, one vpmaddwd per group (dsum)
//   neon-dotprod  float32x4 (4)    sdot (ARMv8.2 dot product)
//   neon          float32x4 (4)    smull + pairwise adds
//   generic       float (1)        scalar
//
// load_s8 widens kW int8 to fp32 (the Q6_K blocks' scales).
//
// The KV cache may hold IEEE half floats (binary16, as raw uint16_t bits): load_half widens kW of
// them to fp32 exactly (half_scalar one: the GGUF blocks' scales), store_half rounds kW floats to
// nearest-even (F16C on x86, fcvt on ARM, the portable half_from_float / half_to_float in the generic
// variant; all give the same bits).
//
// The int4 kernel sums one group of 32 codes per row as dsum(dot4(... dot4(izero(), u, s) ...)) with at
// most 8 dot4 calls before dsum; dsum gives the int32 lanes (the identity where dot4 adds int32).
// The int8 kernel (signed weights x signed activations, W8A8) reads kI output rows' 4-byte runs per vector
// (the weights interleaved by 16 rows, tokenspeed.quant.Int8Linear's CPU layout) and sums each group of 32
// input channels in int32 lanes as dot4w(acc, w8_prep(w), bcast4(4 activation bytes)): avx512 offsets the
// weights to unsigned (w + 128, kW8Offset) once per vector for one vpdpbusd against the signed activations,
// and starts each group's sum from -kW8Offset * sum(q), which takes the offset off again, exactly; the other
// families take the weights as they are (kW8Offset 0) in dot4s: avx2 multiplies |w| (u8) by q with w's sign
// (the sign trick of llama.cpp's Q8_0 dot) in vpdpbusd, or vpmaddubsw + vpmaddwd without VNNI; NEON uses
// sdot or smull; generic plain C.
//
// The Q5_0 kernel reads its blocks interleaved by 16 output rows (tokenspeed.quant.pack_q5_0): per group of 32
// input channels and octet o (channels 8o .. 8o + 7), lane j's 4 bytes hold row j's low 4 bits of channels
// 8o + b (low nibble) and 8o + 4 + b (high nibble), and its fifth bits one 32-bit word per row, bit 8b + 4h + o
// for channel 8o + 4h + b; q5_codes(nib, h, o, lo, hi) gives the codes 0..31 of the octet's two 4-byte runs, and
// dot8u(acc, lo, a0, hi, a1) adds both runs' products with their activations to int32 lanes, exact (avx2's
// int16 pair sums stay below 4 * 31 * 127 = 15748).
//
// The block kernels (Q4_K, Q5_K, Q6_K) run dot4 on unsigned codes 0..15, 0..31 and 0..63 (one call per dsum: avx2's int16
// pair sums stay below 2 * 63 * 127 = 16002), kVecGroups runs of 32 codes per vector as iload_groups lays out
// their activations (avx512: Q6_K chunk pairs, Q4_K / Q5_K sub-block pairs).
// dot4_times(acc, u, s, c) = acc + c * dot4(izero(), u, s) per int32 lane, c a 6-bit sub-block scale (the
// Q4_K / Q5_K kernel's integer sums per block of 256; avx2's int16 pairs: c * (at most 2 * 31 * 127) fits).
// bit_or_16(v, h, mask) sets 16 in each byte of v whose byte in h has a bit of `mask` set (Q5_K's fifth
// bits; v's bytes are codes 0..15).
// q6_codes(ql, qh, c) gives the kGroupBytes codes 0..63 of a Q6_K chunk: (ql[i] >> 4 (c / 2) & 15) |
// (qh[i] >> 2 c & 3) << 4 (ggml's block_q6_K, c = 0..3). dot4_scaled(acc, u, s, run_scales(sc)) = acc +
// sc[r] * dot4(izero(), u, s) per int32 lane, r the 16-byte run of the chunk the lane covers (lane l of a
// chunk starting at a multiple of 16 bytes covers bytes 4l..4l+3: run l / 4), exact int32: the Q6_K
// kernel's per-16-weight int8 scales (avx2's int16 pair sums times the scale, widened in one vpmaddwd).
//
// Every family computes the same exact int32 sums and the same per-lane float operations (fused
// multiply-adds) for the int4 matmul, so its results are bit-identical across families; float
// reductions (dot products, softmax sums) depend on the vector width and agree to rounding.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(TS_ISA_FORCE_GENERIC)  // the "generic" variant: scalar code on any CPU
#define TS_ISA_GENERIC 1
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TS_ISA_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TS_ISA_AVX2 1
#include <immintrin.h>
#elif defined(__ARM_NEON) && defined(__aarch64__)
#define TS_ISA_NEON 1
#include <arm_neon.h>
#else
#define TS_ISA_GENERIC 1
#endif

namespace ts {
namespace isa {

// Scalar conversions: bf16 -> fp32, and IEEE half <-> fp32 without hardware support (Dukhan's FP16
// library, fp16_ieee_to_fp32_value and fp16_ieee_from_fp32_value): exact widening; rounding to
// nearest-even with subnormals, inf and NaN kept.
inline float f32_of_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t bits_of_f32(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bf16_to_float(uint16_t v) { return f32_of_bits(static_cast<uint32_t>(v) << 16); }

inline float half_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16, sign = w & 0x80000000u, two_w = w + w;
  const float normal = f32_of_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float subnormal = f32_of_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  return f32_of_bits(sign | (two_w < (1u << 27) ? bits_of_f32(subnormal) : bits_of_f32(normal)));
}

inline uint16_t half_from_float(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = bits_of_f32(f), shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = f32_of_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = bits_of_f32(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline int16_t load_i16(const void* p) {
  int16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

#if TS_ISA_AVX512 || TS_ISA_AVX2
// The 32 codes 0..63 of a Q6_K chunk (q6_codes) in one 256-bit vector.
inline __m256i q6_codes_256(const uint8_t* ql, const uint8_t* qh, int c) {
  const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
  const __m256i lo = _mm256_and_si256(c & 2 ? _mm256_srli_epi16(l, 4) : l, _mm256_set1_epi8(0x0F));
  // the 2 bits at 2c moved to bits 4-5 by a 16-bit shift: what crosses from the other byte is masked off
  const __m256i hi = c < 2 ? _mm256_slli_epi16(h, 4 - 2 * c) : _mm256_srli_epi16(h, 2 * c - 4);
  return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
}
#endif

#if TS_ISA_AVX512
constexpr const char* kName = "avx512";
using vf = __m512;   // kW floats
using vi = __m512i;  // kI int32 lanes (= kW)
constexpr int kW = 16, kI = 16, kMaxRows = 8, kRegs = 32;  // kMaxRows: activation rows per int4/Q6_K block
constexpr bool kPrefetchInt4 = false;  // the W4A8 prefetch (cpu_kernels.cpp): no gain in a whole 1.5b decode step here
inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float a) { return _mm512_set1_ps(a); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(vf v) { return _mm512_reduce_max_ps(v); }
inline vf round(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf scale_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
inline vf load_bf16(const uint16_t* p) {  // kI bf16 -> fp32
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline vf load_half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline float half_scalar(uint16_t h) { return _cvtsh_ss(h); }
inline vf load_s8(const int8_t* p) {  // kW int8 -> fp32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void store_half(uint16_t* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// The four horizontal sums of a, b, c, d into out[0..3].
inline void hsum4(vf a, vf b, vf c, vf d, float* out) {
  auto half = [](__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  };
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half(a), half(b)), _mm256_hadd_ps(half(c), half(d)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
inline vi izero() { return _mm512_setzero_si512(); }
inline vi iload(const uint8_t* p) { return _mm512_loadu_si512(p); }  // 4 kI bytes
inline vi nibbles_lo(vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline vi nibbles_hi(vi v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
inline vi bcast4(int32_t q) { return _mm512_set1_epi32(q); }
// acc[lane] += sum_b u[lane, b] * s[lane, b] over its 4 bytes (u unsigned, s signed)
inline vi dot4(vi acc, vi u, vi s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline vi dsum(vi acc) { return acc; }
inline vf to_float(vi v) { return _mm512_cvtepi32_ps(v); }
constexpr int kGroupBytes = 32;  // bytes iload_s8 reads: one group into the low 8 lanes, the high 8 zero
inline vi iload_s8(const int8_t* p) { return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
constexpr int kVecGroups = 2;  // groups of 32 bytes per vector (iload_groups<2>: lanes 0-7 one group, 8-15 the next)
template <int NG>
inline vi iload_groups(const int8_t* p) {
  if constexpr (NG == 1) return iload_s8(p);
  return _mm512_loadu_si512(p);
}
template <int NG>
inline vi join_groups(const vi* v) {  // lanes 0-7 of v[0], then lanes 0-7 of v[NG - 1]
  if constexpr (NG == 1) return v[0];
  return _mm512_inserti64x4(v[0], _mm512_castsi512_si256(v[1]), 1);
}
// W8A8 (see the top of the file): the weights offset to unsigned (w + 128) for vpdpbusd against the signed activations
constexpr int32_t kW8Offset = 128;
inline vi w8_prep(vi w) { return _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80))); }
inline vi dot4w(vi acc, vi wp, vi q) { return _mm512_dpbusd_epi32(acc, wp, q); }
inline void q5_codes(vi n, vi h, int o, vi& lo, vi& hi) {
  const vi m = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(0x10);
  lo = _mm512_and_si512(n, m);
  hi = _mm512_and_si512(_mm512_srli_epi16(n, 4), m);
  lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(h, _mm512_set1_epi8(static_cast<char>(1 << o))), lo, sixteen);
  hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(h, _mm512_set1_epi8(static_cast<char>(16 << o))), hi, sixteen);
}
inline vi dot4_times(vi acc, vi u, vi s, int c) {
  return _mm512_add_epi32(acc, _mm512_mullo_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s), _mm512_set1_epi32(c)));
}
inline vi bit_or_16(vi v, vi h, int mask) {
  const __mmask64 set = _mm512_test_epi8_mask(h, _mm512_set1_epi8(static_cast<char>(mask)));
  return _mm512_or_si512(v, _mm512_maskz_mov_epi8(set, _mm512_set1_epi8(0x10)));
}
inline vi q6_codes(const uint8_t* ql, const uint8_t* qh, int c) {  // into the low 8 lanes, the high 8 zero
  return _mm512_zextsi256_si512(q6_codes_256(ql, qh, c));
}
inline vi run_scales(const int8_t* sc) {  // lanes 0-3 sc[0], 4-7 sc[1] as int32
  const __m128i two = _mm_cvtepi8_epi32(_mm_cvtsi32_si128(static_cast<uint16_t>(load_i16(sc))));
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2),
                                  _mm512_castsi128_si512(two));
}
inline vi dot4_scaled(vi acc, vi u, vi s, vi scales) {
  return _mm512_add_epi32(acc, _mm512_mullo_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s), scales));
}

#elif TS_ISA_AVX2
#if defined(__AVXVNNI__)
constexpr const char* kName = "avx2-vnni";
constexpr bool kPrefetchInt4 = false;  // the W4A8 prefetch (cpu_kernels.cpp): untimed, no AVX-VNNI machine here
#else
constexpr const char* kName = "avx2";
constexpr bool kPrefetchInt4 = true;   // the W4A8 prefetch (cpu_kernels.cpp): 0.9x the 1.5b decode step here
#endif
using vf = __m256;
using vi = __m256i;
constexpr int kW = 8, kI = 8, kMaxRows = 4, kRegs = 16;
inline vf zero() { return _mm256_setzero_ps(); }
inline vf set1(float a) { return _mm256_set1_ps(a); }
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float reduce_add(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline vf round(vf v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf scale_pow2(vf p, vf n) {  // n in [-126, 127]: build 2^n in the exponent field
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline vf load_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline vf load_half(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float half_scalar(uint16_t h) { return _cvtsh_ss(h); }
inline vf load_s8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void store_half(uint16_t* p, vf v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void hsum4(vf a, vf b, vf c, vf d, float* out) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
inline vi izero() { return _mm256_setzero_si256(); }
inline vi iload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vi nibbles_lo(vi v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline vi nibbles_hi(vi v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline vi bcast4(int32_t q) { return _mm256_set1_epi32(q); }
constexpr int kGroupBytes = 32;
inline vi iload_s8(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
#if defined(__AVXVNNI__)
inline vi dot4(vi acc, vi u, vi s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
inline vi dsum(vi acc) { return acc; }
inline vi dot4s(vi acc, vi w, vi q) {  // signed w and q (|q| <= 127): |w| x q * sign(w)
  return _mm256_dpbusd_avx_epi32(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(q, w));
}
inline vi dot4_times(vi acc, vi u, vi s, int c) {
  return _mm256_add_epi32(acc, _mm256_mullo_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s), _mm256_set1_epi32(c)));
}
inline vi run_scales(const int8_t* sc) {  // lanes 0-3 sc[0], 4-7 sc[1] as int32
  const __m256i two = _mm256_cvtepi8_epi32(_mm_cvtsi32_si128(static_cast<uint16_t>(load_i16(sc))));
  return _mm256_permutevar8x32_epi32(two, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}
inline vi dot4_scaled(vi acc, vi u, vi s, vi scales) {
  return _mm256_add_epi32(acc, _mm256_mullo_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s), scales));
}
#else
// acc holds int16 lanes (two per 32-bit lane): u <= 15, |s| <= 127, so a pair sum is at most
// 2 * 15 * 127 = 3810 and 8 of them 30480 < 2^15: no saturation, the sums stay exact.
inline vi dot4(vi acc, vi u, vi s) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s)); }
inline vi dsum(vi acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
// signed w and q (|q| <= 127): |w| x q * sign(w) in int16 pairs (at most 2 * 128 * 127 = 32512, no
// saturation), widened to int32 at once
inline vi dot4s(vi acc, vi w, vi q) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(q, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline vi dot4_times(vi acc, vi u, vi s, int c) {  // the int16 pair sums times c, widened in one vpmaddwd
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(static_cast<int16_t>(c))));
}
inline vi run_scales(const int8_t* sc) {  // int16 lanes 0-7 sc[0], 8-15 sc[1] (the pair sums of bytes 0-15, 16-31)
  const __m128i two = _mm_cvtsi32_si128(static_cast<uint16_t>(load_i16(sc)));
  return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(two, _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)));
}
inline vi dot4_scaled(vi acc, vi u, vi s, vi scales) {  // pair sums <= 2 * 63 * 127: exact in int16
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scales));
}
#endif
inline vf to_float(vi v) { return _mm256_cvtepi32_ps(v); }
inline void q5_codes(vi n, vi h, int o, vi& lo, vi& hi) {  // the fifth bits shifted to bit 4 (16-bit shifts:
  // what crosses from the neighbouring byte lands below bit 4 or above it)
  const vi m = _mm256_set1_epi8(0x0F), b4 = _mm256_set1_epi8(0x10);
  lo = _mm256_or_si256(_mm256_and_si256(n, m), _mm256_and_si256(_mm256_slli_epi16(h, 4 - o), b4));
  hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n, 4), m), _mm256_and_si256(_mm256_srli_epi16(h, o), b4));
}
inline vi bit_or_16(vi v, vi h, int mask) {
  const __m256i m = _mm256_set1_epi8(static_cast<char>(mask));
  return _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, m), m), _mm256_set1_epi8(0x10)));
}
inline vi q6_codes(const uint8_t* ql, const uint8_t* qh, int c) { return q6_codes_256(ql, qh, c); }

#elif TS_ISA_NEON
#if defined(__ARM_FEATURE_DOTPROD)
constexpr const char* kName = "neon-dotprod";
#else
constexpr const char* kName = "neon";
#endif
using vf = float32x4_t;
using vi = int32x4_t;
constexpr int kW = 4, kI = 4, kMaxRows = 8, kRegs = 32;
constexpr bool kPrefetchInt4 = false;  // the W4A8 prefetch (cpu_kernels.cpp): untimed, no ARM machine here
inline vf zero() { return vdupq_n_f32(0.f); }
inline vf set1(float a) { return vdupq_n_f32(a); }
inline vf load(const float* p) { return vld1q_f32(p); }
inline void store(float* p, vf v) { vst1q_f32(p, v); }
inline vf add(vf a, vf b) { return vaddq_f32(a, b); }
inline vf sub(vf a, vf b) { return vsubq_f32(a, b); }
inline vf mul(vf a, vf b) { return vmulq_f32(a, b); }
inline vf div(vf a, vf b) { return vdivq_f32(a, b); }
inline vf max(vf a, vf b) { return vmaxq_f32(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
inline float reduce_add(vf v) { return vaddvq_f32(v); }
inline float reduce_max(vf v) { return vmaxvq_f32(v); }
inline vf round(vf v) { return vrndnq_f32(v); }
inline vf scale_pow2(vf p, vf n) {
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(p, vreinterpretq_f32_s32(e));
}
inline vf load_bf16(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
inline vf load_half(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
inline float half_scalar(uint16_t h) { return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0); }
inline vf load_s8(const int8_t* p) {
  return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(load_i32(p)))))));
}
inline void store_half(uint16_t* p, vf v) { vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(v))); }
inline void hsum4(vf a, vf b, vf c, vf d, float* out) {
  vst1q_f32(out, vpaddq_f32(vpaddq_f32(a, b), vpaddq_f32(c, d)));
}
inline vi izero() { return vdupq_n_s32(0); }
inline vi iload(const uint8_t* p) { return vreinterpretq_s32_u8(vld1q_u8(p)); }
inline vi nibbles_lo(vi v) { return vreinterpretq_s32_u8(vandq_u8(vreinterpretq_u8_s32(v), vdupq_n_u8(0x0F))); }
inline vi nibbles_hi(vi v) { return vreinterpretq_s32_u8(vshrq_n_u8(vreinterpretq_u8_s32(v), 4)); }
inline vi bcast4(int32_t q) { return vdupq_n_s32(q); }
constexpr int kGroupBytes = 16;
inline vi iload_s8(const int8_t* p) { return vreinterpretq_s32_s8(vld1q_s8(p)); }
// acc[lane] += sum_b w[lane, b] * q[lane, b] over its 4 bytes, both signed
#if defined(__ARM_FEATURE_DOTPROD)
inline vi dot4s(vi acc, vi w, vi q) { return vdotq_s32(acc, vreinterpretq_s8_s32(w), vreinterpretq_s8_s32(q)); }
#else
inline vi dot4s(vi acc, vi w, vi q) {  // products of at most 128 * 128 fit int16
  const int8x16_t a = vreinterpretq_s8_s32(w), b = vreinterpretq_s8_s32(q);
  const int32x4_t lo = vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)));
  const int32x4_t hi = vpaddlq_s16(vmull_high_s8(a, b));
  return vaddq_s32(acc, vpaddq_s32(lo, hi));
}
#endif
inline vi dot4(vi acc, vi u, vi s) { return dot4s(acc, u, s); }  // codes 0..15 are valid signed bytes
inline vi dsum(vi acc) { return acc; }
inline vi dot4_times(vi acc, vi u, vi s, int c) { return vmlaq_n_s32(acc, dot4(izero(), u, s), c); }
inline vf to_float(vi v) { return vcvtq_f32_s32(v); }
inline void q5_codes(vi n, vi h, int o, vi& lo, vi& hi) {  // bytewise shifts of the fifth bits to bit 4
  const uint8x16_t v = vreinterpretq_u8_s32(n), hb = vreinterpretq_u8_s32(h), b4 = vdupq_n_u8(0x10);
  lo = vreinterpretq_s32_u8(vorrq_u8(vandq_u8(v, vdupq_n_u8(0x0F)), vandq_u8(vshlq_u8(hb, vdupq_n_s8(static_cast<int8_t>(4 - o))), b4)));
  hi = vreinterpretq_s32_u8(vorrq_u8(vshrq_n_u8(v, 4), vandq_u8(vshlq_u8(hb, vdupq_n_s8(static_cast<int8_t>(-o))), b4)));
}
inline vi bit_or_16(vi v, vi h, int mask) {
  const uint8x16_t set = vtstq_u8(vreinterpretq_u8_s32(h), vdupq_n_u8(static_cast<uint8_t>(mask)));
  return vreinterpretq_s32_u8(vorrq_u8(vreinterpretq_u8_s32(v), vandq_u8(set, vdupq_n_u8(0x10))));
}
inline vi q6_codes(const uint8_t* ql, const uint8_t* qh, int c) {
  const uint8x16_t l = vld1q_u8(ql), h = vld1q_u8(qh);
  const uint8x16_t lo = c & 2 ? vshrq_n_u8(l, 4) : vandq_u8(l, vdupq_n_u8(0x0F));
  const uint8x16_t hi = vshlq_u8(h, vdupq_n_s8(static_cast<int8_t>(4 - 2 * c)));  // bytewise; right for c = 3
  return vreinterpretq_s32_u8(vorrq_u8(lo, vandq_u8(hi, vdupq_n_u8(0x30))));
}
inline vi run_scales(const int8_t* sc) { return vdupq_n_s32(sc[0]); }  // 16 bytes: one run
inline vi dot4_scaled(vi acc, vi u, vi s, vi scales) { return vmlaq_s32(acc, dot4(izero(), u, s), scales); }

#else  // generic: one-lane "vectors"
constexpr const char* kName = "generic";
using vf = float;
using vi = int32_t;
constexpr int kW = 1, kI = 1, kMaxRows = 4, kRegs = 256;
constexpr bool kPrefetchInt4 = false;  // the W4A8 prefetch (cpu_kernels.cpp): not a bandwidth-bound family
inline vf zero() { return 0.f; }
inline vf set1(float a) { return a; }
inline vf load(const float* p) { return *p; }
inline void store(float* p, vf v) { *p = v; }
inline vf add(vf a, vf b) { return a + b; }
inline vf sub(vf a, vf b) { return a - b; }
inline vf mul(vf a, vf b) { return a * b; }
inline vf div(vf a, vf b) { return a / b; }
inline vf max(vf a, vf b) { return a > b ? a : b; }
inline vf fmadd(vf a, vf b, vf c) { return __builtin_fmaf(a, b, c); }
inline float reduce_add(vf v) { return v; }
inline float reduce_max(vf v) { return v; }
inline vf round(vf v) { return std::nearbyint(v); }
inline vf scale_pow2(vf p, vf n) { return std::ldexp(p, static_cast<int>(n)); }
inline vf load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
inline vf load_half(const uint16_t* p) { return half_to_float(*p); }
inline float half_scalar(uint16_t h) { return half_to_float(h); }
inline vf load_s8(const int8_t* p) { return static_cast<float>(*p); }
inline void store_half(uint16_t* p, vf v) { *p = half_from_float(v); }
inline void hsum4(vf a, vf b, vf c, vf d, float* out) { out[0] = a, out[1] = b, out[2] = c, out[3] = d; }
inline vi izero() { return 0; }
inline vi iload(const uint8_t* p) { return load_i32(p); }
inline vi nibbles_lo(vi v) { return v & 0x0F0F0F0F; }
inline vi nibbles_hi(vi v) { return static_cast<int32_t>(static_cast<uint32_t>(v) >> 4) & 0x0F0F0F0F; }
inline vi bcast4(int32_t q) { return q; }
inline vi dot4(vi acc, vi u, vi s) {
  for (int b = 0; b < 4; ++b)
    acc += static_cast<int32_t>((static_cast<uint32_t>(u) >> (8 * b)) & 0xFF) *
           static_cast<int8_t>((static_cast<uint32_t>(s) >> (8 * b)) & 0xFF);
  return acc;
}
inline vi dsum(vi acc) { return acc; }
inline vi dot4_times(vi acc, vi u, vi s, int c) { return acc + c * dot4(0, u, s); }
inline vf to_float(vi v) { return static_cast<float>(v); }
constexpr int kGroupBytes = 4;
inline vi iload_s8(const int8_t* p) { return load_i32(p); }
inline vi dot4s(vi acc, vi w, vi q) {
  for (int b = 0; b < 4; ++b)
    acc += static_cast<int8_t>((static_cast<uint32_t>(w) >> (8 * b)) & 0xFF) *
           static_cast<int8_t>((static_cast<uint32_t>(q) >> (8 * b)) & 0xFF);
  return acc;
}
inline void q5_codes(vi n, vi h, int o, vi& lo, vi& hi) {  // 32-bit shifts: what crosses bytes misses bit 4
  const uint32_t v = static_cast<uint32_t>(n), b = static_cast<uint32_t>(h);
  lo = static_cast<int32_t>((v & 0x0F0F0F0Fu) | ((b << (4 - o)) & 0x10101010u));
  hi = static_cast<int32_t>(((v >> 4) & 0x0F0F0F0Fu) | ((b >> o) & 0x10101010u));
}
inline vi bit_or_16(vi v, vi h, int mask) {
  uint32_t out = static_cast<uint32_t>(v);
  for (int b = 0; b < 4; ++b)
    if ((static_cast<uint32_t>(h) >> (8 * b)) & static_cast<uint32_t>(mask)) out |= 0x10u << (8 * b);
  return static_cast<int32_t>(out);
}
inline vi q6_codes(const uint8_t* ql, const uint8_t* qh, int c) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(((ql[i] >> (4 * (c >> 1))) & 15) | ((qh[i] >> (2 * c)) & 3) << 4) << (8 * i);
  return static_cast<int32_t>(v);
}
inline vi run_scales(const int8_t* sc) { return sc[0]; }
inline vi dot4_scaled(vi acc, vi u, vi s, vi scales) { return acc + scales * dot4(0, u, s); }
#endif

#if !TS_ISA_AVX512
constexpr int kVecGroups = 1;
template <int NG>
inline vi iload_groups(const int8_t* p) { return iload_s8(p); }
template <int NG>
inline vi join_groups(const vi* v) { return v[0]; }
constexpr int32_t kW8Offset = 0;  // W8A8: the signed weights as they are, dot4s
inline vi w8_prep(vi w) { return w; }
inline vi dot4w(vi acc, vi w, vi q) { return dot4s(acc, w, q); }
#endif

#if TS_ISA_AVX2 && !defined(__AVXVNNI__)
inline vi dot8u(vi acc, vi u0, vi s0, vi u1, vi s1) {  // the int16 pair sums of both runs, widened once
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#else
inline vi dot8u(vi acc, vi u0, vi s0, vi u1, vi s1) { return dot4(dot4(acc, u0, s0), u1, s1); }  // int32 lanes
#endif

// e^x for x <= 0 (softmax; below -87 it returns ~1e-38): Cody-Waite range reduction x = n ln2 + r
// and the Cephes expf polynomial on r, scaled by 2^n; relative error ~1e-7 (as std::exp in fp32).
inline vf exp_neg(vf x) {
  x = max(x, set1(-87.f));
  const vf n = round(mul(x, set1(1.44269504088896341f)));
  vf r = fmadd(n, set1(-0.693359375f), x);
  r = fmadd(n, set1(2.12194440e-4f), r);
  vf p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  p = fmadd(p, mul(r, r), add(r, set1(1.f)));
  return scale_pow2(p, n);
}

}  // namespace isa
}  // namespace ts
