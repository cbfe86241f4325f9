// float32 vectors of 16 lanes and the element types of the caches, for the CPU attention kernels:
// loads and stores, horizontal sums, a vectorised 2^x, and the widening of bf16/fp16/fp8 rows to float32.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// 16 floats; GCC lowers it to one zmm register with AVX-512 and to narrower registers otherwise.
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
constexpr int W = 16;

struct bf16_t { uint16_t x; };
struct fp16_t { uint16_t x; };
struct fp8_t { uint8_t x; };

inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{} + x; }

inline float hsum(vf v) {
  vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
          __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// r[i] = sum of the lanes of v[i], for 16 vectors: a transpose-and-add tree, 45 operations where 16
// separate horizontal sums would take ~110, and 16 independent chains for the dot products before it.
inline vf hsum16(const vf* v) {
  vf c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i)
    c[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    e[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(d[2 * i], d[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// 2^x for x <= 0 (clamped at -126): x = n + f, f in [-0.5, 0.5]; 2^f by the Cephes exp2f polynomial
// (relative error ~2e-7, the rounding error of float32 itself).
inline vf exp2v(vf x) {
  x = x < splat(-126.f) ? splat(-126.f) : x;
  vf y = x + 0.5f;
  vi n = __builtin_convertvector(y, vi);  // truncation; fix it to floor for negative y
  vf nf = __builtin_convertvector(n, vf);
  n += (vi)(nf > y);                       // true lanes are -1
  nf = __builtin_convertvector(n, vf);
  vf f = x - nf;
  vf p = splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  vi bits = (n + 127) << 23;
  vf two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// Widen `rows` rows of `d` elements into float rows of stride `dp` (zero padded); FP8 rows are
// multiplied by their scale `row_scale[r]`.
template <typename T>
void widen(const T* src, int rows, int d, int dp, float* dst, const float* row_scale) {
  for (int r = 0; r < rows; ++r) {
    const T* s = src + (int64_t)r * d;
    float* o = dst + (int64_t)r * dp;
    int i = 0;
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(o, s, sizeof(float) * d);
      i = d;
    } else if constexpr (std::is_same_v<T, bf16_t>) {
      for (; i < d; ++i) {
        uint32_t bits = (uint32_t)s[i].x << 16;
        std::memcpy(o + i, &bits, 4);
      }
    } else if constexpr (std::is_same_v<T, fp16_t>) {
#if defined(__F16C__) && defined(__AVX__)
      for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(o + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + i))));
#endif
      for (; i < d; ++i) o[i] = static_cast<float>(c10::Half(s[i].x, c10::Half::from_bits()));
    } else {  // float8_e4m3fn: the 7 magnitude bits placed at float bit 20, times 2^(127-7)
      const float factor = 1.329227995784916e36f * (row_scale ? row_scale[r] : 1.f);  // 2^120 * scale
      for (; i < d; ++i) {
        uint32_t bits = (uint32_t)(s[i].x & 0x7F) << 20;
        float mag;
        std::memcpy(&mag, &bits, 4);
        mag *= factor;
        o[i] = (s[i].x & 0x80) ? -mag : mag;
      }
    }
    for (; i < dp; ++i) o[i] = 0.f;
  }
}

}  // namespace
