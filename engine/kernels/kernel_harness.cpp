// Runs the torch-free kernels of cpu_kernels.cpp on requests read from stdin, for tests that
// check a build without torch (other instruction-set variants; aarch64 under qemu-user).
// Request: int32 op, then its sizes (int64) and arrays (raw little-endian); the reply on stdout:
//   op 0 (name):   -> int32 length, the ISA family's name
//   op 1 (int4):   T K N, x [T, K] f32, codes [N/16, K/8, 64] u8, scales [N/16, K/32, 2, 16] u16 -> y [T, N] f32
//   op 2 (int8):   T K Kp N G, x [T, K] f32, w [N/16, Kp/4, 64] i8, scales [N/16, G, 16] f32 -> y [T, N] f32
//   op 3 (attend): R T start D, scale f32, q [R, D], k and v [start + T, D] f32
//                  -> scores [R, start + T], out [R, D], lse [R] f32
//   op 4 (attend over half K/V): as op 3 with k and v [start + T, D] as IEEE half bits (u16)
//   op 5 (to half): n, x [n] f32 -> y [n] u16 (IEEE half bits)
//   op 6 (blocks): format T K N, x [T, K] f32, blocks [N, K / values * bytes] u8 -> y [T, N] f32
//                  (format: a ggml type number, see ts_block_format)
//   op 7 (swiglu): T F, gu [T, 2F] f32 -> out [T, F] f32
//   op 8 (Q5_0):   T K N, x [T, K] f32, blocks [N/16, K/32, 352] u8 (interleaved) -> y [T, N] f32
//   op 9 (int4, Q4_K scales): T K N, x [T, K] f32, codes [N/16, K/8, 64] u8, scales [N/16, K/256, 320] u8
//                  -> y [T, N] f32
#include <cstdio>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"

namespace {

template <typename T>
std::vector<T> take(size_t n) {
  std::vector<T> v(n);
  if (n && std::fread(v.data(), sizeof(T), n, stdin) != n) throw 1;
  return v;
}

template <typename T>
void give(const std::vector<T>& v) {
  std::fwrite(v.data(), sizeof(T), v.size(), stdout);
}

int64_t size() { return take<int64_t>(1)[0]; }

}  // namespace

int main() {
  int32_t op;
  try {
    while (std::fread(&op, 4, 1, stdin) == 1) {
      if (op == 0) {
        const int32_t n = static_cast<int32_t>(std::strlen(ts_isa_name()));
        std::fwrite(&n, 4, 1, stdout);
        std::fwrite(ts_isa_name(), 1, n, stdout);
      } else if (op == 1 || op == 9) {
        const int64_t T = size(), K = size(), N = size();
        auto x = take<float>(T * K);
        auto codes = take<uint8_t>(N / 16 * K / 8 * 64);
        auto scales = take<uint8_t>(op == 1 ? N / 16 * K / 32 * 64 : N / 16 * K / 256 * 320);  // bytes
        std::vector<int8_t> q(T * K);
        std::vector<float> sx(T * K / 32), xs(T * K / 32), y(T * N);
        ts_quantize_rows(x.data(), T, K, q.data(), sx.data(), xs.data());
        if (op == 1)
          ts_int4_rows(q.data(), sx.data(), xs.data(), T, K, codes.data(), reinterpret_cast<const uint16_t*>(scales.data()),
                       y.data(), N, 0, N / 16);
        else
          ts_int4_super_rows(q.data(), sx.data(), xs.data(), T, K, codes.data(), scales.data(), y.data(), N, 0, N / 16);
        give(y);
      } else if (op == 2) {
        const int64_t T = size(), K = size(), Kp = size(), N = size(), G = size();
        auto x = take<float>(T * K);
        auto w = take<int8_t>(N * Kp);
        auto s = take<float>(N * G);
        std::vector<int8_t> q(T * Kp);
        std::vector<float> sx(T * Kp / 32), y(T * N);
        std::vector<int32_t> qsum(T * Kp / 32);
        ts_int8_quantize(x.data(), T, K, Kp, q.data(), sx.data(), qsum.data());
        ts_int8_rows(q.data(), sx.data(), qsum.data(), T, Kp, w.data(), s.data(), G, y.data(), N, 0, N / 16);
        give(y);
      } else if (op == 3 || op == 4) {
        const int64_t R = size(), T = size(), start = size(), D = size();
        const float scale = take<float>(1)[0];
        auto q = take<float>(R * D);
        std::vector<float> scores(R * (start + T)), out(R * D), lse(R);
        if (op == 3) {
          auto k = take<float>((start + T) * D);
          auto v = take<float>((start + T) * D);
          ts_attend(q.data(), R, T, start, k.data(), v.data(), D, scale, scores.data(), out.data(), lse.data());
        } else {
          auto k = take<uint16_t>((start + T) * D);
          auto v = take<uint16_t>((start + T) * D);
          ts_attend_rows_half(q.data(), T, start, k.data(), v.data(), D, scale, scores.data(), out.data(), lse.data(), 0,
                              R);
        }
        give(scores), give(out), give(lse);
      } else if (op == 5) {
        const int64_t n = size();
        auto x = take<float>(n);
        std::vector<uint16_t> y(n);
        ts_to_half(x.data(), n, y.data());
        give(y);
      } else if (op == 6) {
        const int64_t format = size(), T = size(), K = size(), N = size();
        int64_t values, bytes, act_group, aux_run;
        if (!ts_block_format(format, &values, &bytes, &act_group, &aux_run)) throw 1;
        auto x = take<float>(T * K);
        auto blocks = take<uint8_t>(N * K / values * bytes);
        std::vector<int8_t> q(T * K);
        std::vector<float> sx(T * K / act_group), aux(T * K / aux_run), y(T * N);
        ts_block_quantize(format, x.data(), T, K, q.data(), sx.data(), aux.data());
        ts_block_rows(format, q.data(), sx.data(), aux.data(), T, K, blocks.data(), y.data(), N, 0, N);
        give(y);
      } else if (op == 8) {
        const int64_t T = size(), K = size(), N = size();
        auto x = take<float>(T * K);
        auto blocks = take<uint8_t>(N / 16 * K / 32 * 352);
        std::vector<int8_t> q(T * K);
        std::vector<float> sx(T * K / 32), y(T * N);
        std::vector<int32_t> qsum(T * K / 32);
        ts_int8_quantize(x.data(), T, K, K, q.data(), sx.data(), qsum.data());
        ts_q5_0_rows(q.data(), sx.data(), qsum.data(), T, K, blocks.data(), y.data(), N, 0, N / 16);
        give(y);
      } else if (op == 7) {
        const int64_t T = size(), F = size();
        auto gu = take<float>(T * 2 * F);
        std::vector<float> out(T * F);
        ts_swiglu(gu.data(), T, F, out.data());
        give(out);
      } else {
        std::fprintf(stderr, "unknown op %d\n", op);
        return 2;
      }
      std::fflush(stdout);
    }
  } catch (int) {
    std::fprintf(stderr, "truncated request\n");
    return 2;
  }
  return 0;
}
