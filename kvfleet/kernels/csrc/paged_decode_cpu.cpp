// Paged decode attention on CPU: one new query token per sequence over its paged K/V.
//
// Layout (one layer of the node's pool):
//   k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]; each (block, kv head) tile is a
//   contiguous block_size x head_dim matrix, read in place through the block table (no gather copy).
//
// Work item = (sequence, kv head, split). An item loads the G = num_heads / num_kv_heads query heads of
// its group once, then streams its token range chunk by chunk (<= 64 tokens, from one tile or several):
//   scores[g][t] = q[g] . k[t]      (each K row read once for the whole group)
//   online softmax per g             (running max m, running sum l, base-2 exponentials)
//   acc[g]     += p[g][t] * v[t]     (each V row read once for the whole group)
// With several splits per sequence (long contexts, few sequences), each item writes (m, l, acc) and a
// second pass merges them. All arithmetic is float32. float32 and bf16 rows are read in place (bf16
// widened in registers; on a CPU with AVX512-BF16, q . k of bf16 rows is one vdpbf16ps per 32 elements
// of q and k in bf16: exact products, float32 sums); fp16/fp8 tiles are widened chunk by chunk.
// The softmax scale is folded into q. FP8 rows are widened times their own scale (one float per
// token and KV head, in scale caches laid out like the cache minus head_dim: row element index / d).
// A sliding window (window > 0) keeps the last `window` tokens of each context: the splits cover only
// those, and neither the older tokens nor their block-table entries are read (those blocks may be
// given back already). A logit soft-cap (Gemma 2) squashes each score into (-cap, cap), cap * tanh(s / cap),
// before the softmax; in the base-2 units of the scores that is c * tanh(s2 / c) with c = cap * log2(e).

#include "vec16.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr int CHUNK = 64;     // tokens per softmax update; a widened chunk of K or V is <= 64 * head_dim floats
constexpr int MAX_NV = 32;  // head_dim <= 512
constexpr int PREFETCH_BYTES = 32768;  // how far ahead of the chunk in hand K and V are prefetched, per stream
constexpr float LOG2E = 1.4426950408889634f;

struct Item {
  const float* q;   // [G][dp], already times softmax scale * log2(e)
  const uint16_t* qb;  // [G][dp], bf16 and unscaled (bf16 caches: the q . k of vdpbf16ps), else null
  float qscale;        // softmax scale * log2(e), for the scores of qb
  float* acc;       // [G][dp]
  float* m;         // [G] running max (base 2)
  float* l;         // [G] running sum
};

struct Geometry {
  int G, d, dp, block_size;
  int64_t block_stride;  // elements between blocks
  float softcap2;        // logit soft-cap in base-2 units (cap * log2(e)); 0: none
};

// Prefetch into L2 the `part`-th of `parts` slices of the byte range [p, p + bytes).
inline void prefetch_slice(const void* p, int64_t bytes, int part, int parts) {
  const char* c = static_cast<const char*>(p);
  const int64_t lines = (bytes + 63) / 64;
  for (int64_t i = lines * part / parts; i < lines * (part + 1) / parts; ++i) __builtin_prefetch(c + i * 64, 0, 2);
}

// A run of rows inside one tile: `at` elements from the head's base, `rows` rows.
struct Segment {
  int64_t at;
  int rows;
};
constexpr int MAX_SEGMENTS = CHUNK / 16 + 1;  // block_size >= 16

// Split tokens [t, t + n) of a sequence, starting at (block index bi, offset off), into tile segments.
inline int segments(const int32_t* table, const Geometry& g, int bi, int off, int n, Segment* out) {
  int count = 0;
  for (int done = 0; done < n; ++bi, off = 0) {
    const int rows = std::min(n - done, g.block_size - off);
    out[count++] = {(int64_t)table[bi] * g.block_stride + (int64_t)off * g.d, rows};
    done += rows;
  }
  return count;
}

// A row of the chunk as 16 floats at a time: float32 rows as they are; bf16 rows (the top halves of
// floats) widened in registers.
typedef uint16_t vu16 __attribute__((vector_size(32)));
inline vf load_row(const float* p) { return load(p); }
inline vf load_row(const uint16_t* p) {
  vu16 h;
  std::memcpy(&h, p, sizeof h);
  const vi bits = __builtin_convertvector(h, vi) << 16;
  vf v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

#if defined(__AVX512BF16__)
constexpr bool HAS_DPBF16 = true;
// acc[lane] += q[2 lane] k[2 lane] + q[2 lane + 1] k[2 lane + 1], 32 bf16 of each
inline vf dot_bf16(vf acc, __m512i q, const uint16_t* k) {
  return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)q, (__m512bh)_mm512_loadu_si512(k));
}
#else
constexpr bool HAS_DPBF16 = false;
#endif

// Attend one item's token range [t_begin, t_end). NV = dp / 16 when known at compile time, else 0.
// RAW: the rows are read in place (float32 and bf16 tiles with head_dim a multiple of 16), else widened.
// A chunk is up to 64 tokens, from one tile or several small ones. Chunks are walked head by head, so
// that q[h] (scores) and acc[h] (values) stay in registers while the chunk's rows come from L1; the
// rows `lookahead` tokens on are prefetched meanwhile (the next tile can be anywhere in the pool, and
// the hardware prefetcher stops at every 4 KiB page).
// FP8: `k_sc`, `v_sc` point at this KV head's scales (element `at` of a tile has scale `at / d`).
template <typename T, int NV, bool RAW>
void attend(const Item& it, const Geometry& g, const T* k_head, const T* v_head, const float* k_sc,
            const float* v_sc, const int32_t* table, int t_begin, int t_end, float* buf, float* s,
            const float* zero_row) {
  const int nv = NV ? NV : g.dp / W;
  const int G = g.G;
  const int bs = g.block_size;
  using Row = std::conditional_t<RAW && std::is_same_v<T, bf16_t>, uint16_t, float>;
  const int lookahead = std::max<int>(CHUNK, PREFETCH_BYTES / (g.d * (int)sizeof(T)));
  // positions walk as (block index, offset): one division here, none per chunk
  int bi = t_begin / bs, off = t_begin % bs;
  int pbi = (t_begin + lookahead) / bs, poff = (t_begin + lookahead) % bs;
  Segment segs[MAX_SEGMENTS], ahead[MAX_SEGMENTS];
  const Row* rows[CHUNK];
  const Row* zero = reinterpret_cast<const Row*>(zero_row);
  for (int t = t_begin; t < t_end;) {
    const int n = std::min(CHUNK, t_end - t);
    const int num_segs = segments(table, g, bi, off, n, segs);
    const int n_ahead = std::max(0, std::min(n, t_end - t - lookahead));
    const int num_ahead = segments(table, g, pbi, poff, n_ahead, ahead);
    auto prefetch_ahead = [&](const T* head, int part) {
      for (int i = 0; i < num_ahead; ++i)
        prefetch_slice(head + ahead[i].at, (int64_t)ahead[i].rows * g.d * sizeof(T), part, G);
    };
    // rows[r]: row r of the chunk as float32, in place (float32 tiles) or widened into buf
    auto gather_rows = [&](const T* head, const float* sc) {
      for (int i = 0, r = 0; i < num_segs; ++i) {
        const Row* src;
        if constexpr (RAW) {
          src = reinterpret_cast<const Row*>(head + segs[i].at);
        } else {
          widen(head + segs[i].at, segs[i].rows, g.d, g.dp, buf + (int64_t)r * g.dp,
                sc ? sc + segs[i].at / g.d : nullptr);
          src = buf + (int64_t)r * g.dp;
        }
        for (int j = 0; j < segs[i].rows; ++j) rows[r++] = src + (int64_t)j * g.dp;
      }
      for (int r = n; r < CHUNK; ++r) rows[r] = zero;
    };

    // scores[h][r] = q[h] . k[r]
    gather_rows(k_head, k_sc);
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<Row, uint16_t>) {  // bf16 rows in place: run gives qb only with AVX512-BF16
      for (int h = 0; h < G && it.qb; ++h) {
        __m512i qv[(NV ? NV : MAX_NV) / 2];
        for (int j = 0; j < nv / 2; ++j) qv[j] = _mm512_loadu_si512(it.qb + (int64_t)h * g.dp + j * 2 * W);
        float* sh = s + h * CHUNK;
        for (int r0 = 0; r0 < n; r0 += W) {
          vf a[W];
          for (int i = 0; i < W; ++i) {
            const uint16_t* krow = rows[r0 + i];
            a[i] = dot_bf16(vf{}, qv[0], krow);
            for (int j = 1; j < nv / 2; ++j) a[i] = dot_bf16(a[i], qv[j], krow + j * 2 * W);
          }
          store(sh + r0, hsum16(a) * it.qscale);
        }
        prefetch_ahead(k_head, h);
      }
    }
#endif
    for (int h = 0; h < G && !it.qb; ++h) {
      vf qv[NV ? NV : MAX_NV];
      for (int j = 0; j < nv; ++j) qv[j] = load(it.q + (int64_t)h * g.dp + j * W);
      float* sh = s + h * CHUNK;
      for (int r0 = 0; r0 < n; r0 += W) {  // rows past n read a zero row
        vf a[W];
        for (int i = 0; i < W; ++i) {
          const Row* krow = rows[r0 + i];
          a[i] = qv[0] * load_row(krow);
          for (int j = 1; j < nv; ++j) a[i] += qv[j] * load_row(krow + j * W);
        }
        store(sh + r0, hsum16(a));
      }
      prefetch_ahead(k_head, h);
    }

    // online softmax: p = 2^(score - m_new); rescale acc and l when the max grows
    const int n16 = (n + W - 1) / W * W;
    for (int h = 0; h < G; ++h) {
      float* sh = s + h * CHUNK;
      if (g.softcap2 > 0.f) {
        for (int r = 0; r < n; ++r) sh[r] = g.softcap2 * std::tanh(sh[r] / g.softcap2);
      }
      for (int r = n; r < n16; ++r) sh[r] = -std::numeric_limits<float>::infinity();
      vf mx = load(sh);
      for (int r = W; r < n16; r += W) {
        const vf x = load(sh + r);
        mx = x > mx ? x : mx;
      }
      float mc = mx[0];
      for (int z = 1; z < W; ++z) mc = std::max(mc, mx[z]);
      if (mc > it.m[h]) {
        const float alpha = std::exp2(it.m[h] - mc);  // 0 on the first chunk (m = -inf)
        it.l[h] *= alpha;
        float* ah = it.acc + (int64_t)h * g.dp;
        for (int j = 0; j < nv; ++j) store(ah + j * W, load(ah + j * W) * alpha);
        it.m[h] = mc;
      }
      const vf mv = splat(it.m[h]);
      vf sum = splat(0.f);
      for (int r = 0; r < n16; r += W) {
        vf p = exp2v(load(sh + r) - mv);
        if (r + W > n) {  // zero the padding lanes
          for (int z = n - r; z < W; ++z) p[z] = 0.f;
        }
        store(sh + r, p);
        sum += p;
      }
      it.l[h] += hsum(sum);
    }

    // acc[h] += p[h][r] * v[r]
    gather_rows(v_head, v_sc);
    int h = 0;
    for (; h + 2 <= G; h += 2) {  // two heads per pass: each V row load feeds 2 * nv independent FMAs
      float* a0 = it.acc + (int64_t)h * g.dp;
      float* a1 = a0 + g.dp;
      vf av0[NV ? NV : MAX_NV], av1[NV ? NV : MAX_NV];
      for (int j = 0; j < nv; ++j) av0[j] = load(a0 + j * W), av1[j] = load(a1 + j * W);
      const float* s0 = s + h * CHUNK;
      const float* s1 = s0 + CHUNK;
      for (int r = 0; r < n; ++r) {
        const vf p0 = splat(s0[r]), p1 = splat(s1[r]);
        const Row* vrow = rows[r];
        for (int j = 0; j < nv; ++j) {
          const vf x = load_row(vrow + j * W);
          av0[j] += p0 * x;
          av1[j] += p1 * x;
        }
      }
      for (int j = 0; j < nv; ++j) store(a0 + j * W, av0[j]), store(a1 + j * W, av1[j]);
      prefetch_ahead(v_head, h);
      prefetch_ahead(v_head, h + 1);
    }
    for (; h < G; ++h) {
      float* ah = it.acc + (int64_t)h * g.dp;
      vf av[NV ? NV : MAX_NV];
      for (int j = 0; j < nv; ++j) av[j] = load(ah + j * W);
      const float* sh = s + h * CHUNK;
      for (int r = 0; r < n; ++r) {
        const vf p = splat(sh[r]);
        const Row* vrow = rows[r];
        for (int j = 0; j < nv; ++j) av[j] += p * load_row(vrow + j * W);
      }
      for (int j = 0; j < nv; ++j) store(ah + j * W, av[j]);
      prefetch_ahead(v_head, h);
    }
    t += n;
    for (off += n; off >= bs; off -= bs) ++bi;
    for (poff += n; poff >= bs; poff -= bs) ++pbi;
  }
}

// attend<T, NV, RAW> for this head_dim (NV) and tile type (RAW only for float32 and bf16 tiles).
template <typename T, bool RAW, typename... Args>
void attend_dp(int dp, Args&&... args) {
  if constexpr (RAW && !std::is_same_v<T, float> && !std::is_same_v<T, bf16_t>) {
    TORCH_CHECK(false, "only float32 and bf16 tiles are read in place");
  } else {
    switch (dp / W) {
      case 4: attend<T, 4, RAW>(args...); break;
      case 8: attend<T, 8, RAW>(args...); break;
      default: attend<T, 0, RAW>(args...); break;
    }
  }
}

template <typename T>
void run(const at::Tensor& q32, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
         const float* ks, const float* vs, int64_t num_splits, int64_t window, double softcap,
         at::Tensor& out32) {
  const int B = q32.size(0), H = q32.size(1), d = q32.size(2);
  const int Hkv = k_cache.size(1);
  const int G = H / Hkv;
  const int dp = (d + W - 1) / W * W;
  const Geometry geo{G, d, dp, (int)k_cache.size(2), k_cache.stride(0), (float)softcap * LOG2E};
  const int64_t head_stride = k_cache.stride(1);
  const int max_blocks = block_tables.size(1);
  const T* k_base = reinterpret_cast<const T*>(k_cache.data_ptr());
  const T* v_base = reinterpret_cast<const T*>(v_cache.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const float* qd = q32.data_ptr<float>();
  float* od = out32.data_ptr<float>();

  // the first token each sequence attends to: 0, or the oldest inside its window
  auto first_token = [&](int b) { return window > 0 ? std::max<int>(0, lens[b] - (int)window) : 0; };
  int max_len = 0;
  for (int b = 0; b < B; ++b) max_len = std::max(max_len, lens[b] - first_token(b));
  int S = (int)num_splits;
  if (S <= 0) {  // enough items to keep every thread busy, but no split shorter than 512 tokens
    const int threads = at::get_num_threads();
    S = 1;
    while ((int64_t)B * Hkv * S < 4 * threads && max_len / (2 * S) >= 512) S *= 2;
  }
  const int64_t items = (int64_t)B * Hkv * S;
  // partial results of split items: acc [items][G][dp], m and l [items][G]
  at::Tensor part;
  float* part_acc = nullptr;
  float* part_ml = nullptr;
  if (S > 1) {
    part = at::empty({items * G * (dp + 2)}, q32.options());
    part_acc = part.data_ptr<float>();
    part_ml = part_acc + items * G * dp;
  }

  const bool raw = (std::is_same_v<T, float> || std::is_same_v<T, bf16_t>) && d == dp;
  const bool dot = std::is_same_v<T, bf16_t> && HAS_DPBF16 && raw && dp % (2 * W) == 0;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    // per-thread scratch: q [G][dp], acc [G][dp], m, l [G], widened chunk [CHUNK][dp], scores [G][CHUNK],
    // a zero row [dp] (zero-initialised, like all of it), q in bf16 [G][dp] (as G * dp / 2 floats)
    std::vector<float> scratch((size_t)G * dp * 2 + 2 * G + (size_t)CHUNK * dp + (size_t)G * CHUNK + dp +
                               (size_t)G * dp / 2);
    float* qg = scratch.data();
    float* acc = qg + (size_t)G * dp;
    float* m = acc + (size_t)G * dp;
    float* l = m + G;
    float* buf = l + G;
    float* s = buf + (size_t)CHUNK * dp;
    const float* zero = s + (size_t)G * CHUNK;
    uint16_t* qb = reinterpret_cast<uint16_t*>(s + (size_t)G * CHUNK + dp);
    for (int64_t item = begin; item < end; ++item) {
      const int split = item % S;
      const int kvh = (item / S) % Hkv;
      const int b = item / S / Hkv;
      const int lo = first_token(b), len = lens[b] - lo;
      const int per = ((len + S - 1) / S + W - 1) / W * W;
      const int t0 = lo + std::min(len, split * per), t1 = lo + std::min(len, split * per + per);
      const float qscale = (float)scale * LOG2E;
      for (int h = 0; h < G; ++h) {
        const float* src = qd + ((int64_t)b * H + kvh * G + h) * d;
        for (int i = 0; i < dp; ++i) qg[h * dp + i] = i < d ? src[i] * qscale : 0.f;
        for (int i = 0; dot && i < d; ++i) {  // round to nearest even (a bf16 model's q is bf16 already)
          uint32_t bits;
          std::memcpy(&bits, src + i, 4);
          qb[h * dp + i] = (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
        }
        m[h] = -std::numeric_limits<float>::infinity();
        l[h] = 0.f;
      }
      std::fill(acc, acc + (size_t)G * dp, 0.f);
      if (t1 > t0) {
        const Item it{qg, dot ? qb : nullptr, qscale, acc, m, l};
        const T* kh = k_base + kvh * head_stride;
        const T* vh = v_base + kvh * head_stride;
        const float* ksh = ks ? ks + kvh * geo.block_size : nullptr;
        const float* vsh = vs ? vs + kvh * geo.block_size : nullptr;
        const int32_t* table = tables + (int64_t)b * max_blocks;
        if (raw)
          attend_dp<T, true>(dp, it, geo, kh, vh, ksh, vsh, table, t0, t1, buf, s, zero);
        else
          attend_dp<T, false>(dp, it, geo, kh, vh, ksh, vsh, table, t0, t1, buf, s, zero);
      }
      if (S == 1) {
        for (int h = 0; h < G; ++h) {
          const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
          float* o = od + ((int64_t)b * H + kvh * G + h) * d;
          for (int i = 0; i < d; ++i) o[i] = acc[h * dp + i] * inv;
        }
      } else {
        std::memcpy(part_acc + item * G * dp, acc, sizeof(float) * G * dp);
        for (int h = 0; h < G; ++h) {
          part_ml[(item * G + h) * 2] = m[h];
          part_ml[(item * G + h) * 2 + 1] = l[h];
        }
      }
    }
  });
  if (S == 1) return;

  // merge: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s
  at::parallel_for(0, (int64_t)B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(dp);
    for (int64_t bk = begin; bk < end; ++bk) {
      const int b = bk / Hkv, kvh = bk % Hkv;
      for (int h = 0; h < G; ++h) {
        float M = -std::numeric_limits<float>::infinity();
        for (int sp = 0; sp < S; ++sp) M = std::max(M, part_ml[((bk * S + sp) * G + h) * 2]);
        std::fill(o.begin(), o.end(), 0.f);
        float L = 0.f;
        for (int sp = 0; sp < S; ++sp) {
          const int64_t item = bk * S + sp;
          const float l = part_ml[(item * G + h) * 2 + 1];
          if (l == 0.f) continue;
          const float w = std::exp2(part_ml[(item * G + h) * 2] - M);
          L += w * l;
          const float* a = part_acc + (item * G + h) * dp;
          for (int i = 0; i < d; ++i) o[i] += w * a[i];
        }
        const float inv = L > 0.f ? 1.f / L : 0.f;
        float* dst = od + ((int64_t)b * H + kvh * G + h) * d;
        for (int i = 0; i < d; ++i) dst[i] = o[i] * inv;
      }
    }
  });
}

}  // namespace

// An FP8 scale cache: float32 [num_blocks, num_kv_heads, block_size], contiguous, over a cache whose
// blocks and heads are contiguous too (so a row's scale is at its element index / head_dim); or none.
at::Tensor row_scales(const std::optional<at::Tensor>& scale, const at::Tensor& cache) {
  if (!scale.has_value()) return at::Tensor();
  TORCH_CHECK(cache.scalar_type() == at::kFloat8_e4m3fn, "scales belong to FP8 caches only");
  TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
              scale->sizes() == cache.sizes().slice(0, 3),
              "a contiguous float32 scale per (block, KV head, offset) expected, got ", scale->sizes());
  TORCH_CHECK(cache.stride(1) == cache.size(2) * cache.size(3) && cache.stride(0) == cache.size(1) * cache.stride(1),
              "an FP8 cache's blocks must be contiguous");
  return *scale;
}

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                        const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                        int64_t num_splits, int64_t window, double logit_softcap) {
  // query: [batch, num_heads, head_dim]; caches: [num_blocks, num_kv_heads, block_size, head_dim]
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4, "query [batch, heads, dim], caches 4-D expected");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "K and V caches must share shape and strides");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3), "tiles must be contiguous");
  TORCH_CHECK(query.size(2) == k_cache.size(3) && query.size(1) % k_cache.size(1) == 0,
              "head_dim must match and num_heads be a multiple of num_kv_heads");
  TORCH_CHECK((query.size(2) + W - 1) / W <= MAX_NV, "head_dim above 512");
  TORCH_CHECK(k_cache.size(2) % 16 == 0, "block_size must be a multiple of 16, got ", k_cache.size(2));
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == query.size(0) &&
              context_lens.numel() == query.size(0), "one block table and context length per sequence");
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: full attention), got ", window);
  TORCH_CHECK(logit_softcap >= 0, "logit_softcap must be >= 0 (0: none), got ", logit_softcap);
  const at::Tensor tables = block_tables.to(at::kInt).contiguous();
  const at::Tensor lens = context_lens.to(at::kInt).contiguous();
  TORCH_CHECK(k_scale.has_value() == (k_cache.scalar_type() == at::kFloat8_e4m3fn) &&
              v_scale.has_value() == k_scale.has_value(), "FP8 caches, and only they, come with both scale caches");
  const at::Tensor ks = row_scales(k_scale, k_cache);
  const at::Tensor vs = row_scales(v_scale, v_cache);
  const float* ksp = ks.defined() ? ks.data_ptr<float>() : nullptr;
  const float* vsp = vs.defined() ? vs.data_ptr<float>() : nullptr;
  const at::Tensor q32 = query.to(at::kFloat).contiguous();
  at::Tensor out32 = at::empty(q32.sizes(), q32.options());
  auto run_as = [&](auto element) {  // the cache's element type, by a value of it
    run<decltype(element)>(q32, k_cache, v_cache, tables, lens, scale, ksp, vsp, num_splits, window, logit_softcap,
                           out32);
  };
  switch (k_cache.scalar_type()) {
    case at::kFloat: run_as(float{}); break;
    case at::kBFloat16: run_as(bf16_t{}); break;
    case at::kHalf: run_as(fp16_t{}); break;
    case at::kFloat8_e4m3fn: run_as(fp8_t{}); break;
    default: TORCH_CHECK(false, "unsupported cache dtype ", k_cache.scalar_type());
  }
  return out32.to(query.scalar_type());
}

// Registered as torch.ops.kvfleet_kernels.paged_decode_cpu: no pybind, so the build stays small.
TORCH_LIBRARY_FRAGMENT(kvfleet_kernels, m) {
  m.def("paged_decode_cpu(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, Tensor? k_scale=None, Tensor? v_scale=None, int num_splits=0, "
        "int window=0, float logit_softcap=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvfleet_kernels, CPU, m) { m.impl("paged_decode_cpu", &paged_decode); }
