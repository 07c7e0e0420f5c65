// Fused CPU decode step for tokenspeed.model.Transformer (see cpu_decode.py for the contract).
//
// One call runs every decoder layer for T (few) new tokens: RMSNorm, QKV projection, per-head Q/K
// RMSNorm (Qwen3), rotary embedding (skipped in SmolLM3's NoPE layers), KV-cache write,
// grouped-query attention over the cached prefix (causal among the new tokens), output projection,
// SwiGLU MLP and both residual adds. The projections call the same kernels as the Python path
// (int4_matmul, int8_gemv and block_gemv below, fp32 GEMM); the elementwise work runs as plain loops here, so a
// token costs a few ATen dispatches per layer instead of ~190 Python-level ops. The GIL is released
// for the whole call. The numerical kernels live in the torch-free core (cpu_kernels.h, compiled
// per instruction-set family); this file binds them to torch and splits their work over torch's
// threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"

namespace {

// kBlocks + a ggml type number: a GGUF file's blocks of that type (block_gemv as stored; Q5_0, kQ5_0,
// interleaved by 16 rows: q5_0_gemv)
enum Kind : int64_t { kDense = 0, kInt8 = 1, kInt4 = 2, kBlocks = 16, kQ5_0 = kBlocks + 6 };
constexpr int64_t kAttendRows = 64;  // query rows per parallel attention work item
constexpr int64_t kBurstRows = 16;   // calls of at least this many rows (prefill bursts) use every torch thread

// at::parallel_for's grain over n items: `grain` for a burst of T rows, n (one thread, no fork)
// for fewer rows: a decode step stays on the calling thread, free of barrier waits.
inline int64_t grain_for(int64_t T, int64_t n, int64_t grain) { return T >= kBurstRows ? grain : std::max<int64_t>(n, 1); }

// y [T, NB * 16] fp32 for x [T, K] fp32 and a weight interleaved by 16 output rows of Kp >= K input channels:
// x quantized to int8 per group of 32 (ts_int8_quantize), then rows(q, sx, qsum, y, nb0, nb1) over the NB blocks
// of 16 rows, split over torch's threads for a burst (a decode step stays on the calling thread).
template <typename Rows>
at::Tensor interleaved_gemv(const at::Tensor& x, int64_t Kp, int64_t NB, Rows&& rows) {
  const int64_t T = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({T, NB * 16}, x.options());
  std::vector<int8_t> q(T * Kp);
  std::vector<float> sx(T * Kp / 32);
  std::vector<int32_t> qsum(T * Kp / 32);
  ts_int8_quantize(x.data_ptr<float>(), T, K, Kp, q.data(), sx.data(), qsum.data());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, NB, grain_for(T, NB, 4), [&](int64_t lo, int64_t hi) { rows(q.data(), sx.data(), qsum.data(), yp, lo, hi); });
  return y;
}

}  // namespace

// y [T, N] fp32 = x [T, K] fp32 times int8 codes interleaved by 16 output rows, w [N / 16, Kp / 4, 64] with
// scales [N / 16, G, 16] (G = 1: one per row; G = Kp / 32: per 32 input channels, a GGUF file's Q8_0 blocks;
// layout: tokenspeed.quant.pack_int8, Kp the input channels padded to a multiple of 32, zero past K): W8A8, x
// quantized to int8 per group of 32 and multiplied in int32 (Q8_0 x Q8_0, see cpu_kernels.h); register tiles
// of row vectors x token rows that read the weight once per call. N counts the layout's rows (whole blocks).
at::Tensor int8_gemv(at::Tensor x, at::Tensor w, at::Tensor scales) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat &&
                  w.dim() == 3 && scales.dim() == 3,
              "int8_gemv needs fp32 x, int8 w [N/16, K/4, 64] and fp32 scales [N/16, G, 16]");
  x = x.contiguous();
  const int64_t T = x.size(0), K = x.size(1), NB = w.size(0), N = NB * 16, Kp = w.size(1) * 4, G = scales.size(1);
  TORCH_CHECK(w.size(2) == 64 && w.is_contiguous() && Kp % 32 == 0 && K <= Kp && Kp - K < 32,
              "int8_gemv: weight [", NB, ", ", w.size(1), ", ", w.size(2), "] does not fit x's ", K, " input channels");
  TORCH_CHECK(scales.is_contiguous() && scales.size(0) == NB && scales.size(2) == 16 && (G == 1 || G * 32 == Kp),
              "int8_gemv: scales must be contiguous [N/16, 1 or K/32, 16]");
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  return interleaved_gemv(x, Kp, NB, [&](const int8_t* q, const float* sx, const int32_t* qsum, float* y, int64_t lo,
                                         int64_t hi) { ts_int8_rows(q, sx, qsum, T, Kp, wp, sp, G, y, N, lo, hi); });
}

// y [T, N] fp32 = x [T, K] fp32 times a GGUF file's Q5_0 blocks interleaved by 16 output rows, blocks [N / 16,
// K / 32, 352] uint8 (layout: tokenspeed.quant.pack_q5_0; see cpu_kernels.h ts_q5_0_rows): W5A8, x quantized to
// int8 per group of 32 as for int8_gemv. N counts the layout's rows (whole blocks).
at::Tensor q5_0_gemv(at::Tensor x, at::Tensor blocks) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && blocks.scalar_type() == at::kByte && blocks.dim() == 3 &&
                  blocks.size(2) == 352 && blocks.is_contiguous(),
              "q5_0_gemv needs fp32 x and contiguous uint8 blocks [N/16, K/32, 352]");
  x = x.contiguous();
  const int64_t T = x.size(0), K = x.size(1), NB = blocks.size(0), N = NB * 16;
  TORCH_CHECK(blocks.size(1) * 32 == K, "q5_0_gemv: blocks of ", blocks.size(1) * 32, " input channels for x's ", K);
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  return interleaved_gemv(x, K, NB, [&](const int8_t* q, const float* sx, const int32_t* qsum, float* y, int64_t lo,
                                        int64_t hi) { ts_q5_0_rows(q, sx, qsum, T, K, bp, y, N, lo, hi); });
}

// y [T, N] fp32 = x [T, K] fp32 times a GGUF file's blocks as stored in block format `format` (a ggml
// type number: Q4_K, Q5_K or Q6_K, see cpu_kernels.h ts_block_format), blocks [N, K / values * bytes] uint8
// (x quantized to int8 per block of 256, see ts_block_quantize); threads split the output rows, a decode step
// stays on the calling thread.
at::Tensor block_gemv(at::Tensor x, at::Tensor blocks, int64_t format) {
  int64_t values = 0, bytes = 0, act_group = 0, aux_run = 0;
  TORCH_CHECK(ts_block_format(format, &values, &bytes, &act_group, &aux_run), "block_gemv: no kernel for ggml type ", format);
  TORCH_CHECK(x.scalar_type() == at::kFloat && blocks.scalar_type() == at::kByte && blocks.dim() == 2,
              "block_gemv needs fp32 x and uint8 blocks [N, K / ", values, " * ", bytes, "]");
  x = x.contiguous();
  const int64_t T = x.size(0), K = x.size(1), N = blocks.size(0);
  TORCH_CHECK(K % values == 0 && blocks.size(1) == K / values * bytes && blocks.is_contiguous(),
              "block_gemv: blocks must be contiguous [N, K / ", values, " * ", bytes, "] for x's ", K, " input channels");
  at::Tensor y = at::empty({T, N}, x.options());
  std::vector<int8_t> q(T * K);
  std::vector<float> sx(T * K / act_group), aux(T * K / aux_run);
  ts_block_quantize(format, x.data_ptr<float>(), T, K, q.data(), sx.data(), aux.data());
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, grain_for(T, N, 256), [&](int64_t lo, int64_t hi) {
    ts_block_rows(format, q.data(), sx.data(), aux.data(), T, K, bp, yp, N, lo, hi);
  });
  return y;
}

// y [T, N] fp32 = x [T, K] fp32 times the W4A8 weight: int4 codes [N / 16, K / 8, 64] uint8 and either bf16
// scales [N / 16, K / 32, 2, 16] or Q4_K's two-level scales [N / 16, K / 256, 320] uint8 (Q4_1 / Q4_K x Q8_1,
// see cpu_kernels.h).
at::Tensor int4_matmul(at::Tensor x, at::Tensor codes, at::Tensor scales) {
  const bool super = scales.scalar_type() == at::kByte;
  TORCH_CHECK(x.scalar_type() == at::kFloat && codes.scalar_type() == at::kByte && codes.dim() == 3 &&
                  (super ? scales.dim() == 3 : scales.scalar_type() == at::kBFloat16 && scales.dim() == 4),
              "int4_matmul needs fp32 x, uint8 codes [N/16, K/8, 64] and bf16 scales [N/16, K/32, 2, 16] or uint8 "
              "super-block scales [N/16, K/256, 320]");
  x = x.contiguous();
  const int64_t T = x.size(0), K = x.size(1), NB = codes.size(0), N = NB * 16;
  TORCH_CHECK(codes.size(1) * 8 == K && codes.is_contiguous() && scales.is_contiguous() && scales.size(0) == NB &&
                  (super ? scales.size(1) * 256 == K && scales.size(2) == 320 : scales.size(1) * 32 == K),
              "int4_matmul: weight does not match x's ", K, " input channels");
  at::Tensor y = at::empty({T, N}, x.options());
  std::vector<int8_t> q(T * K);
  std::vector<float> sx(T * K / 32), xs(T * K / 32);
  ts_quantize_rows(x.data_ptr<float>(), T, K, q.data(), sx.data(), xs.data());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (super) {
    const uint8_t* sp = scales.data_ptr<uint8_t>();
    at::parallel_for(0, NB, grain_for(T, NB, 4), [&](int64_t nb0, int64_t nb1) {
      ts_int4_super_rows(q.data(), sx.data(), xs.data(), T, K, cp, sp, yp, N, nb0, nb1);
    });
  } else {
    const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
    at::parallel_for(0, NB, grain_for(T, NB, 4), [&](int64_t nb0, int64_t nb1) {
      ts_int4_rows(q.data(), sx.data(), xs.data(), T, K, cp, sp, yp, N, nb0, nb1);
    });
  }
  return y;
}

namespace {

// One projection: weight (dense [N, K] fp32, int8 [N / 16, K / 4, 64], int4 codes [N / 16, K / 8, 64], a GGUF
// block format's blocks [N, K / values * bytes] uint8, or Q5_0's interleaved [N / 16, K / 32, 352]), its scales (int8: fp32 [N / 16, G, 16]; int4: bf16
// [N / 16, K / 32, 2, 16] or uint8 [N / 16, K / 256, 320]; blocks: none, they are in the blocks) and an optional bias [N] (empty if none).
struct Linear {
  at::Tensor weight, scales, bias;
  int64_t kind;
};

at::Tensor linear_part(const Linear& l, const at::Tensor& x) {
  // x: [T, K] fp32 -> [T, N] fp32
  at::Tensor y;
  if (l.kind == kInt4) {
    y = int4_matmul(x, l.weight, l.scales);
  } else if (l.kind == kInt8) {
    y = int8_gemv(x, l.weight, l.scales);
  } else if (l.kind == kQ5_0) {
    y = q5_0_gemv(x, l.weight);
  } else if (l.kind >= kBlocks) {
    y = block_gemv(x, l.weight, l.kind - kBlocks);
  } else {
    y = at::linear(x, l.weight);
  }
  if (l.bias.numel()) y.add_(l.bias);
  return y;
}

// One projection of one or more parts (a fused q/k/v whose tensors are in different formats): x [T, K] fp32 ->
// the parts' outputs side by side [T, N] fp32.
using Projection = std::vector<Linear>;

at::Tensor linear(const Projection& parts, const at::Tensor& x) {
  if (parts.size() == 1) return linear_part(parts[0], x);
  std::vector<at::Tensor> ys;
  for (const Linear& l : parts) ys.push_back(linear_part(l, x));
  return at::cat(ys, 1);
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

// One query or key head s [D] into d [D]: RMS-normalised and scaled by w [D] first when w is given
// (Qwen3's QK-norm, as rms_norm above), then rotated by cos/sin, or copied where the layer has no
// rotation (SmolLM3's NoPE layers). tmp: D floats of scratch.
inline void head_in(const float* s, float* d, int64_t D, const float* w, float eps, bool rotate, const float* cos,
                    const float* sin, float* tmp) {
  if (w) {
    float ss = 0.f;
    for (int64_t i = 0; i < D; ++i) ss += s[i] * s[i];
    const float inv = 1.f / std::sqrt(ss / D + eps);
    for (int64_t i = 0; i < D; ++i) tmp[i] = w[i] * (s[i] * inv);
    s = tmp;
  }
  if (rotate) {
    rope(s, d, D, cos, sin);
  } else {
    std::memcpy(d, s, D * sizeof(float));
  }
}

}  // namespace

// h: [T, dim] fp32 embeddings of the new tokens (updated in place and returned: the hidden
// states after the last layer, before the final norm). cos/sin: [T, head_dim] fp32.
// k_cache/v_cache: [L, 1, Hkv, capacity, head_dim] fp16 (the CPU default: each key and value
// rounded to nearest-even on write, read back exactly as fp32) or fp32; slots [start, start + T)
// are written.
// linears: 4 projections per layer (wqkv, wo, w13, w2) of parts[i] parts each (1, or more for a fused q/k/v in
// mixed formats), each part as 3 tensors + kind (see Linear).
// qk_norms: per layer the query and key heads' RMSNorm weights [head_dim] (Qwen3), or empty (none).
// rotates: per layer 1 if its queries and keys are rotated, 0 for a NoPE layer (SmolLM3).
// track: also return, per layer, the attention mass per slot (softmax probability summed over
// heads and new tokens) [L, start + T], the log-sum-exp of the scaled scores [L, H, T] and the
// rotated queries [L, H, T, D] (for KV relevance scoring); otherwise these are empty.
std::vector<at::Tensor> decode_layers(at::Tensor h, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> tensors,
                         std::vector<int64_t> kinds, std::vector<int64_t> parts, std::vector<at::Tensor> norms,
                         std::vector<at::Tensor> qk_norms,
                         std::vector<int64_t> rotates, at::Tensor k_cache, at::Tensor v_cache, int64_t start,
                         int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t hidden, double eps, bool track) {
  const int64_t L = k_cache.size(0), T = h.size(0), D = head_dim, H = n_heads, Hkv = n_kv_heads;
  const int64_t G = H / Hkv, end = start + T, cap = k_cache.size(3);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  TORCH_CHECK(h.is_contiguous() && h.scalar_type() == at::kFloat, "h must be contiguous fp32");
  const bool half = k_cache.scalar_type() == at::kHalf;
  TORCH_CHECK((half || k_cache.scalar_type() == at::kFloat) && v_cache.scalar_type() == k_cache.scalar_type() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "KV cache must be contiguous fp16 or fp32");
  TORCH_CHECK(end <= cap, "KV cache full");
  TORCH_CHECK(static_cast<int64_t>(parts.size()) == L * 4 && static_cast<int64_t>(norms.size()) == L * 2,
              "expected 4 projections and 2 norms per layer");
  int64_t n_parts = 0;
  for (int64_t n : parts) {
    TORCH_CHECK(n >= 1, "a projection needs a part");
    n_parts += n;
  }
  TORCH_CHECK(static_cast<int64_t>(kinds.size()) == n_parts && static_cast<int64_t>(tensors.size()) == 3 * n_parts,
              "expected 3 tensors and a kind per projection part");
  TORCH_CHECK((qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == L * 2) &&
                  static_cast<int64_t>(rotates.size()) == L,
              "expected 2 Q/K norms (or none) and a rotation flag per layer");
  std::vector<float> tmp(D), kv_row(D);
  std::vector<Projection> lin(L * 4);
  for (int64_t i = 0, j = 0; i < L * 4; ++i)
    for (int64_t n = 0; n < parts[i]; ++n, ++j)
      lin[i].push_back(Linear{tensors[3 * j], tensors[3 * j + 1], tensors[3 * j + 2], kinds[j]});
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
    TORCH_CHECK(qkv.size(1) == (H + 2 * Hkv) * D, "layer ", l, ": the q/k/v projection gives ", qkv.size(1),
                " outputs for ", (H + 2 * Hkv) * D);
    const float* qp = qkv.data_ptr<float>();
    // this layer's keys and values: fp32 (kc, vc) or half (kh, vh), [Hkv, cap, D]
    const int64_t layer_at = l * Hkv * cap * D;
    float* kc = half ? nullptr : k_cache.data_ptr<float>() + layer_at;
    float* vc = half ? nullptr : v_cache.data_ptr<float>() + layer_at;
    uint16_t* kh = half ? reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::Half>()) + layer_at : nullptr;
    uint16_t* vh = half ? reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::Half>()) + layer_at : nullptr;
    const int64_t row = (H + 2 * Hkv) * D;
    const float* qn = qk_norms.empty() ? nullptr : qk_norms[2 * l].data_ptr<float>();
    const float* kn = qk_norms.empty() ? nullptr : qk_norms[2 * l + 1].data_ptr<float>();
    const bool rot = rotates[l] != 0;
    const float fe = static_cast<float>(eps);
    for (int64_t t = 0; t < T; ++t) {
      const float* r = qp + t * row;
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      for (int64_t hh = 0; hh < H; ++hh)
        head_in(r + hh * D, q.data_ptr<float>() + (hh * T + t) * D, D, qn, fe, rot, c, s, tmp.data());
      for (int64_t g = 0; g < Hkv; ++g) {
        const int64_t slot = (g * cap + start + t) * D;
        const float* value = r + (H + Hkv + g) * D;
        if (half) {
          head_in(r + (H + g) * D, kv_row.data(), D, kn, fe, rot, c, s, tmp.data());
          ts_to_half(kv_row.data(), D, kh + slot);
          ts_to_half(value, D, vh + slot);
        } else {
          head_in(r + (H + g) * D, kc + slot, D, kn, fe, rot, c, s, tmp.data());
          std::memcpy(vc + slot, value, D * sizeof(float));
        }
      }
    }
    // per KV head g: its G query heads x T new tokens form R = G * T rows q_g [R, D] (row
    // r = head-in-group * T + token); scores [R, end] = q_g k_g^T, softmax over each row's visible
    // slots (cached ones, then causal among the new tokens), out [R, D] = p v_g.
    const float* qh = q.data_ptr<float>();
    float* sc = scores.data_ptr<float>();
    float* cx = ctx.data_ptr<float>();
    float* ap = att.data_ptr<float>();
    // work items: (KV head, tile of kAttendRows rows), so that a prefill burst splits over every thread
    const int64_t tiles = (R + kAttendRows - 1) / kAttendRows;
    at::parallel_for(0, Hkv * tiles, grain_for(T, Hkv * tiles, 1), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t g = i / tiles, r0 = (i % tiles) * kAttendRows, r1 = std::min(R, r0 + kAttendRows);
        float* lg = track ? lse.data_ptr<float>() + (l * H + g * G) * T : nullptr;  // [G, T] = rows r
        float* og = cx + g * R * D;
        if (half)
          ts_attend_rows_half(qh + g * R * D, T, start, kh + g * cap * D, vh + g * cap * D, D, scale, sc + g * R * end,
                              og, lg, r0, r1);
        else
          ts_attend_rows(qh + g * R * D, T, start, kc + g * cap * D, vc + g * cap * D, D, scale, sc + g * R * end, og,
                         lg, r0, r1);
        for (int64_t r = r0; r < r1; ++r)  // to token-major [T, H * D]
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
    TORCH_CHECK(gu.size(1) == 2 * hidden, "layer ", l, ": the gate/up projection gives ", gu.size(1), " outputs for ",
                2 * hidden);
    at::Tensor act = at::empty({T, hidden}, h.options());
    ts_swiglu(gu.data_ptr<float>(), T, hidden, act.data_ptr<float>());
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
  m.def("isa", [] { return std::string(ts_isa_name()); }, "the instruction-set family of this build");
  m.def("int8_gemv", &int8_gemv, "int8 weight x int8-quantized activations (W8A8)", py::call_guard<py::gil_scoped_release>());
  m.def("block_gemv", &block_gemv, "GGUF blocks as stored (Q4_K, Q5_K, Q6_K) x int8-quantized activations",
        py::call_guard<py::gil_scoped_release>());
  m.def("q5_0_gemv", &q5_0_gemv, "GGUF Q5_0 blocks interleaved by 16 rows x int8-quantized activations",
        py::call_guard<py::gil_scoped_release>());
}
