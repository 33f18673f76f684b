// Paged prefill attention for CPU: causal flash attention over a bfloat16 or float32 pool, read in place.
//
// A work item is 16 rows of one (sequence, kv head): the GQA group's query heads at consecutive
// query positions (row = position x group + head), one row per lane of a float32 vector, so the
// softmax needs no horizontal reduction and each K and V row is read once for every head that
// shares it. Query i of a sequence sits at position context_len - q_len + i (a cached prefix
// comes first) and sees keys 0..that position. Keys are visited in chunks of kChunk with an online
// softmax (running max and sum per lane, the output rescaled when the max moves):
//
//   scores   s[k][r] = scale * q[r] . K[k]: the rows' queries packed once as bf16 pairs of dims;
//            each key's row is broadcast pair by pair straight from the pool (VDPBF16PS, 16 keys at once)
//   softmax  mask k > position, new max, exp, sum, the weights to bf16 pairs of keys
//   values   o[d][r] = corr * o[d][r] + sum_k p[k][r] V[k][d]: the chunk's V rows packed as pairs
//            of keys per dim, broadcast per dim (VDPBF16PS, 16 dims at once)
//
// Products are exact bf16 x bf16 sums in float32, the weights are rounded to bf16 before the
// values product (as a bf16 GEMM would), the output is float32 until the final division.
// A float32 pool takes the same tiles with FMAs (one dim of 16 rows per instruction instead of a
// pair) and no rounding anywhere: scores, weights and values stay float32.
// Slots past a sequence's context are never read. Items run longest first on a dynamic schedule:
// the rows near a prompt's end read the most keys. The polynomial of exp512_nonpos is
// cpu_kernels.cpp's exp_nonpos (Cephes), on 16 lanes.
//
// Without AVX-512 (AVX2 and FMA, e.g. AMD Zen 3) the same items, chunks and online softmax run on two
// 8-lane vectors per tile row, in float32 for both pools: each chunk's K and V rows are copied out
// of the pool (bfloat16 widened, exactly) into a block of the thread's scratch, and the products
// take 5 or 6 keys or dims at a time (12 accumulators). 30 layers' prefill attention of a
// 2,048-token prompt, 2 threads on a Zen 3: 1.20 s (bfloat16) and 1.27 s (float32), against 1.52
// and 1.46 s for torch's SDPA over the gathered context.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDSERVE_BF16_PREFILL 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDSERVE_AVX2_PREFILL 1
#endif
#if defined(PAGEDSERVE_BF16_PREFILL) || defined(PAGEDSERVE_AVX2_PREFILL)
#define PAGEDSERVE_VECTOR_PREFILL 1
#endif

#include "cpu_amx.h"
#include "cpu_simd.h"

namespace {

#ifdef PAGEDSERVE_VECTOR_PREFILL
#ifdef PAGEDSERVE_BF16_PREFILL
constexpr int kRows = 16;   // rows per work item: one per lane of a float32 vector
constexpr int kKeys = 16;   // keys whose scores are computed together (16 accumulators)
#else
constexpr int kRows = 16;  // AVX2: two vectors of 8 lanes
#endif
constexpr int kChunk = 64;  // keys per online-softmax step

struct Item {
  int64_t seq, kv_head, row_begin, cost;
};

template <typename T>
struct Problem {
  const T *query, *k_cache, *v_cache;
  const int32_t *tables, *starts, *lens;
  T* out;
  int64_t num_heads, num_kv_heads, block_size, max_blocks, num_blocks;
  float scale;
};

// An item's rows and keys. Row r of the tile is query position (row_begin + r) / group, head
// (row_begin + r) % group; lanes past `rows` repeat the last row (computed, never written).
template <int D, typename T>
struct Tile {
  const Problem<T>& P;
  const Item& it;
  const int64_t group = P.num_heads / P.num_kv_heads;
  const int64_t q_len = P.starts[it.seq + 1] - P.starts[it.seq], ctx = P.lens[it.seq];
  const int64_t rows = std::min<int64_t>(kRows, q_len * group - it.row_begin);

  // tile row r's query, and its position in the sequence (which keys it sees)
  const T* query(int r, int32_t& pos) const {
    const int64_t row = it.row_begin + std::min<int64_t>(r, rows - 1);
    pos = int32_t(ctx - q_len + row / group);
    return P.query + ((P.starts[it.seq] + row / group) * P.num_heads + it.kv_head * group + row % group) * D;
  }

  // f(k, K row, V row) for keys [k0, k0 + n) of this kv head, walking the block table (no division per key)
  template <typename F>
  void keys(int64_t k0, int n, F&& f) const {
    const int32_t* table = P.tables + it.seq * P.max_blocks;
    const int64_t row_stride = P.num_kv_heads * D;
    int64_t b = k0 / P.block_size, off = k0 % P.block_size;
    for (int k = 0; k < n;) {
      const int32_t block = table[b];  // checked by run_all, outside the parallel region
      const int64_t base = (int64_t(block) * P.block_size) * row_stride + it.kv_head * D;
      for (; off < P.block_size && k < n; ++off, ++k) f(k, P.k_cache + base + off * row_stride, P.v_cache + base + off * row_stride);
      ++b, off = 0;
    }
  }

  // the output: o[d][r] / l[r] (inv = 1 / l) into each real row's place
  void write(const float (*o)[kRows], const float* inv) const {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = it.row_begin + r, token = P.starts[it.seq] + row / group;
      T* dst = P.out + (token * P.num_heads + it.kv_head * group + row % group) * D;
      for (int d = 0; d < D; ++d) dst[d] = T(o[d][r] * inv[r]);
    }
  }
};
#endif

#ifdef PAGEDSERVE_BF16_PREFILL
// Per-thread scratch; every matrix is transposed so that a row of the tile is a vector lane.
template <int D, typename T>
struct Scratch;

template <int D>
struct Scratch<D, c10::BFloat16> {
  alignas(64) uint32_t qp[D / 2][kRows];     // query dims (2p, 2p + 1) of each row, as bf16 pairs
  alignas(64) float s[kChunk][kRows];        // scores, then weights
  alignas(64) uint32_t pp[kChunk / 2][kRows];  // weights of keys (2j, 2j + 1) of each row, as bf16 pairs
  alignas(64) uint32_t vp[kChunk / 2][D];    // V[2j][d], V[2j + 1][d] as bf16 pairs
  alignas(64) float o[D][kRows];             // output accumulators
  __mmask16 valid[kChunk];                   // rows that see each key of the chunk
};

template <int D>
struct Scratch<D, float> {
  alignas(64) float q[D][kRows];       // query dim d of each row
  alignas(64) float s[kChunk][kRows];  // scores, then weights
  alignas(64) float o[D][kRows];       // output accumulators
  __mmask16 valid[kChunk];
};

using pagedserve_simd::kInterleaveHi;
using pagedserve_simd::kInterleaveLo;

// (a[i], b[i]) as bf16 pairs, i = 0..15, rounded to nearest even.
inline __m512i bf16_pairs(__m512 a, __m512 b) {
  const __m512i lo = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(a));
  const __m512i hi = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(b));
  return _mm512_permutex2var_epi16(lo, kInterleaveLo, hi);
}

// values: o[d][r] = corr[r] * o[d][r] + sum_k p[k][r] V[k][d] over a chunk's nk keys (weights in
// w.s), 16 dims at a time. float32: each V element broadcast into an FMA.
template <int D>
void add_values(Scratch<D, float>& w, const float* const* vrow, int nk, __m512 corr) {
  for (int d0 = 0; d0 < D; d0 += 16) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_mul_ps(_mm512_load_ps(w.o[d0 + i]), corr);
    for (int k = 0; k < nk; ++k) {
      const __m512 p = _mm512_load_ps(w.s[k]);
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(p, _mm512_set1_ps(vrow[k][d0 + i]), acc[i]);
    }
    for (int i = 0; i < 16; ++i) _mm512_store_ps(w.o[d0 + i], acc[i]);
  }
}

// bfloat16: the weights rounded to pairs of keys, the chunk's V rows packed as pairs of keys per
// dim (a missing odd key is zero), one VDPBF16PS per pair of keys.
template <int D>
void add_values(Scratch<D, c10::BFloat16>& w, const c10::BFloat16* const* vrow, int nk, __m512 corr) {
  if (nk % 2) _mm512_store_ps(w.s[nk], _mm512_setzero_ps());
  const int pairs = (nk + 1) / 2;
  for (int j = 0; j < pairs; ++j) _mm512_store_si512(w.pp[j], bf16_pairs(_mm512_load_ps(w.s[2 * j]), _mm512_load_ps(w.s[2 * j + 1])));
  for (int j = 0; j < pairs; ++j) {
    const uint32_t* a = reinterpret_cast<const uint32_t*>(vrow[2 * j]);
    const uint32_t* b = 2 * j + 1 < nk ? reinterpret_cast<const uint32_t*>(vrow[2 * j + 1]) : nullptr;
    for (int d0 = 0; d0 < D; d0 += 32) {  // 32 dims of each key, interleaved into 2 x 16 pairs
      const __m512i va = _mm512_loadu_si512(a + d0 / 2), vb = b ? _mm512_loadu_si512(b + d0 / 2) : _mm512_setzero_si512();
      _mm512_store_si512(w.vp[j] + d0, _mm512_permutex2var_epi16(va, kInterleaveLo, vb));
      _mm512_store_si512(w.vp[j] + d0 + 16, _mm512_permutex2var_epi16(va, kInterleaveHi, vb));
    }
  }
  for (int d0 = 0; d0 < D; d0 += 16) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_mul_ps(_mm512_load_ps(w.o[d0 + i]), corr);
    for (int j = 0; j < pairs; ++j) {
      const __m512bh p = (__m512bh)_mm512_load_si512(w.pp[j]);
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], p, (__m512bh)_mm512_set1_epi32(int(w.vp[j][d0 + i])));
    }
    for (int i = 0; i < 16; ++i) _mm512_store_ps(w.o[d0 + i], acc[i]);
  }
}

template <int D, typename T>
void run_item(const Problem<T>& P, const Item& it, Scratch<D, T>& w) {
  constexpr bool kBf16 = std::is_same_v<T, c10::BFloat16>;
  const Tile<D, T> tile{P, it};
  alignas(64) int32_t pos[kRows];
  for (int r = 0; r < kRows; ++r) {
    const T* q = tile.query(r, pos[r]);
    if constexpr (kBf16) {
      for (int p = 0; p < D / 2; ++p) w.qp[p][r] = reinterpret_cast<const uint32_t*>(q)[p];
    } else {
      for (int d = 0; d < D; ++d) w.q[d][r] = q[d];
    }
  }
  const __m512i positions = _mm512_load_si512(pos);
  const int64_t visible = pos[kRows - 1] + 1, first = pos[0];  // keys [0, visible) matter to some row
  for (int d = 0; d < D; ++d) _mm512_store_ps(w.o[d], _mm512_setzero_ps());
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), l = _mm512_setzero_ps();
  // the pool rows of keys [k0, k0 + n) of this kv head
  const T *krow[kChunk], *vrow[kChunk];
  auto locate = [&](int64_t k0, int n) { tile.keys(k0, n, [&](int k, const T* kr, const T* vr) { krow[k] = kr, vrow[k] = vr; }); };
  const __m512 scale = _mm512_set1_ps(P.scale);
  for (int64_t k0 = 0; k0 < visible; k0 += kChunk) {
    const int nk = int(std::min<int64_t>(kChunk, visible - k0));
    locate(k0, nk);
    // scores: s[k][r] = scale * q[r] . K[k0 + k], 16 keys at a time, each key's dims broadcast (as
    // pairs in bfloat16)
    for (int kb = 0; kb < nk; kb += kKeys) {
      const int n = std::min(kKeys, nk - kb);
      const T* kr[kKeys];
      for (int i = 0; i < kKeys; ++i) kr[i] = krow[kb + std::min(i, n - 1)];
      __m512 acc[kKeys];
      for (int i = 0; i < kKeys; ++i) acc[i] = _mm512_setzero_ps();
      if constexpr (kBf16) {
        for (int p = 0; p < D / 2; ++p) {
          const __m512bh q = (__m512bh)_mm512_load_si512(w.qp[p]);
          for (int i = 0; i < kKeys; ++i)
            acc[i] = _mm512_dpbf16_ps(acc[i], q, (__m512bh)_mm512_set1_epi32(int(reinterpret_cast<const uint32_t*>(kr[i])[p])));
        }
      } else {
        for (int d = 0; d < D; ++d) {
          const __m512 q = _mm512_load_ps(w.q[d]);
          for (int i = 0; i < kKeys; ++i) acc[i] = _mm512_fmadd_ps(q, _mm512_set1_ps(kr[i][d]), acc[i]);
        }
      }
      for (int i = 0; i < n; ++i) _mm512_store_ps(w.s[kb + i], _mm512_mul_ps(acc[i], scale));
    }
    // online softmax, every row in its lane: mask k > position, new max, weights, sum, rescale
    __m512 mx = m;
    for (int k = 0; k < nk; ++k) {
      const int64_t key = k0 + k;
      w.valid[k] = key <= first ? __mmask16(0xFFFF) : _mm512_cmpge_epi32_mask(positions, _mm512_set1_epi32(int(key)));
      mx = _mm512_mask_max_ps(mx, w.valid[k], mx, _mm512_load_ps(w.s[k]));
    }
    const __m512 corr = pagedserve_simd::exp512_nonpos(_mm512_sub_ps(m, mx));  // ~0 on the first chunk (m = -inf, o = 0)
    m = mx;
    __m512 sum = _mm512_setzero_ps();
    for (int k = 0; k < nk; ++k) {
      const __m512 e = _mm512_maskz_mov_ps(w.valid[k], pagedserve_simd::exp512_nonpos(_mm512_sub_ps(_mm512_load_ps(w.s[k]), mx)));
      sum = _mm512_add_ps(sum, e);
      _mm512_store_ps(w.s[k], e);
    }
    l = _mm512_fmadd_ps(l, corr, sum);
    add_values(w, vrow, nk, corr);
  }
  alignas(64) float inv[kRows];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l));  // l >= 1: every row sees key 0 and its own max
  tile.write(w.o, inv);
}

#endif

#ifdef PAGEDSERVE_AVX2_PREFILL
// The same tiles on a CPU with AVX2 and FMA but no AVX-512 (AMD Zen 3): 16 rows per item in two
// 8-lane vectors, and float32 arithmetic for both pools (no bfloat16 products there). A chunk's K
// and V rows are copied from the pool into the scratch (widened from bfloat16, exact), so that the
// rows or dims a block reads sit at fixed offsets from one register.
constexpr int kVecs = kRows / 8;  // vectors per row of the tile

template <int D, typename T>
struct Scratch {
  float q[D][kRows];  // query dim d of each row
  float s[kChunk][kRows];  // scores, then weights
  float o[D][kRows];  // output accumulators
  __m256 valid[kChunk][kVecs];  // rows that see each key of the chunk
  float k[kChunk][D], v[kChunk][D];  // the chunk's K and V rows
};

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) { return pagedserve_simd::widen8(p); }

// n items (keys or dims) in ceil(n / 6) blocks of near-equal counts, as f(N as a type, first,
// count) with N = 5 or 6 >= count unless count < 5 (n < 20 only): N x 2 accumulators a block, and
// three registers for the other operands, of AVX2's 16.
template <typename F>
void split(int n, F&& f) {
  const int blocks = (n + 5) / 6;
  for (int b = 0, first = 0; b < blocks; ++b) {
    const int count = n / blocks + (b < n % blocks);
    if (count == 6)
      f(std::integral_constant<int, 6>{}, first, count);
    else
      f(std::integral_constant<int, 5>{}, first, count);
    first += count;
  }
}

// Both products in one inner loop, with the rows of the tile in the lanes of two vectors:
//
//   c[i][r] = beta * (alpha[r] c[i][r] + sum_t a[t][r] b[t kT + i kI])   for i < n, t < steps
//
// (no alpha: the sum alone). The scores are c = s, a = q, b = the K rows (t a dim, i a key); the
// values c = o, a = the weights, b = the V rows (t a key, i a dim). N x 2 accumulators stay in
// registers: the loop is a function of its own, so that the compiler allocates the registers for it
// alone, and the loops over the accumulators are unrolled by pragma (g++ 12 otherwise keeps the
// array in memory and stores every accumulator at every step). Outputs n..N - 1 (a short block of
// scores, n < 5) are computed from the rows after the block's, and dropped: only chunks of under 20
// keys have one, so they stay inside the scratch.
template <int N, int kT, int kI>
[[gnu::noinline]] void lane_block(float (*c)[kRows], const __m256* alpha, const float (*a)[kRows], const float* b,
                                  int steps, int n, __m256 beta) {
  __m256 acc[N][kVecs];
#pragma GCC unroll 6
  for (int i = 0; i < N; ++i)
#pragma GCC unroll 2
    for (int h = 0; h < kVecs; ++h) acc[i][h] = alpha ? _mm256_mul_ps(_mm256_loadu_ps(c[i] + 8 * h), alpha[h]) : _mm256_setzero_ps();
  for (int t = 0; t < steps; ++t) {
    const __m256 a0 = _mm256_loadu_ps(a[t]), a1 = _mm256_loadu_ps(a[t] + 8);
#pragma GCC unroll 6
    for (int i = 0; i < N; ++i) {
      const __m256 bi = _mm256_broadcast_ss(b + t * kT + i * kI);
      acc[i][0] = _mm256_fmadd_ps(a0, bi, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(a1, bi, acc[i][1]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < N; ++i)
    if (i < n)
#pragma GCC unroll 2
      for (int h = 0; h < kVecs; ++h) _mm256_storeu_ps(c[i] + 8 * h, _mm256_mul_ps(acc[i][h], beta));
}

template <int D, typename T>
void run_item(const Problem<T>& P, const Item& it, Scratch<D, T>& w) {
  const Tile<D, T> tile{P, it};
  alignas(32) int32_t pos[kRows];
  for (int r = 0; r < kRows; ++r) {
    const T* q = tile.query(r, pos[r]);
    for (int d = 0; d < D; ++d) w.q[d][r] = static_cast<float>(q[d]);
  }
  __m256i positions[kVecs];
  for (int h = 0; h < kVecs; ++h) positions[h] = _mm256_load_si256(reinterpret_cast<const __m256i*>(pos + 8 * h));
  const int64_t visible = pos[kRows - 1] + 1, first = pos[0];  // keys [0, visible) matter to some row
  std::memset(w.o, 0, sizeof(w.o));
  __m256 m[kVecs], l[kVecs];
  for (int h = 0; h < kVecs; ++h) m[h] = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), l[h] = _mm256_setzero_ps();
  // keys [k0, k0 + n) of this kv head: their K and V rows into w.k and w.v, as float32
  auto locate = [&](int64_t k0, int n) {
    tile.keys(k0, n, [&](int k, const T* kr, const T* vr) {
      for (int d = 0; d < D; d += 8) {
        _mm256_storeu_ps(w.k[k] + d, load8(kr + d));
        _mm256_storeu_ps(w.v[k] + d, load8(vr + d));
      }
    });
  };
  const __m256 scale = _mm256_set1_ps(P.scale), one = _mm256_set1_ps(1.f);
  for (int64_t k0 = 0; k0 < visible; k0 += kChunk) {
    const int nk = int(std::min<int64_t>(kChunk, visible - k0));
    locate(k0, nk);
    // scores: s[k][r] = scale * q[r] . K[k0 + k], 5 or 6 keys at a time, each key's dims broadcast
    split(nk, [&](auto keys, int kb, int n) {
      lane_block<decltype(keys)::value, 1, D>(w.s + kb, nullptr, w.q, w.k[kb], D, n, scale);
    });
    // online softmax, every row in its lane: mask k > position, new max, weights, sum, rescale
    __m256 corr[kVecs];
    for (int h = 0; h < kVecs; ++h) {
      __m256 mx = m[h];
      for (int k = 0; k < nk; ++k) {
        const int32_t key = int32_t(k0 + k);
        w.valid[k][h] = key <= first ? _mm256_castsi256_ps(_mm256_set1_epi32(-1))
                                     : _mm256_castsi256_ps(_mm256_cmpgt_epi32(positions[h], _mm256_set1_epi32(key - 1)));
        mx = _mm256_blendv_ps(mx, _mm256_max_ps(mx, _mm256_loadu_ps(w.s[k] + 8 * h)), w.valid[k][h]);
      }
      corr[h] = pagedserve_simd::exp256_nonpos(_mm256_sub_ps(m[h], mx));  // ~0 on the first chunk (m = -inf, o = 0)
      m[h] = mx;
      __m256 sum = _mm256_setzero_ps();
      for (int k = 0; k < nk; ++k) {
        const __m256 e = _mm256_and_ps(w.valid[k][h], pagedserve_simd::exp256_nonpos(_mm256_sub_ps(_mm256_loadu_ps(w.s[k] + 8 * h), mx)));
        sum = _mm256_add_ps(sum, e);
        _mm256_storeu_ps(w.s[k] + 8 * h, e);
      }
      l[h] = _mm256_fmadd_ps(l[h], corr[h], sum);
    }
    // values: o[d][r] = corr[r] * o[d][r] + sum_k p[k][r] V[k][d], 5 or 6 dims at a time (D is 64
    // or 128: no block is short), each V element broadcast
    split(D, [&](auto dims, int d0, int n) { lane_block<decltype(dims)::value, D, 1>(w.o + d0, corr, w.s, w.v[0] + d0, nk, n, one); });
  }
  alignas(32) float inv[kRows];
  for (int h = 0; h < kVecs; ++h)
    _mm256_store_ps(inv + 8 * h, _mm256_div_ps(_mm256_set1_ps(1.f), l[h]));  // l >= 1: every row sees key 0 and its own max
  tile.write(w.o, inv);
}
#endif

#ifdef PAGEDSERVE_VECTOR_PREFILL
template <int D, typename T>
void run_all(const Problem<T>& P, int64_t num_seqs, int64_t min_q_len) {
  std::vector<Item> items;
  const int64_t group = P.num_heads / P.num_kv_heads;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = P.starts[s + 1] - P.starts[s], ctx = P.lens[s];
    if (q_len < min_q_len || q_len == 0) continue;
    for (int64_t h = 0; h < P.num_kv_heads; ++h)
      for (int64_t row = 0; row < q_len * group; row += kRows) {
        const int64_t last = std::min(q_len * group, row + kRows) - 1;
        items.push_back({s, h, row, ctx - q_len + last / group + 1});  // cost: the keys it reads
      }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int threads = std::max<int>(1, std::min<int64_t>(at::get_num_threads(), int64_t(items.size())));
#pragma omp parallel num_threads(threads)
  {
    Scratch<D, T> w{};  // zeroed: AVX2's short key blocks read rows past their own
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < int64_t(items.size()); ++i) run_item<D, T>(P, items[i], w);
  }
}

template <typename T>
void run_typed(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& context_lens,
               double scale, int64_t min_q_len, at::Tensor& out) {
  const Problem<T> P{query.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                     block_tables.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(),
                     out.data_ptr<T>(), query.size(1), k_cache.size(2), k_cache.size(1), block_tables.size(1),
                     k_cache.size(0), static_cast<float>(scale)};
  if (query.size(2) == 64)
    run_all<64, T>(P, context_lens.numel(), min_q_len);
  else
    run_all<128, T>(P, context_lens.numel(), min_q_len);
}
#endif

// Every sequence the kernels will read: lengths in range, every block id of its context in the pool
// (checked here, outside the parallel regions: an exception must not leave a thread).
void check_sequences(const int32_t* tables, const int32_t* starts, const int32_t* lens, int64_t num_seqs,
                     int64_t max_blocks, int64_t block_size, int64_t num_blocks, int64_t min_q_len) {
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s], ctx = lens[s];
    TORCH_CHECK(q_len >= 0, "paged_prefill: query_start_loc decreases at sequence ", s);
    if (q_len < min_q_len || q_len == 0) continue;
    TORCH_CHECK(q_len <= ctx && ctx <= max_blocks * block_size, "paged_prefill: bad lengths for sequence ", s);
    for (int64_t b = 0; b < (ctx + block_size - 1) / block_size; ++b) {
      const int32_t block = tables[s * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_prefill: block id out of range");
    }
  }
}

bool prefill_supported(int64_t head_dim) {
#ifdef PAGEDSERVE_VECTOR_PREFILL
  return head_dim == 64 || head_dim == 128;
#else
  return false;
#endif
}

// query [T, H, D]; k/v_cache [num_blocks, block_size, Hkv, D], all bf16 or all float32; block_tables [S, max_blocks],
// query_start_loc [S + 1], context_lens [S] int32. Rows of sequences with q_len < min_q_len are left
// as they are in `out` (the caller serves them, e.g. with the decode kernel).
enum class Kernel { kAuto, kVector, kAmx };

void run(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
         const at::Tensor& query_start_loc, const at::Tensor& context_lens, double scale, int64_t min_q_len,
         at::Tensor& out, Kernel kernel) {
  TORCH_CHECK(prefill_supported(query.size(2)), "paged_prefill: needs AVX2 and FMA (or AVX512-BF16) and a head size of 64 or 128");
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "bad shapes");
  const auto dtype = query.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && k_cache.scalar_type() == dtype &&
                  v_cache.scalar_type() == dtype && out.scalar_type() == dtype,
              "paged_prefill: bfloat16 or float32, one dtype for all");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && out.sizes() == query.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(), "paged_prefill: contiguous tensors only");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                  context_lens.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  query_start_loc.is_contiguous() && context_lens.is_contiguous(),
              "paged_prefill: int32 contiguous metadata");
  const int64_t num_seqs = context_lens.numel();
  TORCH_CHECK(block_tables.size(0) == num_seqs && query_start_loc.numel() == num_seqs + 1, "one table per sequence");
  TORCH_CHECK(query.size(2) == k_cache.size(3) && query.size(1) % k_cache.size(2) == 0, "head layout mismatch");
  TORCH_CHECK(query_start_loc.data_ptr<int32_t>()[num_seqs] <= query.size(0), "query_start_loc past the query");
  const int32_t *tables = block_tables.data_ptr<int32_t>(), *starts = query_start_loc.data_ptr<int32_t>(),
                *lens = context_lens.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] >= 0, "paged_prefill: query_start_loc must start at 0 or later");
  check_sequences(tables, starts, lens, num_seqs, block_tables.size(1), k_cache.size(1), k_cache.size(0), min_q_len);
  const bool amx = dtype == at::kBFloat16 && pagedserve::amx::prefill_supported(query.size(2));
  TORCH_CHECK(amx || kernel != Kernel::kAmx, "paged_prefill_amx: needs AMX-BF16, a bfloat16 pool and a head size of 64 or 128");
  if (amx && kernel != Kernel::kVector) {
    pagedserve::amx::paged_prefill({query.data_ptr<c10::BFloat16>(), k_cache.data_ptr<c10::BFloat16>(),
                                    v_cache.data_ptr<c10::BFloat16>(), tables, starts, lens, out.data_ptr<c10::BFloat16>(),
                                    num_seqs, query.size(1), k_cache.size(2), query.size(2), k_cache.size(1),
                                    block_tables.size(1), static_cast<float>(scale), min_q_len});
    return;
  }
#ifdef PAGEDSERVE_VECTOR_PREFILL
  if (dtype == at::kFloat)
    run_typed<float>(query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, min_q_len, out);
  else
    run_typed<c10::BFloat16>(query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, min_q_len, out);
#endif
}

// paged_prefill takes the AMX kernel where it can (a bfloat16 pool on a CPU with AMX), else the vector
// one; paged_prefill_vector and paged_prefill_amx name one kernel each (tests, benchmarks).
template <Kernel K>
void paged_prefill(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                   double scale, int64_t min_q_len, at::Tensor out) {
  run(query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, min_q_len, out, K);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  for (const char* name : {"paged_prefill", "paged_prefill_vector", "paged_prefill_amx"})
    m.def((std::string(name) + "(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start_loc, "
           "Tensor context_lens, float scale, int min_q_len, Tensor(a!) out) -> ()").c_str());
  m.def("paged_prefill_supported(int head_dim) -> bool", &prefill_supported);
  m.def("paged_prefill_amx_supported(int head_dim) -> bool", &pagedserve::amx::prefill_supported);
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("paged_prefill", &paged_prefill<Kernel::kAuto>);
  m.impl("paged_prefill_vector", &paged_prefill<Kernel::kVector>);
  m.impl("paged_prefill_amx", &paged_prefill<Kernel::kAmx>);
}
