// PagedAttention decode: one new query token per sequence against its cached context.
//
// grid (num_seqs, num_kv_heads, num_partitions), kThreads threads; one thread block serves all
// the GQA query heads of its KV head, so each K/V row is read once for all of them.
//
// Split-K for long contexts (num_partitions > 1), the context cut into 512-token partitions:
//
//   positions  [0 ........ 511][512 ...... 1023][1024 .. ctx-1]
//   block z=   0               1                 2      (z >= ceil(ctx / 512): exits at once)
//   each writes  acc_z[D] (unnormalized), m_z (max logit), l_z (sum of exp(logit - m_z))
//
//   reduce:  out = sum_z exp(m_z - M) acc_z / sum_z exp(m_z - M) l_z,   M = max_z m_z
//
// Without split-K (num_partitions == 1) a block walks all of its context's tiles itself.
#include "attention.cuh"

namespace ps {

template <typename T, int D, int B>
__device__ __forceinline__ void paged_decode(T* __restrict__ out, float* __restrict__ part_out,
                                             float* __restrict__ part_max, float* __restrict__ part_sum,
                                             const T* __restrict__ query, const T* __restrict__ k_cache,
                                             const T* __restrict__ v_cache, const int* __restrict__ block_tables,
                                             const int* __restrict__ context_lens, float scale, int num_heads,
                                             int num_kv_heads, int max_blocks_per_seq, long long q_stride,
                                             int num_partitions) {
  const int seq = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int part = blockIdx.z;
  const int ctx = context_lens[seq];
  const bool split = num_partitions > 1;
  const int begin = split ? part * kPartition : 0;
  if (begin >= ctx) return;  // the whole block leaves together, before any barrier
  const int end = split ? min(ctx, begin + kPartition) : ctx;

  RowKeys keys{block_tables + (long long)seq * max_blocks_per_seq, begin, end, kv_head, num_kv_heads,
               num_heads / num_kv_heads};
  RowOutput<T> dst{out + (long long)seq * num_heads * D, nullptr, nullptr, nullptr, num_partitions};
  if (split) {
    const long long row = (long long)seq * num_heads * num_partitions + part;
    dst.partial = part_out + row * D;
    dst.max_logit = part_max + row;
    dst.exp_sum = part_sum + row;
  }
  attend<T, D, B>(query + seq * q_stride, dst, k_cache, v_cache, keys, scale);
}

// grid (num_seqs, num_heads), D threads: one output element per thread.
template <typename T, int D>
__device__ __forceinline__ void paged_decode_reduce(T* __restrict__ out, const float* __restrict__ part_out,
                                                    const float* __restrict__ part_max,
                                                    const float* __restrict__ part_sum,
                                                    const int* __restrict__ context_lens, int num_heads,
                                                    int num_partitions) {
  const int seq = blockIdx.x;
  const int head = blockIdx.y;
  const int n = (context_lens[seq] + kPartition - 1) / kPartition;
  const long long row = ((long long)seq * num_heads + head) * num_partitions;
  float m = neg_inf();
  for (int p = 0; p < n; ++p) m = fmaxf(m, part_max[row + p]);
  float denom = 0.f;
  for (int p = 0; p < n; ++p) denom += part_sum[row + p] * expf(part_max[row + p] - m);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float sum = 0.f;
    for (int p = 0; p < n; ++p) sum += part_out[(row + p) * D + d] * expf(part_max[row + p] - m);
    out[((long long)seq * num_heads + head) * D + d] = from_float<T>(sum / denom);
  }
}

}  // namespace ps

#define PS_PAGED_DECODE(tname, head, block)                                                                   \
  extern "C" __global__ void __launch_bounds__(ps::kThreads) PS_NAME_THB(ps_paged_decode, tname, head, block)( \
      PS_TYPE(tname)* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_max,            \
      float* __restrict__ part_sum, const PS_TYPE(tname)* __restrict__ query,                                 \
      const PS_TYPE(tname)* __restrict__ k_cache, const PS_TYPE(tname)* __restrict__ v_cache,                 \
      const int* __restrict__ block_tables, const int* __restrict__ context_lens, float scale, int num_heads,  \
      int num_kv_heads, int max_blocks_per_seq, long long q_stride, int num_partitions) {                     \
    ps::paged_decode<PS_TYPE(tname), head, block>(out, part_out, part_max, part_sum, query, k_cache, v_cache,  \
                                                  block_tables, context_lens, scale, num_heads, num_kv_heads,  \
                                                  max_blocks_per_seq, q_stride, num_partitions);               \
  }                                                                                                             \
  PS_EXPORT_KERNEL(PS_NAME_THB(ps_paged_decode, tname, head, block))

#define PS_PAGED_DECODE_REDUCE(tname, head)                                                                    \
  extern "C" __global__ void PS_NAME_TH(ps_paged_decode_reduce, tname, head)(                                   \
      PS_TYPE(tname)* __restrict__ out, const float* __restrict__ part_out, const float* __restrict__ part_max, \
      const float* __restrict__ part_sum, const int* __restrict__ context_lens, int num_heads,                 \
      int num_partitions) {                                                                                     \
    ps::paged_decode_reduce<PS_TYPE(tname), head>(out, part_out, part_max, part_sum, context_lens, num_heads,  \
                                                  num_partitions);                                             \
  }                                                                                                             \
  PS_EXPORT_KERNEL(PS_NAME_TH(ps_paged_decode_reduce, tname, head))

PS_FOR_EACH_CONFIG(PS_PAGED_DECODE)
PS_FOR_EACH_DTYPE_HEAD(PS_PAGED_DECODE_REDUCE)
