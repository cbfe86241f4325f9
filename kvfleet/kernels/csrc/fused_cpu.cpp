// Fused per-layer steps of a Llama-style decoder on CPU, each one call instead of several torch ops
// (on a small model such as SmolLM2-135M, 30 layers of hidden 576, the dispatch of a dozen tiny ops
// per layer per step costs as much as the arithmetic):
//
//   add_rms_norm_cpu(x!, h, weight, eps) -> out   x += h (when h is given), out = weight * norm(x)
//   rope_store_cpu(q!, k, v, cos, sin, k_cache!, v_cache!, slots)
//                                                 q turned in place; k turned and v copied into
//                                                 their slots of the paged cache (negative: skipped)
//
// Each rounds where torch's ops round (every product and sum to the tensors' dtype, as
// ``x * cos + rotate_half(x) * sin`` and ``weight * (x.float() * rsqrt(mean(x²) + eps)).to(dtype)``
// do), and is compiled without FMA contraction, so float32 results match the torch ops they
// replace up to the order of the norm's sum.

#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec16.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

// bfloat16 rounded to nearest even from a float, as c10::BFloat16's constructor rounds (NaN: quiet
// NaN), but in plain 32-bit integer steps the compiler vectorises: c10::BFloat16's own operators
// round one scalar at a time (RoPE + store of 16 decode rows on SmolLM2: 69 us against 13 us so;
// a prefill chunk's residual + norm, 2,048 x 768, ~7x float32's time).
inline float round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  float r;
  std::memcpy(&r, &u, sizeof r);
  return std::isnan(f) ? std::numeric_limits<float>::quiet_NaN() : r;
}

// A float rounded to T's precision, kept as a float: what an op of torch's on T tensors gives.
template <typename T>
inline float round_to(float f) { return static_cast<float>(static_cast<T>(f)); }
template <>
inline float round_to<float>(float f) { return f; }
template <>
inline float round_to<c10::BFloat16>(float f) { return round_bf16(f); }

// Stores a float already rounded to T's precision (``round_to<T>``).
template <typename T>
inline T from_rounded(float f) { return static_cast<T>(f); }
template <>
inline c10::BFloat16 from_rounded<c10::BFloat16>(float f) {  // exact: the upper 16 bits are the value
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return c10::BFloat16(static_cast<uint16_t>(u >> 16), c10::BFloat16::from_bits());
}

template <typename T>
void rms_rows(T* x, const T* h, int64_t x_stride, int64_t h_stride, const T* w, T* out, int64_t rows,
              int64_t width, double eps) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> row(width);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * x_stride;
      if (h != nullptr) {
        const T* hr = h + r * h_stride;
        for (int64_t i = 0; i < width; ++i)  // rounded to T, as torch's add
          row[i] = round_to<T>(static_cast<float>(xr[i]) + static_cast<float>(hr[i]));
        for (int64_t i = 0; i < width; ++i) xr[i] = from_rounded<T>(row[i]);
      } else {
        for (int64_t i = 0; i < width; ++i) row[i] = static_cast<float>(xr[i]);
      }
      float sum = 0.f;
      for (int64_t i = 0; i < width; ++i) sum += row[i] * row[i];
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(width) + static_cast<float>(eps));
      T* o = out + r * width;
      for (int64_t i = 0; i < width; ++i)  // weight * (x * inv).to(T), each rounded to T
        o[i] = from_rounded<T>(round_to<T>(static_cast<float>(w[i]) * round_to<T>(row[i] * inv)));
    }
  });
}

at::Tensor add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& h, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x: [rows, hidden], rows contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "weight: [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x must share a dtype");
  if (h.has_value())
    TORCH_CHECK(h->sizes() == x.sizes() && h->stride(1) == 1 && h->scalar_type() == x.scalar_type(),
                "h must match x");
  at::Tensor out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_cpu", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), h.has_value() ? h->data_ptr<scalar_t>() : nullptr, x.stride(0),
                       h.has_value() ? h->stride(0) : 0, weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                       x.size(0), x.size(1), eps);
  });
  return out;
}

constexpr int64_t kMaxHeadDim = 1024;

// out[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];  out[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half]
// each product and sum rounded to T where torch's ops round, over float copies (``out`` may be ``x``)
template <typename T>
inline void turn(const T* x, const T* c, const T* s, T* out, int64_t half) {
  float xf[kMaxHeadDim], cf[kMaxHeadDim], sf[kMaxHeadDim], of[kMaxHeadDim];
  for (int64_t i = 0; i < 2 * half; ++i) {
    xf[i] = static_cast<float>(x[i]);
    cf[i] = static_cast<float>(c[i]);
    sf[i] = static_cast<float>(s[i]);
  }
  for (int64_t i = 0; i < half; ++i) {
    const float a = xf[i], b = xf[i + half];
    of[i] = round_to<T>(round_to<T>(a * cf[i]) + round_to<T>(-b * sf[i]));
    of[i + half] = round_to<T>(round_to<T>(b * cf[i + half]) + round_to<T>(a * sf[i + half]));
  }
  for (int64_t i = 0; i < 2 * half; ++i) out[i] = from_rounded<T>(of[i]);
}

// ``turn`` in float32 with 16-lane vectors, where half is a multiple of 16: the same products and sums
// (no contraction in this file), so the same bits; reads of lanes i and half + i precede their writes
template <>
inline void turn<float>(const float* x, const float* c, const float* s, float* out, int64_t half) {
  if (half % W != 0) {
    float of[kMaxHeadDim];
    for (int64_t i = 0; i < half; ++i) {
      of[i] = x[i] * c[i] + (-x[i + half]) * s[i];
      of[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
    }
    std::memcpy(out, of, sizeof(float) * 2 * half);
    return;
  }
  for (int64_t i = 0; i < half; i += W) {
    const vf a = load(x + i), b = load(x + half + i);
    const vf lo = a * load(c + i) + (-b) * load(s + i);
    const vf hi = b * load(c + half + i) + a * load(s + half + i);
    store(out + i, lo);
    store(out + half + i, hi);
  }
}

template <typename T>
void rope_store_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                     const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* sp) {
  const int64_t tokens = q.size(0), heads = q.size(1), kv_heads = k.size(1), dim = q.size(2), half = dim / 2;
  const int64_t block_size = k_cache.size(2);
  T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp_ = sin.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  at::parallel_for(0, tokens, 32, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * cos.stride(0);
      const T* s = sp_ + t * sin.stride(0);
      for (int64_t h = 0; h < heads; ++h) {
        T* row = qp + t * q.stride(0) + h * q.stride(1);
        turn(row, c, s, row, half);
      }
      const int64_t slot = sp[t];
      if (slot < 0) continue;
      const int64_t base = (slot / block_size) * k_cache.stride(0) + (slot % block_size) * k_cache.stride(2);
      for (int64_t h = 0; h < kv_heads; ++h) {
        turn(kp + t * k.stride(0) + h * k.stride(1), c, s, kc + base + h * k_cache.stride(1), half);
        const T* vr = vp + t * v.stride(0) + h * v.stride(1);
        T* dst = vc + base + h * v_cache.stride(1);
        for (int64_t i = 0; i < dim; ++i) dst[i] = vr[i];
      }
    }
  });
}

void rope_store(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& slot_mapping) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes(), "q [T, H, D], k and v [T, Hkv, D]");
  const int64_t tokens = q.size(0), dim = q.size(2);
  TORCH_CHECK(k.size(0) == tokens && k.size(2) == dim && dim % 2 == 0, "q, k and v must share T and D");
  TORCH_CHECK(dim <= kMaxHeadDim, "head dim ", dim, " is past the ", kMaxHeadDim, " this kernel turns");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "rows must be contiguous");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == tokens && cos.size(1) == dim &&
                  cos.stride(1) == 1 && sin.stride(1) == 1 && cos.stride(0) == sin.stride(0),
              "cos, sin: [T, D], the whole head turned");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "K and V caches must share shape and strides");
  TORCH_CHECK(k_cache.size(1) == k.size(1) && k_cache.size(3) == dim && k_cache.stride(3) == 1,
              "k does not fit the cache");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype && cos.scalar_type() == dtype &&
                  sin.scalar_type() == dtype && k_cache.scalar_type() == dtype,
              "q, k, v, cos, sin and the cache must share a dtype");
  TORCH_CHECK(slot_mapping.numel() == tokens, "one slot per token");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(2);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] < num_slots, "slot ", sp[t], " is outside the pool of ", num_slots, " slots");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "rope_store_cpu", [&] {
    rope_store_rows<scalar_t>(q, k, v, cos, sin, k_cache, v_cache, sp);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_kernels, m) {
  m.def("add_rms_norm_cpu(Tensor(a!) x, Tensor? h, Tensor weight, float eps) -> Tensor");
  m.def("rope_store_cpu(Tensor(a!) q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(kvfleet_kernels, CPU, m) {
  m.impl("add_rms_norm_cpu", &add_rms_norm);
  m.impl("rope_store_cpu", &rope_store);
}
