// Paged prefill attention: the new tokens of every sequence (concatenated) against the
// sequence's cached prefix and, causally, each other. Their own K/V are already in the pool.
//
//   query_start_loc  [0, q0, q0+q1, ...]   new tokens of sequence s: rows [qsl[s], qsl[s+1])
//   row i of sequence s sits at position  context_lens[s] - q_len_s + i  and reads keys [0, pos]
//
// Tiled kernel (FlashAttention-2 on CUDA cores), grid (tiles, num_kv_heads, head chunks), kThreads
// threads. A block serves kTileQueries = 32 query vectors: R = 32 / H consecutive rows of one
// sequence times the H query heads of its KV head (H = min(group, 32); wider GQA groups take
// several blocks along z). It walks the keys [0, its last row's position] in tiles of N = 2048 / D
// positions; each K/V tile crosses from the paged pool into shared memory once and serves all 32
// query vectors (the old kernel read the prefix once per row: O(n^2) global reads).
//
//                 keys ->  tile 0    tile 1    tile 2    tile 3
//   rows r0 .. r0+R-1     [ full ]  [ full ]  [ diag ]            tile 3 is never loaded: it lies
//                                                                  above the last row's position
//   query vector v = (row v / H, head v % H), served by threads 4v .. 4v+3 (lane c = t % 4):
//     S = q k^T   lane c scores keys c, c+4, c+8, ... of the tile; online softmax in registers,
//                 max and sum over the 4 lanes by shuffles; p goes to shared memory (p_tile)
//     O += p v    lane c accumulates output dims 16i + 4c .. 16i + 4c + 3 (float32)
//   The next K/V tile is fetched into registers while the current one is computed.
//
// Shared memory (float32 whatever the cache type, rows padded by 4 floats so that the 16-byte
// reads of 4 lanes never share a bank): q 32 x (D+4), k and v N x (D+4), p 32 x (N+1):
// 35,968 bytes at D = 128 (N = 16), 30,336 bytes at D = 64 (N = 32), all static.
//
// Tile index -> (sequence, first row) without a device->host sync: sequence s owns the tiles
// s + qsl[s] / R, s + qsl[s] / R + 1, ... (ceil(q_len / R) of them), which never overlap, so
// num_tokens / R + num_seqs tiles cover any batch; a tile past its sequence's rows exits at once.
//
// Single-row kernel, grid (num_seqs, num_kv_heads): sequences with one new token (the decode rows
// of a mixed batch) go through the row routine of attention.cuh instead. A tiled block walks its
// keys N at a time with one query row in use; the row routine walks them 512 at a time with all
// its threads, so a long-context decode row does not wait on the tiled kernel's short steps.
#include "attention.cuh"

namespace ps {

constexpr int kTileQueries = 32;                         // query vectors (row, head) per tiled block
constexpr int kLanesPerQuery = kThreads / kTileQueries;  // 4 threads per query vector
constexpr int kTileElems = 2048;                         // elements of one K (or V) tile: N * D
constexpr int kRowPad = 4;                               // floats after each shared-memory row

template <typename T, int D>
struct PrefillLayout {
  static constexpr int N = kTileElems / D;                   // key positions per tile
  static constexpr int VEC = 16 / sizeof(T);                 // elements per 16-byte global load
  static constexpr int CHUNKS = D / VEC;                     // 16-byte chunks per K/V row
  static constexpr int LOADS = kTileElems / VEC / kThreads;  // chunks per thread per K (or V) tile
  static constexpr int ROW = D + kRowPad;
  static constexpr int KEYS_PER_LANE = N / kLanesPerQuery;
  static constexpr int DIMS_PER_LANE = D / kLanesPerQuery;
  static_assert(kLanesPerQuery == 4 && N % kLanesPerQuery == 0 && D % 16 == 0, "tile shape");
  static_assert(kTileElems % (VEC * kThreads) == 0, "every thread loads whole chunks");
};

// Which query vectors one tiled block serves. Vector v < num_valid is (row v / per_block, head
// v % per_block); vectors past num_valid repeat the last valid one (computed, never written).
struct QueryTile {
  int seq, first_token, rows, first_pos;  // first_token: the tile's first row in query / out
  int first_head, per_block, num_valid;   // query heads first_head .. first_head + per_block - 1

  __device__ __forceinline__ int row_of(int v) const { return min(v, num_valid - 1) / per_block; }
  __device__ __forceinline__ int head_of(int v) const { return first_head + min(v, num_valid - 1) % per_block; }
};

// False when this block has nothing to do (a tile past its sequence's rows, or a single-row sequence).
__device__ __forceinline__ bool locate_tile(QueryTile& t, const int* __restrict__ query_start_loc,
                                            const int* __restrict__ context_lens, int num_seqs, int group) {
  t.per_block = min(group, kTileQueries);
  const int rows_per_tile = kTileQueries / t.per_block;
  const int tile = blockIdx.x;
  int lo = 0, hi = num_seqs - 1;  // the last sequence s with s + qsl[s] / R <= tile
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (mid + query_start_loc[mid] / rows_per_tile <= tile) lo = mid; else hi = mid - 1;
  }
  t.seq = lo;
  const int q_len = query_start_loc[lo + 1] - query_start_loc[lo];
  const int first_row = (tile - lo - query_start_loc[lo] / rows_per_tile) * rows_per_tile;
  if (q_len < 2 || first_row >= q_len) return false;
  t.first_token = query_start_loc[lo] + first_row;
  t.rows = min(rows_per_tile, q_len - first_row);
  t.first_pos = context_lens[lo] - q_len + first_row;
  const int chunk_first = blockIdx.z * t.per_block;  // first head of this chunk within the group
  t.first_head = blockIdx.y * group + chunk_first;
  t.num_valid = t.rows * min(t.per_block, group - chunk_first);  // rows == 1 whenever heads < per_block
  return true;
}

template <int VEC>
__device__ __forceinline__ void store_floats(float* dst, const float (&src)[VEC]) {
#pragma unroll
  for (int i = 0; i < VEC; i += 4) {
    *reinterpret_cast<Vec<float, 4>*>(dst + i) = Vec<float, 4>{{src[i], src[i + 1], src[i + 2], src[i + 3]}};
  }
}

// One K/V tile in flight: fetched into registers a tile ahead, stored to shared memory at the
// next barrier. Positions past keys.end are zeros (their slots are never read from the pool).
template <typename T, int D, int B>
struct KvStage {
  using L = PrefillLayout<T, D>;
  Vec<T, L::VEC> k_chunk[L::LOADS], v_chunk[L::LOADS];

  __device__ __forceinline__ void fetch(const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                                        const RowKeys& keys, int k0) {
#pragma unroll
    for (int i = 0; i < L::LOADS; ++i) {
      const int e = threadIdx.x + i * kThreads;
      const int pos = k0 + e / L::CHUNKS;
      const int offset = e % L::CHUNKS * L::VEC;
      if (pos < keys.end) {
        k_chunk[i] = *reinterpret_cast<const Vec<T, L::VEC>*>(token_row<T, D, B>(k_cache, keys, pos) + offset);
        v_chunk[i] = *reinterpret_cast<const Vec<T, L::VEC>*>(token_row<T, D, B>(v_cache, keys, pos) + offset);
      } else {
#pragma unroll
        for (int j = 0; j < L::VEC; ++j) k_chunk[i].v[j] = v_chunk[i].v[j] = from_float<T>(0.f);
      }
    }
  }

  __device__ __forceinline__ void store(float (*k_tile)[L::ROW], float (*v_tile)[L::ROW]) const {
#pragma unroll
    for (int i = 0; i < L::LOADS; ++i) {
      const int e = threadIdx.x + i * kThreads;
      float kf[L::VEC], vf[L::VEC];
#pragma unroll
      for (int j = 0; j < L::VEC; ++j) {
        kf[j] = to_float(k_chunk[i].v[j]);
        vf[j] = to_float(v_chunk[i].v[j]);
      }
      store_floats<L::VEC>(&k_tile[e / L::CHUNKS][e % L::CHUNKS * L::VEC], kf);
      store_floats<L::VEC>(&v_tile[e / L::CHUNKS][e % L::CHUNKS * L::VEC], vf);
    }
  }
};

template <typename T, int D>
__device__ __forceinline__ void load_query_tile(float (*q_tile)[PrefillLayout<T, D>::ROW], const T* __restrict__ query,
                                                long long q_stride, const QueryTile& t) {
  using L = PrefillLayout<T, D>;
  for (int e = threadIdx.x; e < kTileQueries * L::CHUNKS; e += kThreads) {
    const int v = e / L::CHUNKS;
    const int offset = e % L::CHUNKS * L::VEC;
    float x[L::VEC];
    load_vec<T, L::VEC>(query + (t.first_token + t.row_of(v)) * q_stride + t.head_of(v) * D + offset, x);
    store_floats<L::VEC>(&q_tile[v][offset], x);
  }
}

// One query vector's online-softmax state, as this lane holds it (m and l agree across its 4 lanes).
template <int D>
struct QueryState {
  float m, l, acc[D / kLanesPerQuery];  // acc[4i + e]: output dim 16i + 4 lane + e
};

// S for this lane's keys of the tile, causally masked; p = exp(s - new max) into p_tile; the
// running max, sum and accumulators rescaled. Every lane of the warp calls it (shuffles).
template <typename T, int D>
__device__ __forceinline__ void tile_scores(QueryState<D>& st, const float (*q_tile)[PrefillLayout<T, D>::ROW],
                                            const float (*k_tile)[PrefillLayout<T, D>::ROW],
                                            float (*p_tile)[PrefillLayout<T, D>::N + 1], int v, int lane, int k0,
                                            int pos, float scale) {
  using L = PrefillLayout<T, D>;
  float s[L::KEYS_PER_LANE];
#pragma unroll
  for (int j = 0; j < L::KEYS_PER_LANE; ++j) s[j] = 0.f;
#pragma unroll 4
  for (int d = 0; d < D; d += 4) {
    float q[4];
    load_vec<float, 4>(&q_tile[v][d], q);
#pragma unroll
    for (int j = 0; j < L::KEYS_PER_LANE; ++j) {
      float k[4];
      load_vec<float, 4>(&k_tile[lane + kLanesPerQuery * j][d], k);
      s[j] += q[0] * k[0] + q[1] * k[1] + q[2] * k[2] + q[3] * k[3];
    }
  }
  float tile_max = neg_inf();
#pragma unroll
  for (int j = 0; j < L::KEYS_PER_LANE; ++j) {
    s[j] = k0 + lane + kLanesPerQuery * j <= pos ? s[j] * scale : neg_inf();  // selected, never multiplied away
    tile_max = fmaxf(tile_max, s[j]);
  }
  // Finite from the first tile on: key 0 is visible to every row.
  const float new_max = fmaxf(st.m, group_max<kLanesPerQuery>(tile_max));
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < L::KEYS_PER_LANE; ++j) {
    const float p = expf(s[j] - new_max);
    p_tile[v][lane + kLanesPerQuery * j] = p;
    sum += p;
  }
  const float alpha = expf(st.m - new_max);  // 0 on the first tile (m = -inf)
  st.l = st.l * alpha + group_sum<kLanesPerQuery>(sum);
  st.m = new_max;
#pragma unroll
  for (int i = 0; i < L::DIMS_PER_LANE; ++i) st.acc[i] *= alpha;
}

// O += p v over the tile's keys this query vector can see (n <= pos - k0).
template <typename T, int D>
__device__ __forceinline__ void tile_accumulate(QueryState<D>& st, const float (*v_tile)[PrefillLayout<T, D>::ROW],
                                                const float (*p_tile)[PrefillLayout<T, D>::N + 1], int v, int lane,
                                                int num_keys) {
  for (int n = 0; n < num_keys; ++n) {
    const float p = p_tile[v][n];
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      float x[4];
      load_vec<float, 4>(&v_tile[n][16 * i + 4 * lane], x);
#pragma unroll
      for (int e = 0; e < 4; ++e) st.acc[4 * i + e] += p * x[e];
    }
  }
}

template <typename T, int D, int B>
__device__ __forceinline__ void paged_prefill(T* __restrict__ out, const T* __restrict__ query,
                                              const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                                              const int* __restrict__ block_tables,
                                              const int* __restrict__ query_start_loc,
                                              const int* __restrict__ context_lens, float scale, int num_seqs,
                                              int num_heads, int num_kv_heads, int max_blocks_per_seq,
                                              long long q_stride) {
  using L = PrefillLayout<T, D>;
  __shared__ __align__(16) float q_tile[kTileQueries][L::ROW];
  __shared__ __align__(16) float k_tile[L::N][L::ROW];
  __shared__ __align__(16) float v_tile[L::N][L::ROW];
  __shared__ float p_tile[kTileQueries][L::N + 1];
  const int group = num_heads / num_kv_heads;
  QueryTile t;
  if (!locate_tile(t, query_start_loc, context_lens, num_seqs, group)) return;  // the whole block, before any barrier
  const int kv_end = t.first_pos + t.rows;  // keys past the last row's position are never loaded
  const RowKeys keys{block_tables + (long long)t.seq * max_blocks_per_seq, 0, kv_end, (int)blockIdx.y, num_kv_heads,
                     group};
  load_query_tile<T, D>(q_tile, query, q_stride, t);
  KvStage<T, D, B> stage;
  stage.fetch(k_cache, v_cache, keys, 0);

  const int tid = threadIdx.x;
  const int v = tid / kLanesPerQuery;
  const int lane = tid % kLanesPerQuery;
  const int pos = t.first_pos + t.row_of(v);
  // A warp whose query vectors are all unused skips the arithmetic (but not the barriers).
  const bool warp_busy = tid / PS_WARP_SIZE * (PS_WARP_SIZE / kLanesPerQuery) < t.num_valid;
  QueryState<D> st;
  st.m = neg_inf();
  st.l = 0.f;
#pragma unroll
  for (int i = 0; i < L::DIMS_PER_LANE; ++i) st.acc[i] = 0.f;

  for (int k0 = 0; k0 < kv_end; k0 += L::N) {
    __syncthreads();  // every warp is done with the previous tile's k, v and p
    stage.store(k_tile, v_tile);
    __syncthreads();  // the tile (and, the first time, q_tile) is in place
    if (k0 + L::N < kv_end) stage.fetch(k_cache, v_cache, keys, k0 + L::N);
    if (warp_busy) {
      tile_scores<T, D>(st, q_tile, k_tile, p_tile, v, lane, k0, pos, scale);
      __syncwarp();  // p of the vector's 4 lanes
      tile_accumulate<T, D>(st, v_tile, p_tile, v, lane, min(L::N, pos - k0 + 1));
    }
  }
  if (v < t.num_valid) {
    T* dst = out + ((long long)(t.first_token + t.row_of(v)) * num_heads + t.head_of(v)) * D + 4 * lane;
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dst[16 * i + e] = from_float<T>(st.acc[4 * i + e] / st.l);
    }
  }
}

// grid (num_seqs, num_kv_heads): a sequence with exactly one new token, through attend().
template <typename T, int D, int B>
__device__ __forceinline__ void paged_prefill_single(T* __restrict__ out, const T* __restrict__ query,
                                                     const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                                                     const int* __restrict__ block_tables,
                                                     const int* __restrict__ query_start_loc,
                                                     const int* __restrict__ context_lens, float scale,
                                                     int num_heads, int num_kv_heads, int max_blocks_per_seq,
                                                     long long q_stride) {
  const int seq = blockIdx.x;
  const int token = query_start_loc[seq];
  if (query_start_loc[seq + 1] - token != 1) return;  // the tiled kernel's (or nobody's)
  const RowKeys keys{block_tables + (long long)seq * max_blocks_per_seq, 0, context_lens[seq], (int)blockIdx.y,
                     num_kv_heads, num_heads / num_kv_heads};
  const RowOutput<T> dst{out + (long long)token * num_heads * D, nullptr, nullptr, nullptr, 1};
  attend<T, D, B>(query + token * q_stride, dst, k_cache, v_cache, keys, scale);
}

}  // namespace ps

// Both kernels take the same arguments, so the backend hands them one tuple.
#define PS_PREFILL_PARAMS(tname)                                                                                  \
  PS_TYPE(tname)* __restrict__ out, const PS_TYPE(tname)* __restrict__ query,                                    \
      const PS_TYPE(tname)* __restrict__ k_cache, const PS_TYPE(tname)* __restrict__ v_cache,                    \
      const int* __restrict__ block_tables, const int* __restrict__ query_start_loc,                             \
      const int* __restrict__ context_lens, float scale, int num_seqs, int num_heads, int num_kv_heads,          \
      int max_blocks_per_seq, long long q_stride

#define PS_PAGED_PREFILL(tname, head, block)                                                                     \
  extern "C" __global__ void __launch_bounds__(ps::kThreads)                                                     \
      PS_NAME_THB(ps_paged_prefill, tname, head, block)(PS_PREFILL_PARAMS(tname)) {                              \
    ps::paged_prefill<PS_TYPE(tname), head, block>(out, query, k_cache, v_cache, block_tables, query_start_loc,   \
                                                   context_lens, scale, num_seqs, num_heads, num_kv_heads,        \
                                                   max_blocks_per_seq, q_stride);                                 \
  }                                                                                                                \
  PS_EXPORT_KERNEL(PS_NAME_THB(ps_paged_prefill, tname, head, block))                                             \
  extern "C" __global__ void __launch_bounds__(ps::kThreads)                                                     \
      PS_NAME_THB(ps_paged_prefill_single, tname, head, block)(PS_PREFILL_PARAMS(tname)) {                       \
    ps::paged_prefill_single<PS_TYPE(tname), head, block>(out, query, k_cache, v_cache, block_tables,            \
                                                          query_start_loc, context_lens, scale, num_heads,       \
                                                          num_kv_heads, max_blocks_per_seq, q_stride);           \
  }                                                                                                                \
  PS_EXPORT_KERNEL(PS_NAME_THB(ps_paged_prefill_single, tname, head, block))

PS_FOR_EACH_CONFIG(PS_PAGED_PREFILL)
