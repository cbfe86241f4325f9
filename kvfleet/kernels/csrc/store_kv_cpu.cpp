// KV store on CPU: copy each new token's K and V rows to its slot of the paged cache.
//
//   key/value [num_tokens, num_kv_heads, head_dim] ──slot_mapping──▶ cache[slot / bs, head, slot % bs, :]
//
// Rows are moved as bytes: the caller has already converted (or FP8-quantised) them to the cache's
// dtype. Negative slots are padding and skipped; a slot past the pool is an error, never a write.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

void store_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
              const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "key, value: [num_tokens, num_kv_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "K and V caches must share shape and strides");
  TORCH_CHECK(key.size(1) == k_cache.size(1) && key.size(2) == k_cache.size(3), "key does not fit the cache");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type(),
              "convert K/V to the cache dtype first");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && k_cache.stride(3) == 1, "rows must be contiguous");
  TORCH_CHECK(slot_mapping.numel() == key.size(0), "one slot per token");
  TORCH_CHECK(key.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors expected");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1);
  const int64_t block_size = k_cache.size(2);
  const int64_t num_slots = k_cache.size(0) * block_size;
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(sp[t] < num_slots, "slot ", sp[t], " is outside the pool of ", num_slots, " slots");

  const int64_t row_bytes = key.size(2) * key.element_size();
  const int64_t esize = key.element_size();
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  at::parallel_for(0, num_tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = sp[t];
      if (slot < 0) continue;
      const int64_t base = (slot / block_size) * k_cache.stride(0) + (slot % block_size) * k_cache.stride(2);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t dst = (base + h * k_cache.stride(1)) * esize;
        std::memcpy(kc + dst, kp + (t * key.stride(0) + h * key.stride(1)) * esize, row_bytes);
        std::memcpy(vc + dst, vp + (t * value.stride(0) + h * value.stride(1)) * esize, row_bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_kernels, m) {
  m.def("store_kv_cpu(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(kvfleet_kernels, CPU, m) { m.impl("store_kv_cpu", &store_kv); }
