// Paged prefill attention: the new tokens of every sequence (concatenated) against the
// sequence's cached prefix and, causally, each other. Their own K/V are already in the pool.
//
//   query_start_loc  [0, q0, q0+q1, ...]   new tokens of sequence s: rows [qsl[s], qsl[s+1])
//   row i of sequence s sits at position  context_lens[s] - q_len_s + i  and reads keys [0, pos]
//
// grid (num_tokens, num_kv_heads), kThreads threads: one thread block per (query row, KV head)
// serves that KV head's GQA query heads, walking the row's keys in tiles (attention.cuh).
#include "attention.cuh"

namespace ps {

template <typename T, int D, int B>
__device__ __forceinline__ void paged_prefill(T* __restrict__ out, const T* __restrict__ query,
                                              const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                                              const int* __restrict__ block_tables,
                                              const int* __restrict__ query_start_loc,
                                              const int* __restrict__ context_lens, float scale, int num_seqs,
                                              int num_heads, int num_kv_heads, int max_blocks_per_seq,
                                              long long q_stride) {
  const int token = blockIdx.x;
  const int kv_head = blockIdx.y;
  int lo = 0, hi = num_seqs - 1;  // the last sequence whose first row is <= token
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (query_start_loc[mid] <= token) lo = mid; else hi = mid - 1;
  }
  const int seq = lo;
  const int q_len = query_start_loc[seq + 1] - query_start_loc[seq];
  const int pos = context_lens[seq] - q_len + (token - query_start_loc[seq]);

  RowKeys keys{block_tables + (long long)seq * max_blocks_per_seq, 0, pos + 1, kv_head, num_kv_heads,
               num_heads / num_kv_heads};
  RowOutput<T> dst{out + (long long)token * num_heads * D, nullptr, nullptr, nullptr, 1};
  attend<T, D, B>(query + token * q_stride, dst, k_cache, v_cache, keys, scale);
}

}  // namespace ps

#define PS_PAGED_PREFILL(tname, head, block)                                                                   \
  extern "C" __global__ void __launch_bounds__(ps::kThreads) PS_NAME_THB(ps_paged_prefill, tname, head, block)( \
      PS_TYPE(tname)* __restrict__ out, const PS_TYPE(tname)* __restrict__ query,                              \
      const PS_TYPE(tname)* __restrict__ k_cache, const PS_TYPE(tname)* __restrict__ v_cache,                  \
      const int* __restrict__ block_tables, const int* __restrict__ query_start_loc,                           \
      const int* __restrict__ context_lens, float scale, int num_seqs, int num_heads, int num_kv_heads,        \
      int max_blocks_per_seq, long long q_stride) {                                                            \
    ps::paged_prefill<PS_TYPE(tname), head, block>(out, query, k_cache, v_cache, block_tables, query_start_loc, \
                                                   context_lens, scale, num_seqs, num_heads, num_kv_heads,      \
                                                   max_blocks_per_seq, q_stride);                               \
  }                                                                                                              \
  PS_EXPORT_KERNEL(PS_NAME_THB(ps_paged_prefill, tname, head, block))

PS_FOR_EACH_CONFIG(PS_PAGED_PREFILL)
