// Writes into the paged KV pool: reshape_and_cache (new K/V rows into their slots) and
// copy_blocks (whole blocks, every layer, for copy-on-write).
//
//   k_cache[num_blocks, block_size, num_kv_heads, head_dim]  ==  rows[num_blocks * block_size][row]
//   slot = block_id * block_size + offset; a token's row is num_kv_heads * head_dim contiguous
//   elements, so the slot alone addresses it and no kernel here needs the block size.
#include "common.cuh"

namespace ps {

// One thread block per new token; a negative slot (padding) is skipped.
template <typename T>
__device__ __forceinline__ void reshape_and_cache(const T* __restrict__ key, const T* __restrict__ value,
                                                  T* __restrict__ k_cache, T* __restrict__ v_cache,
                                                  const long long* __restrict__ slot_mapping,
                                                  long long key_stride, long long value_stride, int row_elems) {
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;
  const T* k_src = key + token * key_stride;
  const T* v_src = value + token * value_stride;
  T* k_dst = k_cache + slot * row_elems;
  T* v_dst = v_cache + slot * row_elems;
  for (int i = threadIdx.x; i < row_elems; i += blockDim.x) {
    k_dst[i] = k_src[i];
    v_dst[i] = v_src[i];
  }
}

}  // namespace ps

#define PS_RESHAPE_AND_CACHE(tname)                                                                          \
  extern "C" __global__ void PS_NAME_T(ps_reshape_and_cache, tname)(                                          \
      const PS_TYPE(tname)* __restrict__ key, const PS_TYPE(tname)* __restrict__ value,                        \
      PS_TYPE(tname)* __restrict__ k_cache, PS_TYPE(tname)* __restrict__ v_cache,                              \
      const long long* __restrict__ slot_mapping, long long key_stride, long long value_stride, int row_elems) { \
    ps::reshape_and_cache<PS_TYPE(tname)>(key, value, k_cache, v_cache, slot_mapping, key_stride,              \
                                          value_stride, row_elems);                                           \
  }                                                                                                            \
  PS_EXPORT_KERNEL(PS_NAME_T(ps_reshape_and_cache, tname))

PS_FOR_EACH_DTYPE(PS_RESHAPE_AND_CACHE)

// Copy-on-write: grid (num_layers, num_pairs). The caches are addressed through arrays of
// per-layer base pointers and copied as 32-bit words, so one kernel serves every dtype.
extern "C" __global__ void ps_copy_blocks(const long long* __restrict__ k_cache_ptrs,
                                          const long long* __restrict__ v_cache_ptrs,
                                          const long long* __restrict__ block_mapping, long long words_per_block) {
  const int layer = blockIdx.x;
  const int pair = blockIdx.y;
  const long long src = block_mapping[2 * pair] * words_per_block;
  const long long dst = block_mapping[2 * pair + 1] * words_per_block;
  unsigned int* k = reinterpret_cast<unsigned int*>(k_cache_ptrs[layer]);
  unsigned int* v = reinterpret_cast<unsigned int*>(v_cache_ptrs[layer]);
  for (long long i = threadIdx.x; i < words_per_block; i += blockDim.x) {
    k[dst + i] = k[src + i];
    v[dst + i] = v[src + i];
  }
}
PS_EXPORT_KERNEL(ps_copy_blocks)
