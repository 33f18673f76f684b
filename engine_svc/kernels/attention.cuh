// The block-level attention routine that paged decode and paged prefill share: one thread block
// computes, for one query row and one KV head, the outputs of that KV head's GQA query heads
// over a range of key positions read from the paged pool.
//
// Work split inside the block (T = cache element type, D = head size, VEC = 16 bytes of T):
//
//   key tokens of a tile:  t0 t1 t2 t3 t4 t5 t6 t7 ...
//   warp 0  lanes 0..G-1 -> t0    lanes G..2G-1 -> t1  ...   (G = D / VEC lanes per token,
//   warp 1  lanes 0..G-1 -> tT    ...                         T = 32 / G tokens per warp step)
//   each lane holds one VEC-wide slice of q (and later of the output accumulator)
//
// Keys are visited in tiles of kPartition (512) positions with an online softmax across tiles:
//   phase 1  logits[h][t] = q_h . k_t * scale      (group butterfly sums, into shared memory)
//   phase 2  tile max / exp / sum per head          (block reductions), rescale the running state
//   phase 3  acc_h += p[h][t] * v_t                 (per lane, VEC elements per head)
// Split-K (paged decode with partitions) gives each block one tile and hands the unnormalized
// accumulator, running max and exp-sum to the reduce kernel.
#ifndef PAGEDSERVE_KERNELS_ATTENTION_CUH
#define PAGEDSERVE_KERNELS_ATTENTION_CUH

#include "common.cuh"

namespace ps {

constexpr int kThreads = 128;       // 4 warps per block
constexpr int kWarps = kThreads / PS_WARP_SIZE;
constexpr int kPartition = 512;     // key positions per tile and per split-K partition
constexpr int kHeadChunk = 4;       // query heads of one KV head served per pass (registers)

template <typename T, int D>
struct TileLayout {
  static constexpr int VEC = 16 / sizeof(T);
  static constexpr int LANES_PER_TOKEN = D / VEC;
  static constexpr int TOKENS_PER_WARP = PS_WARP_SIZE / LANES_PER_TOKEN;
  static constexpr int GROUPS = kWarps * TOKENS_PER_WARP;  // key tokens in flight per block step
  static_assert(LANES_PER_TOKEN <= PS_WARP_SIZE && PS_WARP_SIZE % LANES_PER_TOKEN == 0, "head size");
};

// Dynamic shared memory the attention kernels need (bytes): the logits of one tile.
constexpr int kAttentionSharedBytes = kHeadChunk * kPartition * sizeof(float);

// Where one block's results go. Final mode writes normalized T outputs; partial mode (split-K)
// writes float32 accumulators plus the running max and exp-sum for the reduce kernel.
template <typename T>
struct RowOutput {
  T* out;                // final: head h at out + h * D
  float* partial;        // partial: head h at partial + h * head_stride * D (nullptr: final mode)
  float* max_logit;      // partial: head h at max_logit[h * head_stride]
  float* exp_sum;
  int head_stride;
};

struct RowKeys {
  const int* block_table;  // the sequence's physical blocks
  int begin, end;          // key positions [begin, end)
  int kv_head, num_kv_heads, group_size;  // group_size = query heads per KV head
};

template <typename T, int D, int B>
__device__ __forceinline__ const T* token_row(const T* cache, const RowKeys& keys, int pos) {
  const long long block = keys.block_table[pos / B];
  return cache + ((block * B + pos % B) * keys.num_kv_heads + keys.kv_head) * D;
}

// Where this thread sits in the work split (see the diagram at the top).
template <typename T, int D>
struct LanePlace {
  using L = TileLayout<T, D>;
  int tid, warp, lane, token_in_warp, sub, group;
  __device__ __forceinline__ LanePlace() {
    tid = threadIdx.x;
    warp = tid / PS_WARP_SIZE;
    lane = tid % PS_WARP_SIZE;
    token_in_warp = lane / L::LANES_PER_TOKEN;
    sub = lane % L::LANES_PER_TOKEN;  // which VEC slice of a head this lane holds
    group = warp * L::TOKENS_PER_WARP + token_in_warp;
  }
};

// A lane's share of up to kHeadChunk query heads: q and output slices, online-softmax state.
template <int VEC>
struct HeadChunk {
  int count;  // heads in use (uniform across the block)
  float q[kHeadChunk][VEC], acc[kHeadChunk][VEC], m_run[kHeadChunk], l_run[kHeadChunk];
};

template <typename T, int D, int VEC>
__device__ __forceinline__ void load_queries(HeadChunk<VEC>& c, const T* q_row, int first_head, int count,
                                             const LanePlace<T, D>& at) {
  c.count = count;
#pragma unroll
  for (int g = 0; g < kHeadChunk; ++g) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) c.q[g][i] = c.acc[g][i] = 0.f;
    if (g < count) load_vec<T, VEC>(q_row + (first_head + g) * D + at.sub * VEC, c.q[g]);
    c.m_run[g] = neg_inf();
    c.l_run[g] = 0.f;
  }
}

// phase 1: logits[g][t] for the tile's n tokens (every lane runs the same trip count, so the
// group shuffles always converge).
template <typename T, int D, int B, int VEC>
__device__ __forceinline__ void tile_logits(const HeadChunk<VEC>& c, const T* __restrict__ k_cache, const RowKeys& keys,
                                            int tile, int n, float scale, float* logits, const LanePlace<T, D>& at) {
  using L = TileLayout<T, D>;
  for (int base = at.warp * L::TOKENS_PER_WARP; base < n; base += kWarps * L::TOKENS_PER_WARP) {
    const int t = base + at.token_in_warp;
    float k[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) k[i] = 0.f;
    if (t < n) load_vec<T, VEC>(token_row<T, D, B>(k_cache, keys, tile + t) + at.sub * VEC, k);
#pragma unroll
    for (int g = 0; g < kHeadChunk; ++g) {
      if (g < c.count) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) dot += c.q[g][i] * k[i];
        dot = group_sum<L::LANES_PER_TOKEN>(dot);
        if (at.sub == 0 && t < n) logits[g * kPartition + t] = dot * scale;
      }
    }
  }
}

// phase 2: the tile's max and exp-sum per head (block reductions); logits become p = exp(l - max)
// and the running state (and the accumulators) are rescaled to the new max.
template <typename T, int D, int VEC>
__device__ __forceinline__ void tile_softmax(HeadChunk<VEC>& c, int n, float* logits, float (*red_max)[kHeadChunk],
                                             float (*red_sum)[kHeadChunk], const LanePlace<T, D>& at) {
#pragma unroll
  for (int g = 0; g < kHeadChunk; ++g) {
    if (g < c.count) {
      float m = neg_inf();
      for (int t = at.tid; t < n; t += kThreads) m = fmaxf(m, logits[g * kPartition + t]);
      m = group_max<PS_WARP_SIZE>(m);
      if (at.lane == 0) red_max[at.warp][g] = m;
    }
  }
  __syncthreads();
  float new_max[kHeadChunk];
#pragma unroll
  for (int g = 0; g < kHeadChunk; ++g) {
    new_max[g] = c.m_run[g];
    if (g < c.count) {
      for (int w = 0; w < kWarps; ++w) new_max[g] = fmaxf(new_max[g], red_max[w][g]);
      float sum = 0.f;
      for (int t = at.tid; t < n; t += kThreads) {
        const float p = expf(logits[g * kPartition + t] - new_max[g]);
        logits[g * kPartition + t] = p;
        sum += p;
      }
      sum = group_sum<PS_WARP_SIZE>(sum);
      if (at.lane == 0) red_sum[at.warp][g] = sum;
    }
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < kHeadChunk; ++g) {
    if (g < c.count) {
      const float alpha = expf(c.m_run[g] - new_max[g]);  // 0 on the first tile (m_run = -inf)
      float tile_sum = 0.f;
      for (int w = 0; w < kWarps; ++w) tile_sum += red_sum[w][g];
      c.l_run[g] = c.l_run[g] * alpha + tile_sum;
      c.m_run[g] = new_max[g];
#pragma unroll
      for (int i = 0; i < VEC; ++i) c.acc[g][i] *= alpha;
    }
  }
}

// phase 3: acc += p * v over this lane's tokens (no shuffles: lanes past the end just skip).
template <typename T, int D, int B, int VEC>
__device__ __forceinline__ void tile_accumulate(HeadChunk<VEC>& c, const T* __restrict__ v_cache, const RowKeys& keys,
                                                int tile, int n, const float* logits, const LanePlace<T, D>& at) {
  using L = TileLayout<T, D>;
  for (int base = at.warp * L::TOKENS_PER_WARP; base < n; base += kWarps * L::TOKENS_PER_WARP) {
    const int t = base + at.token_in_warp;
    if (t >= n) continue;
    float v[VEC];
    load_vec<T, VEC>(token_row<T, D, B>(v_cache, keys, tile + t) + at.sub * VEC, v);
#pragma unroll
    for (int g = 0; g < kHeadChunk; ++g) {
      if (g < c.count) {
        const float p = logits[g * kPartition + t];
#pragma unroll
        for (int i = 0; i < VEC; ++i) c.acc[g][i] += p * v[i];
      }
    }
  }
}

// Sum the per-group accumulators of the chunk and write heads first_head.. (final or partial).
template <typename T, int D, int VEC>
__device__ __forceinline__ void write_heads(const HeadChunk<VEC>& c, const RowOutput<T>& dst, int first_head,
                                            float (*red_acc)[kHeadChunk][D], float* row_max, float* row_sum,
                                            const LanePlace<T, D>& at) {
  using L = TileLayout<T, D>;
#pragma unroll
  for (int g = 0; g < kHeadChunk; ++g) {
    if (g < c.count) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) red_acc[at.group][g][at.sub * VEC + i] = c.acc[g][i];
      if (at.tid == 0) {
        row_max[g] = c.m_run[g];
        row_sum[g] = c.l_run[g];
      }
    }
  }
  __syncthreads();
  for (int e = at.tid; e < c.count * D; e += kThreads) {
    const int g = e / D;
    const int d = e % D;
    float sum = 0.f;
    for (int k = 0; k < L::GROUPS; ++k) sum += red_acc[k][g][d];
    const int h = first_head + g;
    if (dst.partial != nullptr) {
      dst.partial[(long long)h * dst.head_stride * D + d] = sum;
      if (d == 0) {
        dst.max_logit[(long long)h * dst.head_stride] = row_max[g];
        dst.exp_sum[(long long)h * dst.head_stride] = row_sum[g];
      }
    } else {
      dst.out[h * D + d] = from_float<T>(sum / row_sum[g]);
    }
  }
  __syncthreads();  // red_acc and row_* are reused by the next chunk of heads
}

template <typename T, int D, int B>
__device__ __forceinline__ void attend(const T* __restrict__ q_row, const RowOutput<T>& dst, const T* __restrict__ k_cache,
                       const T* __restrict__ v_cache, const RowKeys& keys, float scale) {
  using L = TileLayout<T, D>;
  PS_DYNAMIC_SHARED(float, ps_attention_logits);  // [kHeadChunk][kPartition]
  __shared__ float red_max[kWarps][kHeadChunk];
  __shared__ float red_sum[kWarps][kHeadChunk];
  __shared__ float red_acc[L::GROUPS][kHeadChunk][D];
  __shared__ float row_max[kHeadChunk];
  __shared__ float row_sum[kHeadChunk];
  const LanePlace<T, D> at;
  const int first_head = keys.kv_head * keys.group_size;

  for (int g0 = 0; g0 < keys.group_size; g0 += kHeadChunk) {
    HeadChunk<L::VEC> chunk;
    load_queries<T, D>(chunk, q_row, first_head + g0, min(kHeadChunk, keys.group_size - g0), at);
    for (int tile = keys.begin; tile < keys.end; tile += kPartition) {
      const int n = min(kPartition, keys.end - tile);
      tile_logits<T, D, B>(chunk, k_cache, keys, tile, n, scale, ps_attention_logits, at);
      __syncthreads();
      tile_softmax<T, D>(chunk, n, ps_attention_logits, red_max, red_sum, at);
      tile_accumulate<T, D, B>(chunk, v_cache, keys, tile, n, ps_attention_logits, at);
      __syncthreads();  // the next tile overwrites the logits and the reduction buffers
    }
    write_heads<T, D>(chunk, dst, first_head + g0, red_acc, row_max, row_sum, at);
  }
}

}  // namespace ps

#endif  // PAGEDSERVE_KERNELS_ATTENTION_CUH
