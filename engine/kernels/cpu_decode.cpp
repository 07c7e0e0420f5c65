// Fused CPU decode step for tokenspeed.model.Transformer (see cpu_decode.py for the contract).
//
// One call runs every decoder layer for T (few) new tokens: RMSNorm, QKV projection, rotary
// embedding, KV-cache write, grouped-query attention over the cached prefix (causal among the
// new tokens), output projection, SwiGLU MLP and both residual adds. The projections call the
// same kernels as the Python path (int4_matmul and int8_gemv below, fp32 GEMM); the elementwise work runs as
// plain loops here, so a token costs a few ATen dispatches per layer instead of ~190 Python-level
// ops. The GIL is released for the whole call.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

enum Kind : int64_t { kDense = 0, kInt8 = 1, kInt4 = 2 };

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float acc = 0.f;
#if defined(__AVX512F__)
  __m512 v = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) v = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), v);
  acc = _mm512_reduce_add_ps(v);
#endif
  for (; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float a, const float* x, float* y, int64_t n) {  // y += a * x
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

#if defined(__AVX512F__)
// The four horizontal sums of a, b, c, d.
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  auto half = [](__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  };
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half(a), half(b)), _mm256_hadd_ps(half(c), half(d)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// e^x (x <= 0 in softmax; below -87 it returns ~1e-38): Cody-Waite range reduction x = n ln2 + r and
// the Cephes expf polynomial on r, scaled by 2^n; relative error ~1e-7 (as std::exp in fp32).
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// s[r, j] = q_r . k_j for R query rows q [R, 16 C] and the n cached keys k [n, 16 C]; row r of s
// starts at s + r * ld. Each block of 4 keys is loaded once for all rows, and every score is one
// lane of `hsum4` wherever it falls, so a row's scores do not depend on R or n.
template <int C>
void scores_rows(const float* q, int64_t R, const float* k, float* s, int64_t ld, int64_t n) {
  constexpr int64_t D = 16 * C;
  const __m512 z = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    __m512 kv[4][C];
    for (int i = 0; i < 4; ++i)
      for (int c = 0; c < C; ++c) kv[i][c] = _mm512_loadu_ps(k + (j + i) * D + 16 * c);
    for (int64_t r = 0; r < R; ++r) {
      const float* qr = q + r * D;
      __m512 p[4];
      for (int i = 0; i < 4; ++i) {
        p[i] = _mm512_mul_ps(_mm512_loadu_ps(qr), kv[i][0]);
        for (int c = 1; c < C; ++c) p[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * c), kv[i][c], p[i]);
      }
      _mm_storeu_ps(s + r * ld + j, hsum4(p[0], p[1], p[2], p[3]));
    }
  }
  for (; j < n; ++j)
    for (int64_t r = 0; r < R; ++r) {
      __m512 p = _mm512_mul_ps(_mm512_loadu_ps(q + r * D), _mm512_loadu_ps(k + j * D));
      for (int c = 1; c < C; ++c)
        p = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * D + 16 * c), _mm512_loadu_ps(k + j * D + 16 * c), p);
      s[r * ld + j] = _mm_cvtss_f32(hsum4(p, z, z, z));
    }
}

// o[r] = sum_j p[r, j] v_j for RR rows of weights p (row stride ld) over n cached values v [n, 16 C]:
// each value is loaded once for all rows, accumulators in registers, j in ascending order.
template <int C, int RR>
void weighted_block(const float* p, int64_t ld, const float* v, float* o, int64_t n) {
  __m512 acc[RR][C];
  for (int r = 0; r < RR; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m512 vj[C];
    for (int c = 0; c < C; ++c) vj[c] = _mm512_loadu_ps(v + (j * C + c) * 16);
    for (int r = 0; r < RR; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r * ld + j]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(pj, vj[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + (r * C + c) * 16, acc[r][c]);
}

template <int C>
void weighted_rows(const float* p, int64_t R, int64_t ld, const float* v, float* o, int64_t n) {
  constexpr int64_t D = 16 * C;
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) weighted_block<C, 4>(p + r * ld, ld, v, o + r * D, n);
  switch (R - r) {
    case 3: weighted_block<C, 3>(p + r * ld, ld, v, o + r * D, n); break;
    case 2: weighted_block<C, 2>(p + r * ld, ld, v, o + r * D, n); break;
    case 1: weighted_block<C, 1>(p + r * ld, ld, v, o + r * D, n); break;
    default: break;
  }
}
#endif

// s [R, ld] = q [R, D] k^T over the first n cached keys k [n, D].
void scores_of(const float* q, int64_t R, const float* k, float* s, int64_t ld, int64_t n, int64_t D) {
#if defined(__AVX512F__)
  switch (D) {
    case 16: return scores_rows<1>(q, R, k, s, ld, n);
    case 32: return scores_rows<2>(q, R, k, s, ld, n);
    case 64: return scores_rows<4>(q, R, k, s, ld, n);
    case 128: return scores_rows<8>(q, R, k, s, ld, n);
    default: break;
  }
#endif
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < n; ++j) s[r * ld + j] = dot(q + r * D, k + j * D, D);
}

// o [R, D] = p [R, ld] v over the first n cached values v [n, D].
void weighted_sum_of(const float* p, int64_t R, int64_t ld, const float* v, float* o, int64_t n, int64_t D) {
#if defined(__AVX512F__)
  switch (D) {
    case 16: return weighted_rows<1>(p, R, ld, v, o, n);
    case 32: return weighted_rows<2>(p, R, ld, v, o, n);
    case 64: return weighted_rows<4>(p, R, ld, v, o, n);
    case 128: return weighted_rows<8>(p, R, ld, v, o, n);
    default: break;
  }
#endif
  std::fill(o, o + R * D, 0.f);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < n; ++j) axpy(p[r * ld + j], v + j * D, o + r * D, D);
}

// s [n] (raw scores) -> softmax(scale * s) in place; returns the log-sum-exp of scale * s.
float softmax_row(float* s, int64_t n, float scale) {
  float m = -INFINITY, sum = 0.f;
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(-INFINITY), vs = _mm512_setzero_ps();
  const __m512 vscale = _mm512_set1_ps(scale);
  for (; j + 16 <= n; j += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + j), vscale);
    _mm512_storeu_ps(s + j, x);
    vm = _mm512_max_ps(vm, x);
  }
  m = _mm512_reduce_max_ps(vm);
#endif
  for (; j < n; ++j) { s[j] *= scale; m = std::max(m, s[j]); }
  j = 0;
#if defined(__AVX512F__)
  const __m512 vmax = _mm512_set1_ps(m);
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), vmax));
    _mm512_storeu_ps(s + j, e);
    vs = _mm512_add_ps(vs, e);
  }
  sum = _mm512_reduce_add_ps(vs);
#endif
  for (; j < n; ++j) { s[j] = std::exp(s[j] - m); sum += s[j]; }
  const float inv = 1.f / sum;
  for (j = 0; j < n; ++j) s[j] *= inv;
  return m + std::log(sum);
}

// y[t0 .. t0 + TT, j] for output rows [j0, j1): each weight row is converted to fp32 once per 16
// input channels for all TT activation rows (accumulators in registers).
template <int TT>
void int8_rows(const float* xp, const int8_t* wp, const float* sp, float* yp, int64_t t0, int64_t K, int64_t N,
               int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; ++j) {
    const int8_t* wr = wp + j * K;
    float a[TT];
    int64_t k = 0;
#if defined(__AVX512F__)
    __m512 acc[TT];
    for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) {
      const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k))));
      for (int t = 0; t < TT; ++t) acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + (t0 + t) * K + k), w, acc[t]);
    }
    for (int t = 0; t < TT; ++t) a[t] = _mm512_reduce_add_ps(acc[t]);
#else
    for (int t = 0; t < TT; ++t) a[t] = 0.f;
#endif
    for (int t = 0; t < TT; ++t) {
      for (int64_t kk = k; kk < K; ++kk) a[t] += xp[(t0 + t) * K + kk] * static_cast<float>(wr[kk]);
      yp[(t0 + t) * N + j] = a[t] * sp[j];
    }
  }
}

// y[t, j] = scales[j] * sum_k x[t, k] * w[j, k] for int8 w [N, K], fp32 x [T, K] and scales [N]
// (the lm_head: a memory-bound GEMV that reads the int8 weight once for all T rows).
at::Tensor int8_gemv(at::Tensor x, at::Tensor w, at::Tensor scales) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat,
              "int8_gemv needs fp32 x, int8 w, fp32 scales");
  x = x.contiguous();
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && w.is_contiguous(), "weight must be contiguous [N, K]");
  at::Tensor y = at::empty({T, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 256, [&](int64_t lo, int64_t hi) {
    int64_t t0 = 0;
    for (; t0 + 4 <= T; t0 += 4) int8_rows<4>(xp, wp, sp, yp, t0, K, N, lo, hi);
    switch (T - t0) {
      case 3: int8_rows<3>(xp, wp, sp, yp, t0, K, N, lo, hi); break;
      case 2: int8_rows<2>(xp, wp, sp, yp, t0, K, N, lo, hi); break;
      case 1: int8_rows<1>(xp, wp, sp, yp, t0, K, N, lo, hi); break;
      default: break;
    }
  });
  return y;
}

// ---- int4 weights x int8 activations (W4A8, the Q4_1 x Q8_1 scheme of GGML/llama.cpp)
//
// Weight: 4-bit codes c in 0..15 per group of 32 input channels, w[n, k] = c * s[n, g] + m[n, g].
// Layout (`pack_int4`): codes [N / 16, K / 8, 64] uint8: for output block nb (16 channels, one per
// 32-bit lane) and input octet o, lane j's 4 bytes hold channel nb * 16 + j's codes k = 8o + b in
// the low nibble and k = 8o + 4 + b in the high nibble (b = 0..3). Scales [N / 16, K / 32, 2, 16]
// bf16: s then m for the block's 16 channels. Activations: each row's groups of 32 are quantized
// to int8 with their own scale (q = round(x * 127 / max|x|), sx = max|x| / 127), so
// y[t, n] = sum_g s[n, g] * sx[t, g] * sum_k c * q + m[n, g] * sx[t, g] * sum_k q:
// the inner sums are exact int32 (AVX512-VNNI vpdpbusd, 64 multiply-adds per instruction) and the
// float accumulation runs in a fixed order, so a row's result does not depend on how many rows
// share the call (speculative verification == plain decoding, bit for bit).
constexpr int64_t kQGroup = 32;

struct QuantRows {  // activations [T, K] as int8 codes, per-group scale sx and sx * sum(q)
  std::vector<int8_t> q;
  std::vector<float> sx, xs;
};

QuantRows quantize_rows(const float* x, int64_t T, int64_t K) {
  const int64_t G = K / kQGroup;
  QuantRows r{std::vector<int8_t>(T * K), std::vector<float>(T * G), std::vector<float>(T * G)};
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + t * K + g * kQGroup;
      int8_t* qg = r.q.data() + t * K + g * kQGroup;
      float amax = 0.f;
      for (int64_t i = 0; i < kQGroup; ++i) amax = std::max(amax, std::fabs(xg[i]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int64_t i = 0; i < kQGroup; ++i) {
        qg[i] = static_cast<int8_t>(std::nearbyint(xg[i] * inv));
        sum += qg[i];
      }
      r.sx[t * G + g] = amax / 127.f;
      r.xs[t * G + g] = r.sx[t * G + g] * static_cast<float>(sum);
    }
  return r;
}

inline float bf16_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Rows t0 .. t0 + TT of y [T, N] for output blocks [nb0, nb1). TT is a template argument so the
// accumulators stay in registers.
template <int TT>
void int4_rows(const QuantRows& a, int64_t t0, const uint8_t* codes, const uint16_t* sm, float* y, int64_t K,
               int64_t N, int64_t nb0, int64_t nb1) {
  const int64_t G = K / kQGroup, O = K / 8;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    __m512 acc[TT];
    for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
    const uint8_t* cb = codes + nb * O * 64;
    const uint16_t* sb = sm + nb * G * 32;
    for (int64_t g = 0; g < G; ++g) {
      __m512i dot[TT];
      for (int t = 0; t < TT; ++t) dot[t] = _mm512_setzero_si512();
      for (int64_t o = 0; o < kQGroup / 8; ++o) {
        const __m512i v = _mm512_loadu_si512(cb + (g * (kQGroup / 8) + o) * 64);
        const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        const int64_t k = g * kQGroup + o * 8;
        for (int t = 0; t < TT; ++t) {
          const int8_t* q = a.q.data() + (t0 + t) * K + k;
          int32_t q0, q1;
          std::memcpy(&q0, q, 4);
          std::memcpy(&q1, q + 4, 4);
          dot[t] = _mm512_dpbusd_epi32(dot[t], lo, _mm512_set1_epi32(q0));
          dot[t] = _mm512_dpbusd_epi32(dot[t], hi, _mm512_set1_epi32(q1));
        }
      }
      const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + g * 32))), 16));
      const __m512 m = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + g * 32 + 16))), 16));
      for (int t = 0; t < TT; ++t) {
        const int64_t i = (t0 + t) * G + g;
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), _mm512_mul_ps(s, _mm512_set1_ps(a.sx[i])), acc[t]);
        acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.xs[i]), acc[t]);
      }
    }
    for (int t = 0; t < TT; ++t) _mm512_storeu_ps(y + (t0 + t) * N + nb * 16, acc[t]);
  }
#else  // portable path: the same integer sums and the same float operation order
  for (int64_t nb = nb0; nb < nb1; ++nb)
    for (int t = 0; t < TT; ++t)
      for (int j = 0; j < 16; ++j) {
        float acc = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          int32_t dot = 0;
          for (int64_t o = 0; o < kQGroup / 8; ++o) {
            const uint8_t* c = codes + (nb * O + g * (kQGroup / 8) + o) * 64 + j * 4;
            const int8_t* q = a.q.data() + (t0 + t) * K + g * kQGroup + o * 8;
            for (int b = 0; b < 4; ++b) dot += (c[b] & 0x0F) * q[b] + (c[b] >> 4) * q[b + 4];
          }
          const int64_t i = (t0 + t) * G + g;
          const float s = bf16_to_float(sm[(nb * G + g) * 32 + j]), m = bf16_to_float(sm[(nb * G + g) * 32 + 16 + j]);
          acc = std::fma(static_cast<float>(dot), s * a.sx[i], acc);
          acc = std::fma(m, a.xs[i], acc);
        }
        y[(t0 + t) * N + nb * 16 + j] = acc;
      }
#endif
}

// y [T, N] fp32 = x [T, K] fp32 times the W4A8 weight (codes, scales as described above).
at::Tensor int4_matmul(at::Tensor x, at::Tensor codes, at::Tensor scales) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && codes.scalar_type() == at::kByte &&
                  scales.scalar_type() == at::kBFloat16 && codes.dim() == 3 && scales.dim() == 4,
              "int4_matmul needs fp32 x, uint8 codes [N/16, K/8, 64] and bf16 scales [N/16, K/32, 2, 16]");
  x = x.contiguous();
  const int64_t T = x.size(0), K = x.size(1), NB = codes.size(0), N = NB * 16;
  TORCH_CHECK(codes.size(1) * 8 == K && scales.size(1) * kQGroup == K && codes.is_contiguous() && scales.is_contiguous(),
              "int4_matmul: weight does not match x's ", K, " input channels");
  at::Tensor y = at::empty({T, N}, x.options());
  const QuantRows a = quantize_rows(x.data_ptr<float>(), T, K);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, NB, 4, [&](int64_t nb0, int64_t nb1) {
    int64_t t0 = 0;
    for (; t0 + 8 <= T; t0 += 8) int4_rows<8>(a, t0, cp, sp, yp, K, N, nb0, nb1);
    switch (T - t0) {
      case 7: int4_rows<7>(a, t0, cp, sp, yp, K, N, nb0, nb1); break;
      case 6: int4_rows<6>(a, t0, cp, sp, yp, K, N, nb0, nb1); break;
      case 5: int4_rows<5>(a, t0, cp, sp, yp, K, N, nb0, nb1); break;
      case 4: int4_rows<4>(a, t0, cp, sp, yp, K, N, nb0, nb1); break;
      case 3: int4_rows<3>(a, t0, cp, sp, yp, K, N, nb0, nb1); break;
      case 2: int4_rows<2>(a, t0, cp, sp, yp, K, N, nb0, nb1); break;
      case 1: int4_rows<1>(a, t0, cp, sp, yp, K, N, nb0, nb1); break;
      default: break;
    }
  });
  return y;
}

// One projection: weight (dense [N, K] fp32, int8 [N, K], or int4 codes [N / 16, K / 8, 64]), its
// scales (int8: fp32 [N]; int4: bf16 [N / 16, K / 32, 2, 16]) and an optional bias [N] (empty if none).
struct Linear {
  at::Tensor weight, scales, bias;
  int64_t kind;
};

at::Tensor linear(const Linear& l, const at::Tensor& x) {
  // x: [T, K] fp32 -> [T, N] fp32
  at::Tensor y;
  if (l.kind == kInt4) {
    y = int4_matmul(x, l.weight, l.scales);
  } else if (l.kind == kInt8) {
    y = int8_gemv(x, l.weight, l.scales);
  } else {
    y = at::linear(x, l.weight);
  }
  if (l.bias.numel()) y.add_(l.bias);
  return y;
}

// out[t, :] = w * x[t, :] / sqrt(mean(x[t, :]^2) + eps)  (fp32, as Hugging Face LlamaRMSNorm)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t T = x.size(0), D = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* r = xp + t * D;
    float ss = 0.f;
    for (int64_t i = 0; i < D; ++i) ss += r[i] * r[i];
    const float inv = 1.f / std::sqrt(ss / D + static_cast<float>(eps));
    for (int64_t i = 0; i < D; ++i) op[t * D + i] = wp[i] * (r[i] * inv);
  }
  return out;
}

// Rotate one head vector s [D] into d [D] by cos/sin [D], "rotate half" layout.
inline void rope(const float* s, float* d, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    d[i] = s[i] * cos[i] - s[i + half] * sin[i];
    d[i + half] = s[i + half] * cos[i + half] + s[i] * sin[i + half];
  }
}

}  // namespace

// h: [T, dim] fp32 embeddings of the new tokens (updated in place and returned: the hidden
// states after the last layer, before the final norm). cos/sin: [T, head_dim] fp32.
// k_cache/v_cache: [L, 1, Hkv, capacity, head_dim] fp32; slots [start, start + T) are written.
// linears: 4 per layer (wqkv, wo, w13, w2), each as 3 tensors + kind (see Linear).
// track: also return, per layer, the attention mass per slot (softmax probability summed over
// heads and new tokens) [L, start + T], the log-sum-exp of the scaled scores [L, H, T] and the
// rotated queries [L, H, T, D] (for KV relevance scoring); otherwise these are empty.
std::vector<at::Tensor> decode_layers(at::Tensor h, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> tensors,
                         std::vector<int64_t> kinds, std::vector<at::Tensor> norms, at::Tensor k_cache,
                         at::Tensor v_cache, int64_t start, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                         int64_t hidden, double eps, bool track) {
  const int64_t L = k_cache.size(0), T = h.size(0), D = head_dim, H = n_heads, Hkv = n_kv_heads;
  const int64_t G = H / Hkv, end = start + T, cap = k_cache.size(3);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  TORCH_CHECK(h.is_contiguous() && h.scalar_type() == at::kFloat, "h must be contiguous fp32");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "KV cache must be contiguous fp32");
  TORCH_CHECK(end <= cap, "KV cache full");
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == L * 12 && static_cast<int64_t>(norms.size()) == L * 2,
              "expected 12 tensors and 2 norms per layer");
  std::vector<Linear> lin(L * 4);
  for (int64_t i = 0; i < L * 4; ++i) lin[i] = Linear{tensors[3 * i], tensors[3 * i + 1], tensors[3 * i + 2], kinds[i]};
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::Tensor q_all = at::empty({track ? L : 1, H, T, D}, h.options());  // rotated queries, head-major
  at::Tensor mass = track ? at::zeros({L, end}, h.options()) : at::empty({0}, h.options());
  at::Tensor lse = at::empty({track ? L : 0, H, T}, h.options());
  at::Tensor att = at::empty({T, H * D}, h.options());     // attention output, token-major
  const int64_t R = G * T;
  at::Tensor scores = at::empty({H * T, end}, h.options());  // [Hkv, R, end]
  at::Tensor ctx = at::empty({H * T, D}, h.options());       // [Hkv, R, D]
  for (int64_t l = 0; l < L; ++l) {
    // --- attention
    at::Tensor q = q_all[track ? l : 0];
    at::Tensor qkv = linear(lin[4 * l], rms_norm(h, norms[2 * l], eps)).contiguous();  // [T, (H+2Hkv)D]
    const float* qp = qkv.data_ptr<float>();
    float* kc = k_cache.data_ptr<float>() + l * Hkv * cap * D;
    float* vc = v_cache.data_ptr<float>() + l * Hkv * cap * D;
    const int64_t row = (H + 2 * Hkv) * D;
    for (int64_t t = 0; t < T; ++t) {
      const float* r = qp + t * row;
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      for (int64_t hh = 0; hh < H; ++hh) rope(r + hh * D, q.data_ptr<float>() + (hh * T + t) * D, D, c, s);
      for (int64_t g = 0; g < Hkv; ++g) {
        rope(r + (H + g) * D, kc + (g * cap + start + t) * D, D, c, s);
        std::memcpy(vc + (g * cap + start + t) * D, r + (H + Hkv + g) * D, D * sizeof(float));
      }
    }
    // per KV head g: its G query heads x T new tokens form R = G * T rows q_g [R, D] (row
    // r = head-in-group * T + token); scores [R, end] = q_g k_g^T, softmax over each row's visible
    // slots (cached ones, then causal among the new tokens), out [R, D] = p v_g.
    const float* qh = q.data_ptr<float>();
    float* sc = scores.data_ptr<float>();
    float* cx = ctx.data_ptr<float>();
    float* ap = att.data_ptr<float>();
    at::parallel_for(0, Hkv, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const float* qg = qh + g * R * D;
        const float* kg = kc + g * cap * D;
        const float* vg = vc + g * cap * D;
        float* sg = sc + g * R * end;
        float* og = cx + g * R * D;
        // Each row scores every slot (the softmax keeps its visible ones, the rest weigh 0), each
        // key and value is read once for all rows, and a row's result does not depend on R.
        scores_of(qg, R, kg, sg, end, end, D);
        for (int64_t r = 0; r < R; ++r) {
          const int64_t visible = start + r % T + 1;
          float* srow = sg + r * end;
          const float row_lse = softmax_row(srow, visible, scale);
          std::fill(srow + visible, srow + end, 0.f);
          if (track) lse.data_ptr<float>()[(l * H + g * G + r / T) * T + r % T] = row_lse;
        }
        weighted_sum_of(sg, R, end, vg, og, end, D);
        for (int64_t r = 0; r < R; ++r)  // to token-major [T, H * D]
          std::memcpy(ap + (r % T) * H * D + (g * G + r / T) * D, og + r * D, D * sizeof(float));
      }
    });
    if (track) {
      float* mp = mass.data_ptr<float>() + l * end;
      for (int64_t r = 0; r < H * T; ++r) {
        const float* srow = sc + r * end;
        for (int64_t j = 0, visible = start + r % T + 1; j < visible; ++j) mp[j] += srow[j];
      }
    }
    h.add_(linear(lin[4 * l + 1], att));
    // --- SwiGLU MLP
    at::Tensor gu = linear(lin[4 * l + 2], rms_norm(h, norms[2 * l + 1], eps)).contiguous();  // [T, 2F]
    at::Tensor act = at::empty({T, hidden}, h.options());
    const float* gp = gu.data_ptr<float>();
    float* xp = act.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < hidden; ++i) {
        const float gate = gp[t * 2 * hidden + i];
        xp[t * hidden + i] = gate / (1.f + std::exp(-gate)) * gp[t * 2 * hidden + hidden + i];
      }
    h.add_(linear(lin[4 * l + 3], act));
  }
  if (!track) return {h, mass, lse, at::empty({0}, h.options())};
  return {h, mass, lse, q_all};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_layers", &decode_layers, "fused decoder layers for a few new tokens",
        py::call_guard<py::gil_scoped_release>());
  m.def("int4_matmul", &int4_matmul, "int4 weight x int8-quantized activations (W4A8)",
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_gemv", &int8_gemv, "int8 weight x fp32 activations (lm_head)", py::call_guard<py::gil_scoped_release>());
}
