// The step's keys and values into their slots of the paged KV pools: the layout the attention
// kernels (paged_*_attention.cpp) read, [num_blocks, block_size, Hkv, D] per layer, float32 or
// bfloat16. The torch backend does this with two index_copy_ calls; their dispatch cost more than
// the copy at decode sizes.
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

namespace {

template <class KV>
void store_rows(const at::Tensor& x, at::Tensor& pool, const int64_t* slots, int64_t T) {
  const int64_t heads = x.size(1), D = x.size(2), xs0 = x.stride(0), xs1 = x.stride(1);
  const float* xp = x.data_ptr<float>();
  KV* pp = pool.data_ptr<KV>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const float* src = xp + t * xs0 + h * xs1;
      KV* dst = pp + (slots[t] * heads + h) * D;
      for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<KV>(src[i]);
    }
}

}  // namespace

// This step's keys and values into their slots of the paged pools: k, v [T, Hkv, D] float32 (each
// head's D values contiguous), pools [num_blocks, block_size, Hkv, D] float32 or bfloat16 (rounded to
// nearest even, as torch's .to() rounds), slot_mapping [T] int64. What two index_copy_ calls do, in
// one call without torch's dispatch (about 3 us each from C++ on a 2-core Xeon, whose decode layer
// does about 39 us of work besides its projections).
void store_kv(at::Tensor k, at::Tensor v, at::Tensor k_pool, at::Tensor v_pool, at::Tensor slot_mapping) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.dim() == 3 && k.sizes() == v.sizes() &&
                  k.stride(2) == 1 && v.stride(2) == 1, "store_kv: k and v must be float32 [T, Hkv, D] with contiguous heads");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  k_pool.scalar_type() == v_pool.scalar_type() && k_pool.size(2) == k.size(1) && k_pool.size(3) == k.size(2),
              "store_kv: the pools must be contiguous [num_blocks, block_size, Hkv, D] of one dtype");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t T = k.size(0), num_slots = k_pool.size(0) * k_pool.size(1);
  TORCH_CHECK(slots.numel() == T, "store_kv: one slot a token");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "store_kv: slot ", sp[t], " out of range");
  if (k_pool.scalar_type() == at::kFloat) {
    store_rows<float>(k, k_pool, sp, T);
    store_rows<float>(v, v_pool, sp, T);
  } else {
    TORCH_CHECK(k_pool.scalar_type() == at::kBFloat16, "store_kv: float32 or bfloat16 pools");
    store_rows<c10::BFloat16>(k, k_pool, sp, T);
    store_rows<c10::BFloat16>(v, v_pool, sp, T);
  }
}
