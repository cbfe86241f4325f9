// Causal prefill attention of one sequence on CPU: its new tokens' queries against every key of the
// sequence so far (a cached prefix and the tokens just stored), read from the paged cache.
//
// The shape of torch's flash attention, with the blocking of a matrix kernel: for a block of 6 query
// rows of one head and a tile of 64 keys, the scores are an outer product over the head dim (a
// broadcast query element times 4 vectors of 16 transposed keys: 24 FMAs per 4 loads), the online
// softmax keeps each row's running max and sum, and P·V is the same outer product the other way (a
// broadcast probability times D/16 vectors of a value row), for as many of the 6 rows at a time as
// keep its accumulators at 24 or fewer. K and V are
// first widened to float32 once per call, K transposed ([Hkv][D][keys], so that 16 keys are one
// load), V as rows ([Hkv][keys][D]); queries scaled by scale·log2(e), so the softmax is 2^x.
// Measured against ``scaled_dot_product_attention(is_causal, enable_gqa)`` in kernels/cpu_prefill.py's
// docstring. Float32 results match it within float32 rounding (another summation order).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "vec16.h"

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int KT = 64;       // keys per tile
constexpr int NK = KT / W;   // vectors per tile row

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = std::max(m, v[i]);
  return m;
}

// The inputs of one call, widened: q [H][rows_padded][D] scaled, kt [Hkv][D][ldk], v [Hkv][ldk][D].
struct Widened {
  const float* q;
  const float* kt;
  const float* v;
  int64_t rows_padded, ldk;
  int heads, kv_heads, d;
  int64_t prefix;  // position of query row 0
  int64_t rows;    // query rows (new tokens)
};

constexpr int R = 6;  // query rows of a block: R * NK = 24 score accumulators

// rows of a P·V pass for head dim NV * 16: RP * NV <= 24 accumulators (R divides by it)
template <int NV>
constexpr int pv_rows_per_pass() { return NV <= 4 ? R : NV <= 8 ? 3 : NV <= 12 ? 2 : 1; }

// o[r] = o[r] * alpha[r] + sum over the tile's keys j of p[r][j] * v[j], for RP rows
template <int NV, int RP>
inline void pv_rows(const float* v, int64_t keys, const float (*p)[KT], const float* alpha, float (*o)[NV * W]) {
  constexpr int D = NV * W;
  vf acc[RP][NV];
  for (int r = 0; r < RP; ++r)
    for (int n = 0; n < NV; ++n) acc[r][n] = load(o[r] + n * W) * alpha[r];
  for (int64_t j = 0; j < keys; ++j) {
    const float* vrow = v + j * D;
    vf vv[NV];
    for (int n = 0; n < NV; ++n) vv[n] = load(vrow + n * W);
    for (int r = 0; r < RP; ++r) {
      const vf pj = splat(p[r][j]);
      for (int n = 0; n < NV; ++n) acc[r][n] += pj * vv[n];
    }
  }
  for (int r = 0; r < RP; ++r)
    for (int n = 0; n < NV; ++n) store(o[r] + n * W, acc[r][n]);
}

// One block of R rows of head h starting at row i0: the softmax-weighted sum of V over keys
// [0, last row's position], normalised into out (the block's valid rows of D floats).
template <int NV>
void attend_block(const Widened& w, int h, int64_t i0, float* out) {
  constexpr int RP = pv_rows_per_pass<NV>();
  constexpr int D = NV * W;
  const int kvh = h / (w.heads / w.kv_heads);
  const float* q = w.q + (h * w.rows_padded + i0) * D;
  const float* kt = w.kt + (int64_t)kvh * D * w.ldk;
  const float* vh = w.v + (int64_t)kvh * w.ldk * D;
  const int64_t valid = std::min<int64_t>(R, w.rows - i0);
  int64_t pos[R];
  for (int r = 0; r < R; ++r) pos[r] = w.prefix + i0 + std::min<int64_t>(r, valid - 1);
  const int64_t key_end = pos[R - 1] + 1;

  float m[R], l[R], alpha[R];
  alignas(64) float p[R][KT];
  alignas(64) float o[R][D];
  for (int r = 0; r < R; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
    for (int i = 0; i < D; ++i) o[r][i] = 0.f;
  }
  vi lane;
  for (int i = 0; i < W; ++i) lane[i] = i;

  for (int64_t j0 = 0; j0 < key_end; j0 += KT) {
    vf s[R][NK];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NK; ++c) s[r][c] = vf{};
    for (int dd = 0; dd < D; ++dd) {
      const float* krow = kt + (int64_t)dd * w.ldk + j0;
      vf k[NK];
      for (int c = 0; c < NK; ++c) k[c] = load(krow + c * W);
      for (int r = 0; r < R; ++r) {
        const vf qv = splat(q[r * D + dd]);
        for (int c = 0; c < NK; ++c) s[r][c] += qv * k[c];
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t seen = std::clamp<int64_t>(pos[r] + 1 - j0, 0, KT);  // keys of this tile row r sees
      vf mx = splat(-std::numeric_limits<float>::infinity());
      for (int c = 0; c < NK; ++c) {
        if (seen < KT) s[r][c] = (lane + c * W) < (int)seen ? s[r][c] : splat(-std::numeric_limits<float>::infinity());
        mx = mx > s[r][c] ? mx : s[r][c];
      }
      const float m_new = std::max(m[r], hmax(mx));
      alpha[r] = std::exp2(m[r] - m_new);  // 0 on the first tile (m = -inf)
      m[r] = m_new;
      vf tot{};
      for (int c = 0; c < NK; ++c) {
        vf e = exp2v(s[r][c] - m_new);
        if (seen < KT) e = (lane + c * W) < (int)seen ? e : vf{};
        store(p[r] + c * W, e);
        tot += e;
      }
      l[r] = l[r] * alpha[r] + hsum(tot);
    }
    const int64_t keys = std::min<int64_t>(KT, key_end - j0);
    for (int g = 0; g < R; g += RP)  // P·V for RP rows at a time: RP * NV accumulators
      pv_rows<NV, RP>(vh + j0 * D, keys, &p[g], &alpha[g], &o[g]);
  }
  for (int r = 0; r < valid; ++r) {
    const float inv = 1.f / l[r];
    for (int i = 0; i < D; ++i) out[r * D + i] = o[r][i] * inv;
  }
}

template <int NV>
void attend_all(const Widened& w, float* out /* [H][rows_padded][D] */) {
  const int64_t blocks = w.rows_padded / R;
  at::parallel_for(0, (int64_t)w.heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int h = item / blocks;
      const int64_t i0 = (item % blocks) * R;
      attend_block<NV>(w, h, i0, out + (h * w.rows_padded + i0) * NV * W);
    }
  });
}

template <typename T>
inline float widen_one(T x) {
  return static_cast<float>(x);
}

template <typename T>
at::Tensor run(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const int32_t* table, int64_t context_len, double scale) {
  const int64_t rows = query.size(0);
  const int heads = query.size(1), d = query.size(2), kv_heads = k_cache.size(1);
  const int nv = d / W;
  const int64_t rows_padded = (rows + R - 1) / R * R;
  const int64_t ldk = (context_len + KT - 1) / KT * KT;
  const int64_t bs = k_cache.size(2);
  auto opts = query.options().dtype(at::kFloat);
  at::Tensor qf = at::empty({heads, rows_padded, d}, opts);
  at::Tensor kt = at::empty({kv_heads, d, ldk}, opts);
  at::Tensor vf_ = at::empty({kv_heads, ldk, d}, opts);
  at::Tensor outf = at::empty({heads, rows_padded, d}, opts);
  float* qp = qf.data_ptr<float>();
  float* ktp = kt.data_ptr<float>();
  float* vp = vf_.data_ptr<float>();
  const T* qsrc = query.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const float qscale = (float)scale * kLog2e;
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h)
      for (int64_t i = 0; i < rows_padded; ++i) {
        float* dst = qp + (h * rows_padded + i) * d;
        if (i >= rows) {
          std::fill(dst, dst + d, 0.f);
          continue;
        }
        const T* src = qsrc + i * qs0 + h * qs1;
        for (int e = 0; e < d; ++e) dst[e] = widen_one(src[e]) * qscale;
      }
  });
  // K transposed and V as rows, 16 keys at a time (the transposes stay in L1); the tail past
  // context_len is zero (its scores are masked; its V rows never read)
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t tiles = ldk / W;
  at::parallel_for(0, (int64_t)kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / tiles, j0 = (item % tiles) * W;
      float* kdst = ktp + h * d * ldk;
      float* vdst = vp + (h * ldk + j0) * d;
      for (int64_t j = j0; j < j0 + W; ++j, vdst += d) {
        if (j >= context_len) {
          for (int e = 0; e < d; ++e) kdst[e * ldk + j] = 0.f;
          std::fill(vdst, vdst + d, 0.f);
          continue;
        }
        const int64_t off = (int64_t)table[j / bs] * ks0 + h * ks1 + (j % bs) * ks2;
        const T* krow = kc + off;
        const T* vrow = vc + off;
        for (int e = 0; e < d; ++e) {
          kdst[e * ldk + j] = widen_one(krow[e]);
          vdst[e] = widen_one(vrow[e]);
        }
      }
    }
  });
  const Widened w{qp, ktp, vp, rows_padded, ldk, heads, kv_heads, d, context_len - rows, rows};
  float* op = outf.data_ptr<float>();
  switch (nv) {
    case 1: attend_all<1>(w, op); break;
    case 2: attend_all<2>(w, op); break;
    case 3: attend_all<3>(w, op); break;
    case 4: attend_all<4>(w, op); break;
    case 5: attend_all<5>(w, op); break;
    case 6: attend_all<6>(w, op); break;
    case 8: attend_all<8>(w, op); break;
    case 10: attend_all<10>(w, op); break;
    case 12: attend_all<12>(w, op); break;
    case 16: attend_all<16>(w, op); break;
    default: TORCH_CHECK(false, "head dim ", d, " is not one this kernel is built for");
  }
  // [H][rows_padded][D] → [rows][H][D] in the query's dtype
  return outf.narrow(1, 0, rows).transpose(0, 1).to(query.scalar_type()).contiguous();
}

// the head dims ``run`` has a case for: 16, 32, 48, 64, 80, 96, 128, 160, 192, 256
bool built_for(int64_t d) {
  if (d % W != 0) return false;
  switch (d / W) {
    case 1: case 2: case 3: case 4: case 5: case 6: case 8: case 10: case 12: case 16: return true;
    default: return false;
  }
}

at::Tensor causal_prefill(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_table, int64_t context_len, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query: [rows, H, D], rows contiguous");
  const int64_t rows = query.size(0), d = query.size(2);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  k_cache.size(3) == d && k_cache.stride(3) == 1,
              "K and V caches: [blocks, Hkv, block size, D], alike");
  TORCH_CHECK(query.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of the KV heads");
  TORCH_CHECK(built_for(d), "head dim ", d, " is not one this kernel is built for");
  TORCH_CHECK(rows >= 1 && context_len >= rows, "context_len ", context_len, " < the ", rows, " new tokens");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type(), "query and cache must share a dtype");
  const int64_t bs = k_cache.size(2);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 1 &&
                  block_table.size(0) * bs >= context_len,
              "block_table: int32, enough blocks for context_len");
  const at::Tensor table = block_table.contiguous();
  const int32_t* tp = table.data_ptr<int32_t>();
  for (int64_t b = 0; b < (context_len + bs - 1) / bs; ++b)
    TORCH_CHECK(tp[b] >= 0 && tp[b] < k_cache.size(0), "block ", tp[b], " is outside the pool");
  switch (query.scalar_type()) {
    case at::kFloat: return run<float>(query, k_cache, v_cache, tp, context_len, scale);
    case at::kBFloat16: return run<c10::BFloat16>(query, k_cache, v_cache, tp, context_len, scale);
    default: TORCH_CHECK(false, "causal_prefill_cpu takes float32 or bfloat16, not ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_kernels, m) {
  m.def("causal_prefill_cpu(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_table, int context_len, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvfleet_kernels, CPU, m) { m.impl("causal_prefill_cpu", &causal_prefill); }
