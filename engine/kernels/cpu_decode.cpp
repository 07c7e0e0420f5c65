// Fused CPU decode step for tokenspeed.model.Transformer (see cpu_decode.py for the contract).
//
// One call runs every decoder layer for T (few) new tokens: RMSNorm, QKV projection, rotary
// embedding, KV-cache write, grouped-query attention over the cached prefix (causal among the
// new tokens), output projection, SwiGLU MLP and both residual adds. The projections call the
// same kernels as the Python path (packed int4, int8_gemv below, fp32); the elementwise work runs as
// plain loops here, so a token costs a few ATen dispatches per layer instead of ~190 Python-level
// ops. The GIL is released for the whole call.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
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

// fp32 [T, K] -> bf16 [T, K] (round to nearest even, as torch's .to(torch.bfloat16))
at::Tensor to_bf16(const at::Tensor& x) {
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  const float* xp = x.data_ptr<float>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  for (int64_t i = 0, n = x.numel(); i < n; ++i) yp[i] = c10::BFloat16(xp[i]);
  return y;
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
    for (int64_t j = lo; j < hi; ++j) {
      const int8_t* wr = wp + j * K;
      for (int64_t t = 0; t < T; ++t) {
        const float* xr = xp + t * K;
        int64_t k = 0;
        float acc = 0.f;
#if defined(__AVX512F__)
        __m512 a = _mm512_setzero_ps();
        for (; k + 16 <= K; k += 16) {
          __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k));
          a = _mm512_fmadd_ps(_mm512_loadu_ps(xr + k), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), a);
        }
        acc = _mm512_reduce_add_ps(a);
#endif
        for (; k < K; ++k) acc += xr[k] * static_cast<float>(wr[k]);
        yp[t * N + j] = acc * sp[j];
      }
    }
  });
  return y;
}

// One projection: weight (dense [N, K] fp32, int8 [N, K], or int4-packed), its scales
// (int8: fp32 [N]; int4: bf16 [K / group, N, 2]) and an optional bias [N] (empty if none).
struct Linear {
  at::Tensor weight, scales, bias;
  int64_t kind, group;
};

at::Tensor linear(const Linear& l, const at::Tensor& x) {
  // x: [T, K] fp32 -> [T, N] fp32
  at::Tensor y;
  if (l.kind == kInt4) {
    y = at::_weight_int4pack_mm_for_cpu(to_bf16(x), l.weight, l.group, l.scales).to(at::kFloat);
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
// linears: 4 per layer (wqkv, wo, w13, w2), each as 3 tensors + kind + group (see Linear).
// track: also return, per layer, the attention mass per slot (softmax probability summed over
// heads and new tokens) [L, start + T], the log-sum-exp of the scaled scores [L, H, T] and the
// rotated queries [L, H, T, D] (for KV relevance scoring); otherwise these are empty.
// mm_rows: attention rows per KV head (query heads per KV head x T) from which ATen's GEMM is used.
std::vector<at::Tensor> decode_layers(at::Tensor h, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> tensors,
                         std::vector<int64_t> kinds, std::vector<at::Tensor> norms, at::Tensor k_cache,
                         at::Tensor v_cache, int64_t start, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                         int64_t hidden, int64_t group, double eps, bool track,
                         int64_t mm_rows) {
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
  for (int64_t i = 0; i < L * 4; ++i) lin[i] = Linear{tensors[3 * i], tensors[3 * i + 1], tensors[3 * i + 2], kinds[i], group};
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
    // slots (cached ones, then causal among the new tokens), out [R, D] = p v_g. Blocks of at least
    // mm_rows rows go to ATen's GEMM; fewer rows (decode) to plain loops, which read the cache once
    // without the GEMM's call and packing overhead.
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
        const bool gemm = R >= mm_rows;
        if (gemm) {
          at::Tensor S = at::from_blob(sg, {R, end}, h.options());
          at::mm_out(S, at::from_blob(const_cast<float*>(qg), {R, D}, h.options()),
                     at::from_blob(const_cast<float*>(kg), {end, D}, h.options()).t());
        } else {
          for (int64_t r = 0; r < R; ++r)
            for (int64_t j = 0, visible = start + r % T + 1; j < visible; ++j)
              sg[r * end + j] = dot(qg + r * D, kg + j * D, D);
        }
        for (int64_t r = 0; r < R; ++r) {
          float* srow = sg + r * end;
          const int64_t visible = start + r % T + 1;
          float m = -INFINITY;
          for (int64_t j = 0; j < visible; ++j) { srow[j] *= scale; m = std::max(m, srow[j]); }
          float sum = 0.f;
          for (int64_t j = 0; j < visible; ++j) { srow[j] = std::exp(srow[j] - m); sum += srow[j]; }
          const float inv = 1.f / sum;
          for (int64_t j = 0; j < visible; ++j) srow[j] *= inv;
          std::fill(srow + visible, srow + end, 0.f);
          if (track) lse.data_ptr<float>()[(l * H + g * G + r / T) * T + r % T] = m + std::log(sum);
        }
        if (gemm) {
          at::Tensor O = at::from_blob(og, {R, D}, h.options());
          at::mm_out(O, at::from_blob(sg, {R, end}, h.options()),
                     at::from_blob(const_cast<float*>(vg), {end, D}, h.options()));
        } else {
          std::fill(og, og + R * D, 0.f);
          for (int64_t r = 0; r < R; ++r)
            for (int64_t j = 0, visible = start + r % T + 1; j < visible; ++j)
              axpy(sg[r * end + j], vg + j * D, og + r * D, D);
        }
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
  m.def("int8_gemv", &int8_gemv, "int8 weight x fp32 activations (lm_head)", py::call_guard<py::gil_scoped_release>());
}
