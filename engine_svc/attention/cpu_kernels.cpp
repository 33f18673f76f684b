// Paged decode attention for CPU: reads K/V in place from the paged pool (no gather copy).
//
// A work item is one sequence (all kv heads: each block is read front to back) or, for batches
// too small to keep every thread busy, one (sequence, kv head). Each GQA group of query heads is
// handled together, so each K and V row is read once for all heads that share it:
//
//   pass 1  scores[h][p] = scale * q[h] . K[block_table[p / B]][p % B][h / group]   p < context_len
//   pass 2  softmax over p (max, exp, sum) in the per-thread score buffer
//   pass 3  out[h] = sum_p w[h][p] * V[...same slot...]
//
// On a CPU with AVX-512 (and BF16), bfloat16 and float32 pools with a head size of 64 or 128 take
// explicit vector code (decode_item_bf16, decode_item_f32): each chunk of rows is copied out of the
// pool first, 16 keys are scored together and the GQA group's value accumulators stay in registers.
// The float32 one reads 1.4-1.7x faster than the generic loops below (256 sequences of 140 tokens:
// ~32 against ~19 GB/s here); decode attention at large batches is bound by those reads. For
// whole-sequence items the next gather's lines are prefetched into L2 while the current chunk
// computes (LinePrefetcher), so that the copy and the arithmetic overlap instead of taking turns:
// 256 sequences of ~150 tokens, bfloat16, pools read from memory, interleaved A/B in one process on
// the AMD EPYC: blocks in order 0.86-0.89x the time, shuffled blocks 0.68-0.70x, 32 sequences of
// ~600 0.82-0.86x; small batches (per-kv-head items) take no prefetch and stay as they were.
// Slots at positions >= context_len are never touched, so garbage (even NaN) there cannot leak.
// The inner loops are written so that g++ -O3 vectorises them without -ffast-math: fixed-width
// lane accumulators instead of a float reduction, and a branch-free polynomial exp. On a CPU with
// AVX2 and no AVX-512 (AMD Zen 3), float32 and bfloat16 pools with a head size of 64 or 128 score
// 8 keys at a time and accumulate the values with explicit AVX2 code instead (score_rows,
// accumulate_rows), bfloat16 blocks widened to float32 once for all query heads of a group: 2
// threads, 30 layers, pools read from memory in shuffled blocks, against the generic loops: 256
// sequences of 135 tokens bfloat16 ~80 against ~105-120 ms, float32 ~108 against ~145-160; 64 of
// 300 bfloat16 47 against 64 ms; 8 of 1,000 21 against 35 ms. Most of it was the softmax's max and
// sum, scalar chains until they took lanes too (lane_max, lane_sum; every path).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDSERVE_BF16_DOT 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDSERVE_AVX2_DOT 1
#endif

#include "cpu_simd.h"

namespace {

constexpr int kLanes = 16;  // two AVX2 registers of accumulators hide the FMA latency
// Positions the bfloat16 path gathers at a time: 256 rows of K or V for all kv heads of the default
// model (384 B each) are 96 KB, well inside L2, whatever the context length.
constexpr int64_t kGatherRows = 256;

// The sum of kLanes lane accumulators: a tree, not a chain of 16 dependent scalar adds (the
// compiler may not reassociate floats). Overwrites the lanes.
inline float sum_lanes(float* lanes) {
  for (int j = 0; j < 8; ++j) lanes[j] += lanes[j + 8];
  for (int j = 0; j < 4; ++j) lanes[j] += lanes[j + 4];
  return (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[d + j] * b[d + j];
  float sum = sum_lanes(acc);
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// The max and the sum of x[0, n) in fixed-width lanes, as in dot(): a reduction into one float is a
// chain of dependent scalar operations, which the compiler may not reorder.
inline float lane_max(const float* __restrict x, int64_t n) {
  float lanes[kLanes];
  std::fill(lanes, lanes + kLanes, -std::numeric_limits<float>::infinity());
  int64_t p = 0;
  for (; p + kLanes <= n; p += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] = std::max(lanes[j], x[p + j]);
  float best = lanes[0];
  for (int j = 1; j < kLanes; ++j) best = std::max(best, lanes[j]);
  for (; p < n; ++p) best = std::max(best, x[p]);
  return best;
}

inline float lane_sum(const float* __restrict x, int64_t n) {
  float lanes[kLanes] = {};
  int64_t p = 0;
  for (; p + kLanes <= n; p += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] += x[p + j];
  float sum = sum_lanes(lanes);
  for (; p < n; ++p) sum += x[p];
  return sum;
}

// acc += sum_i w[i] * rows[i]: with a compile-time dim the accumulator stays in registers across rows.
template <int kDim>
inline void accumulate(const float* __restrict w, const float* __restrict rows, int64_t stride, int64_t n,
                       float* __restrict acc, int64_t dim) {
  if constexpr (kDim > 0) {
    float a[kDim];
    std::memcpy(a, acc, sizeof(a));
    for (int64_t i = 0; i < n; ++i)
      for (int d = 0; d < kDim; ++d) a[d] += w[i] * rows[i * stride + d];
    std::memcpy(acc, a, sizeof(a));
  } else {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < dim; ++d) acc[d] += w[i] * rows[i * stride + d];
  }
}

// exp(x) for x <= 0 (scores minus their max), Cephes-style: 2^k * p(r), |rel err| < 2e-7.
// Branch-free integer/float code that g++ turns into SIMD lanes (with -fno-trapping-math, which lets
// it turn the clamp into a select; it changes no result and sets no FP mode, unlike -ffast-math).
inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
  const float round = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer, branch-free
  const float k = (x * pagedserve_simd::kLog2e + round) - round;
  const float r = (x - k * pagedserve_simd::kLn2Hi) - k * pagedserve_simd::kLn2Lo;
  float p = pagedserve_simd::kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + pagedserve_simd::kExpPoly[i];
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#ifdef PAGEDSERVE_AVX2_DOT
using pagedserve_simd::sum8;
using pagedserve_simd::widen8;

// lane j of the result: the sum of v[j]'s 8 lanes
inline __m256 sum8x8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// out[i] = q . rows[i * stride, + kDim) for i < n: 8 keys at a time, their 8 sums reduced together
template <int kDim>
inline void score_rows(const float* __restrict q, const float* __restrict rows, int64_t stride, int64_t n,
                       float* __restrict out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int d = 0; d < kDim; d += 8) {
      const __m256 qd = _mm256_loadu_ps(q + d);
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(rows + (i + j) * stride + d), acc[j]);
    }
    _mm256_storeu_ps(out + i, sum8x8(acc));
  }
  for (; i < n; ++i) {
    __m256 acc = _mm256_setzero_ps();
    for (int d = 0; d < kDim; d += 8)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(rows + i * stride + d), acc);
    out[i] = sum8(acc);
  }
}

// acc[0, kDim) += sum_i w[i] * rows[i * stride, + kDim), 64 dims of accumulators in registers at a time
template <int kDim>
inline void accumulate_rows(const float* __restrict w, const float* __restrict rows, int64_t stride, int64_t n,
                            float* __restrict acc) {
  constexpr int kPart = kDim < 64 ? kDim : 64;
  for (int part = 0; part < kDim; part += kPart) {
    __m256 a[kPart / 8];
    for (int c = 0; c < kPart / 8; ++c) a[c] = _mm256_loadu_ps(acc + part + 8 * c);
    for (int64_t i = 0; i < n; ++i) {
      const __m256 wi = _mm256_set1_ps(w[i]);
      const float* row = rows + i * stride + part;
      for (int c = 0; c < kPart / 8; ++c) a[c] = _mm256_fmadd_ps(wi, _mm256_loadu_ps(row + 8 * c), a[c]);
    }
    for (int c = 0; c < kPart / 8; ++c) _mm256_storeu_ps(acc + part + 8 * c, a[c]);
  }
}
#endif

struct Shape {
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, num_blocks;
  int64_t q_stride;  // elements from one sequence's query row to the next (a slice of the fused qkv: wider than its heads)
};

// Software prefetch spread over computation. A chunk's rows are copied out of the pool (gather_rows)
// and then computed on from L2; without help the copy waits for memory while the computation leaves
// it idle. So while one chunk computes, the lines of the next gather (the item's next chunk of K or
// V, or the thread's next item's first chunk of K) are queued here and issued a few per inner step.
struct LinePrefetcher {
  struct Range {
    const char* begin;
    int64_t bytes;
  };
  static constexpr int64_t kStride = 64;
  std::vector<Range> ranges;
  size_t next = 0;
  int64_t offset = 0, lines = 0;  // position in ranges[next]; lines not yet issued

  void clear() {
    ranges.clear();
    next = 0;
    offset = lines = 0;
  }
  void add(const void* begin, int64_t bytes) {
    ranges.push_back({static_cast<const char*>(begin), bytes});
    lines += (bytes + kStride - 1) / kStride;
  }
  // The lines to issue per step so that `steps` steps issue them all.
  int64_t per_step(int64_t steps) const { return steps > 0 ? (lines + steps - 1) / steps : lines; }
  inline void issue(int64_t n) {
    while (n > 0 && next < ranges.size()) {
      const Range& r = ranges[next];
      const int64_t left = (r.bytes - offset + kStride - 1) / kStride, take = std::min(n, left);
      const char* p = r.begin + offset;
      for (int64_t i = 0; i < take; ++i) __builtin_prefetch(p + kStride * i, 0, 2);
      n -= take, lines -= take, offset += kStride * take;
      if (take == left) ++next, offset = 0;
    }
  }
};

// Per-thread scratch, float32: scores [heads][ctx], queries and accumulators [heads][dim], and one
// block converted to float32 when the pool holds bf16/fp16.
struct Scratch {
  std::vector<float> scores, q, acc, inv_sum, block;
  std::vector<int64_t> rows;      // AVX-512 paths: the pool offset of each context position's row
  std::vector<uint16_t> weights;  // bfloat16 path: the softmax numerators in bfloat16, [heads][even ctx + 32]
  std::unique_ptr<float[]> gathered;  // AVX-512 paths: kGatherRows rows of K or V out of the pool (bf16 uses half)
  std::vector<int64_t> next_rows;     // AVX-512 paths: `rows` of this thread's next item, prepared ahead
  LinePrefetcher prefetch;            // AVX-512 paths: the next gather's lines, issued while this chunk computes
  Scratch(int64_t heads, int64_t max_ctx, int64_t dim, int64_t block_size, int64_t row_elems)
      : scores(heads * max_ctx), q(heads * dim), acc(heads * dim), inv_sum(heads), block(block_size * heads * dim),
        rows(max_ctx), weights(heads * (max_ctx + 34)), gathered(new float[kGatherRows * row_elems]),
        next_rows(max_ctx) {}
};

// One work item: kv heads [kv_begin, kv_end) of one sequence, i.e. query heads
// [kv_begin * group, kv_end * group). With every kv head in one item each block is read front to back.
template <typename T, int kDim>
void decode_item(const T* query, const T* k_cache, const T* v_cache, const int32_t* block_table, int64_t ctx,
                 const Shape& s, float scale, int64_t seq, int64_t kv_begin, int64_t kv_end, Scratch& buf, T* out) {
#ifdef PAGEDSERVE_AVX2_DOT
  // score_rows and accumulate_rows (float32 rows: a bfloat16 block is widened first)
  constexpr bool kAvx2 = kDim > 0 && (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>);
#else
  constexpr bool kAvx2 = false;
#endif
  const int64_t group = s.num_heads / s.num_kv_heads, dim = kDim ? kDim : s.head_dim;
  const int64_t num_kv = kv_end - kv_begin, heads = num_kv * group;
  const int64_t row_stride = s.num_kv_heads * dim;  // between slots of one block
  float *q = buf.q.data(), *acc = buf.acc.data(), *scores = buf.scores.data(), *inv_sum = buf.inv_sum.data();
  const T* q_src = query + seq * s.q_stride + kv_begin * group * dim;
  for (int64_t i = 0; i < heads * dim; ++i) q[i] = static_cast<float>(q_src[i]) * scale;

  // Visits the first ctx slots block by block (no division per position), prefetching the next
  // block: the rows of one item are short strided runs that the hardware prefetcher alone misses.
  const int64_t span = num_kv * dim;  // values of one row that this item reads
  auto for_each_block = [&](const T* cache, auto&& visit) {
    auto block_start = [&](int64_t b) { return cache + (block_table[b] * s.block_size * s.num_kv_heads + kv_begin) * dim; };
    for (int64_t start = 0, b = 0; start < ctx; start += s.block_size, ++b) {
      TORCH_CHECK(block_table[b] >= 0 && block_table[b] < s.num_blocks, "paged_decode: block id out of range");
      if (start + s.block_size < ctx) {
        const char* next = reinterpret_cast<const char*>(block_start(b + 1));
        for (int64_t i = 0; i < s.block_size; ++i)
          for (int64_t off = 0; off < span * int64_t(sizeof(T)); off += 64)
            __builtin_prefetch(next + (i * row_stride) * sizeof(T) + off);
      }
      const T* base = block_start(b);
      const int64_t n = std::min(s.block_size, ctx - start);
      if constexpr (std::is_same_v<T, float>) {
        visit(start, n, base, row_stride);
      } else {
        float* rows = buf.block.data();
#ifdef PAGEDSERVE_AVX2_DOT
        if constexpr (kAvx2) {
          for (int64_t i = 0; i < n; ++i)
            for (int64_t d = 0; d < span; d += 8) _mm256_storeu_ps(rows + i * span + d, widen8(base + i * row_stride + d));
        } else
#endif
        for (int64_t i = 0; i < n; ++i)
          for (int64_t d = 0; d < span; ++d) rows[i * span + d] = static_cast<float>(base[i * row_stride + d]);
        visit(start, n, rows, span);
      }
    }
  };
  for_each_block(k_cache, [&](int64_t start, int64_t n, const float* rows, int64_t stride) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* k = rows + h / group * dim;
#ifdef PAGEDSERVE_AVX2_DOT
      if constexpr (kAvx2) {
        score_rows<kDim>(q + h * dim, k, stride, n, scores + h * ctx + start);
        continue;
      }
#endif
      for (int64_t i = 0; i < n; ++i) scores[h * ctx + start + i] = dot(q + h * dim, k + i * stride, dim);
    }
  });
  for (int64_t h = 0; h < heads; ++h) {
    float* sc = scores + h * ctx;
    const float max = lane_max(sc, ctx);
    for (int64_t p = 0; p < ctx; ++p) sc[p] = exp_nonpos(sc[p] - max);
    inv_sum[h] = 1.f / lane_sum(sc, ctx);  // the sum >= 1: the max itself contributes exp(0)
  }
  std::fill(acc, acc + heads * dim, 0.f);
  for_each_block(v_cache, [&](int64_t start, int64_t n, const float* rows, int64_t stride) {
    for (int64_t h = 0; h < heads; ++h) {
#ifdef PAGEDSERVE_AVX2_DOT
      if constexpr (kAvx2) {
        accumulate_rows<kDim>(scores + h * ctx + start, rows + h / group * dim, stride, n, acc + h * dim);
        continue;
      }
#endif
      accumulate<kDim>(scores + h * ctx + start, rows + h / group * dim, stride, n, acc + h * dim, dim);
    }
  });
  T* dst = out + (seq * s.num_heads + kv_begin * group) * dim;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < dim; ++d) dst[h * dim + d] = static_cast<T>(acc[h * dim + d] * inv_sum[h]);
}

#ifdef PAGEDSERVE_BF16_DOT
// bfloat16 pool on a CPU with AVX512-BF16: K and V are read straight from the pool, never converted
// into a float block. A score is one VDPBF16PS per 32 dims (bf16 pairs multiplied exactly and summed
// in float32), 16 keys' partial sums reduced together; V rows widen to float32 (a shift) once for
// every head of their GQA group, into register accumulators.
inline __m512 widen(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// 16 vectors in, one out: lane i holds the sum of v[i]'s lanes (a tree of pairwise lane sums, 15
// steps for 16 keys instead of one horizontal reduction per key).
inline __m512 lane_sums16(__m512* v) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  auto level = [&](auto half) {  // 2 * half vectors -> half, unrolled (v stays in registers)
#pragma GCC unroll 8
    for (int i = 0; i < decltype(half)::value; ++i)
      v[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * i], even, v[2 * i + 1]),
                           _mm512_permutex2var_ps(v[2 * i], odd, v[2 * i + 1]));
  };
  level(std::integral_constant<int, 8>{});
  level(std::integral_constant<int, 4>{});
  level(std::integral_constant<int, 2>{});
  level(std::integral_constant<int, 1>{});
  return v[0];
}

// o[g] += sum_p w[g][p] * V[p] for the kGroup heads of one kv head (rows v_stride apart), two
// positions per VDPBF16PS:
// the weights are rounded to bfloat16 (as flash attention does with P before P.V) and paired,
// (w[p], w[p+1]) in one 32-bit lane, against V rows p and p+1 interleaved word by word
// (VPUNPCK{L,H}WD). The interleave works within 128-bit lanes, so accumulator lo lane 4j+k holds
// dim 8j+k of its 32-dim chunk and hi lane 4j+k dim 8j+4+k; the stores undo that once.
template <int kDim, int kGroup>
void values_bf16(const uint16_t* w, int64_t w_stride, const c10::BFloat16* v_rows, int64_t v_stride, int64_t ctx,
                 float* acc, LinePrefetcher& pf, int64_t lines_per_pair) {
  constexpr int kChunks = kDim / 32;
  __m512 lo[kGroup][kChunks], hi[kGroup][kChunks];
  for (int g = 0; g < kGroup; ++g)
    for (int c = 0; c < kChunks; ++c) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < ctx; p += 2) {
    // an odd last position pairs with itself: its partner's weight is 0 (and the row is finite)
    const c10::BFloat16 *r0 = v_rows + p * v_stride, *r1 = v_rows + (p + 1 < ctx ? p + 1 : p) * v_stride;
    pf.issue(lines_per_pair);
    __m512bh wp[kGroup];
    for (int g = 0; g < kGroup; ++g) {
      int32_t pair;
      std::memcpy(&pair, w + g * w_stride + p, sizeof(pair));
      wp[g] = (__m512bh)_mm512_set1_epi32(pair);
    }
    for (int c = 0; c < kChunks; ++c) {
      const __m512i a = _mm512_loadu_si512(r0 + 32 * c), b = _mm512_loadu_si512(r1 + 32 * c);
      const __m512bh l = (__m512bh)_mm512_unpacklo_epi16(a, b), h = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int g = 0; g < kGroup; ++g) {
        lo[g][c] = _mm512_dpbf16_ps(lo[g][c], l, wp[g]);
        hi[g][c] = _mm512_dpbf16_ps(hi[g][c], h, wp[g]);
      }
    }
  }
  alignas(64) float l[16], h[16];
  for (int g = 0; g < kGroup; ++g)
    for (int c = 0; c < kChunks; ++c) {
      _mm512_store_ps(l, lo[g][c]);
      _mm512_store_ps(h, hi[g][c]);
      float* dst = acc + g * kDim + 32 * c;
      for (int j = 0; j < 4; ++j)
        for (int k = 0; k < 4; ++k) dst[8 * j + k] += l[4 * j + k], dst[8 * j + 4 + k] += h[4 * j + k];
    }
}

// w[0, ctx) in float32 -> bfloat16 (round to nearest even) at out[0, ctx), zero up to the next even
// position (the partner of an odd last one).
inline void weights_bf16(const float* w, int64_t ctx, uint16_t* out) {
  for (int64_t p = 0; p < ctx; p += 32) {
    const int64_t left = ctx - p;
    const __mmask16 m0 = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __mmask16 m1 = left >= 32 ? __mmask16(0xFFFF) : left > 16 ? __mmask16((1u << (left - 16)) - 1) : 0;
    const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, w + p + 16), _mm512_maskz_loadu_ps(m0, w + p));
    const int64_t keep = std::min<int64_t>(32, (left + 1) / 2 * 2);
    _mm512_mask_storeu_epi16(out + p, __mmask32(keep >= 32 ? 0xFFFFFFFFu : (1u << keep) - 1), (__m512i)pairs);
  }
}

// Softmax numerators in place over scores[0, ctx) (16 lanes at a time); answers 1 / their sum.
inline float softmax16(float* sc, int64_t ctx) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mx = lowest;
  for (int64_t p = 0; p < ctx; p += 16) {
    const __mmask16 m = ctx - p >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (ctx - p)) - 1);
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(lowest, m, sc + p));
  }
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();  // >= 1: the max itself contributes exp(0)
  for (int64_t p = 0; p < ctx; p += 16) {
    const __mmask16 m = ctx - p >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (ctx - p)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(m, pagedserve_simd::exp512_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + p), max)));
    _mm512_mask_storeu_ps(sc + p, m, e);
    sum = _mm512_add_ps(sum, e);
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// rows[p] = the pool offset (in elements) of context position p's row, from `head_offset` within the
// slot on, for p < ctx; every block id is checked against the pool first.
inline void row_offsets(const int32_t* block_table, int64_t ctx, const Shape& s, int64_t head_offset, int64_t row_stride,
                        int64_t* rows) {
  for (int64_t start = 0, b = 0; start < ctx; start += s.block_size, ++b) {
    TORCH_CHECK(block_table[b] >= 0 && block_table[b] < s.num_blocks, "paged_decode: block id out of range");
    const int64_t base = int64_t(block_table[b]) * s.block_size * row_stride + head_offset;
    for (int64_t i = 0; i < std::min(s.block_size, ctx - start); ++i) rows[start + i] = base + i * row_stride;
  }
}

// The rows of positions [from, to) of one item (row_bytes of each slot, from its kv head on), copied
// into a contiguous buffer: a copy streams memory ~2x faster here than the compute loops' own loads
// (measured: random 6 KB blocks at 17 GB/s per core against ~8), and the loops then read L2.
template <typename T>
inline void gather_rows(const T* cache, const int64_t* rows, int64_t from, int64_t to, int64_t row_elems,
                        bool contiguous_runs, int64_t block_size, T* dst) {
  const size_t row_bytes = row_elems * sizeof(T);
  for (int64_t p = from; p < to;) {
    // whole-slot rows of one block lie next to each other: one copy per block
    const int64_t run = contiguous_runs ? std::min(to - p, block_size - p % block_size) : 1;
    std::memcpy(dst + (p - from) * row_elems, cache + rows[p], run * row_bytes);
    p += run;
  }
}

// What gather_rows(cache, rows, from, to, ...) will read, queued for prefetching (replacing the queue).
template <typename T>
inline void queue_rows(LinePrefetcher& pf, const T* cache, const int64_t* rows, int64_t from, int64_t to,
                       int64_t row_elems, bool contiguous_runs, int64_t block_size) {
  pf.clear();
  for (int64_t p = from; p < to;) {
    const int64_t run = contiguous_runs ? std::min(to - p, block_size - p % block_size) : 1;
    pf.add(cache + rows[p], run * row_elems * int64_t(sizeof(T)));
    p += run;
  }
}

// Where one item's rows lie in the pool (row_offsets), and the thread's next item's (null after its last).
struct ItemRows {
  const int64_t* rows;
  int64_t ctx;
  const int64_t* next_rows;
  int64_t next_ctx;
  bool prefetch;  // whole-slot items (large batches) only: short strided rows cost more to queue than they gain
};

// Queues the gather that follows chunk [.., c1) of K (after_k) or V: the item's next chunk of the same
// tensor, else V's first chunk (after K's last), else the next item's first chunk of K (after V's last).
template <typename T>
void queue_next_gather(LinePrefetcher& pf, const T* k_cache, const T* v_cache, bool after_k, int64_t c1,
                       const ItemRows& item, int64_t row_elems, bool whole_slots, int64_t block_size) {
  const int64_t ctx = item.ctx;
  if (!item.prefetch)
    pf.clear();
  else if (c1 < ctx)
    queue_rows(pf, after_k ? k_cache : v_cache, item.rows, c1, std::min(ctx, c1 + kGatherRows), row_elems, whole_slots,
               block_size);
  else if (after_k)
    queue_rows(pf, v_cache, item.rows, 0, std::min(ctx, kGatherRows), row_elems, whole_slots, block_size);
  else if (item.next_rows != nullptr)
    queue_rows(pf, k_cache, item.next_rows, 0, std::min(item.next_ctx, kGatherRows), row_elems, whole_slots, block_size);
  else
    pf.clear();
}

// The same three passes as decode_item on a bfloat16 pool (dim % 32 == 0), in chunks of
// kGatherRows positions copied out of the pool first (gather_rows). Pass 1 scores 16 positions
// at a time for every head of the item (each K row reused from L1 by its GQA group); pass 2 is one
// vectorised softmax per head; pass 3 sums the values per kv head, two positions per instruction.
template <int kDim>
void decode_item_bf16(const c10::BFloat16* query, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                      const ItemRows& item, const Shape& s, float scale, int64_t seq, int64_t kv_begin,
                      int64_t kv_end, Scratch& buf, c10::BFloat16* out) {
  const int64_t* rows = item.rows;
  const int64_t ctx = item.ctx;
  const int64_t group = s.num_heads / s.num_kv_heads, dim = kDim ? kDim : s.head_dim;
  const int64_t num_kv = kv_end - kv_begin, heads = num_kv * group, row_stride = s.num_kv_heads * dim;
  const int64_t row_elems = num_kv * dim;  // what this item reads of a slot
  const bool whole_slots = row_elems == row_stride;
  float *acc = buf.acc.data(), *scores = buf.scores.data(), *inv_sum = buf.inv_sum.data();
  const c10::BFloat16* q = query + seq * s.q_stride + kv_begin * group * dim;
  c10::BFloat16* chunk = reinterpret_cast<c10::BFloat16*>(buf.gathered.get());
  const __m512 scale16 = _mm512_set1_ps(scale);
  LinePrefetcher& pf = buf.prefetch;
  for (int64_t c0 = 0; c0 < ctx; c0 += kGatherRows) {
    const int64_t c1 = std::min(ctx, c0 + kGatherRows);
    gather_rows(k_cache, rows, c0, c1, row_elems, whole_slots, s.block_size, chunk);
    queue_next_gather(pf, k_cache, v_cache, true, c1, item, row_elems, whole_slots, s.block_size);
    const int64_t lines_per_head = pf.per_step((c1 - c0 + 15) / 16 * heads);
    for (int64_t k0 = c0; k0 < c1; k0 += 16) {
      const int n = int(std::min<int64_t>(16, c1 - k0));
      const __mmask16 keep = __mmask16((1u << n) - 1);
      for (int64_t h = 0; h < heads; ++h) {
        pf.issue(lines_per_head);
        const c10::BFloat16* qh = q + h * dim;
        const c10::BFloat16* keys = chunk + (k0 - c0) * row_elems + h / group * dim;
        __m512 v[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {  // a short last group repeats its last key (not stored)
          const c10::BFloat16* key = keys + std::min(i, n - 1) * row_elems;
          v[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(qh), (__m512bh)_mm512_loadu_si512(key));
          for (int64_t d = 32; d < dim; d += 32)
            v[i] = _mm512_dpbf16_ps(v[i], (__m512bh)_mm512_loadu_si512(qh + d), (__m512bh)_mm512_loadu_si512(key + d));
        }
        _mm512_mask_storeu_ps(scores + h * ctx + k0, keep, _mm512_mul_ps(lane_sums16(v), scale16));
      }
    }
  }
  const int64_t w_stride = (ctx + 1) / 2 * 2;  // bfloat16 weights of one head, padded to a whole pair
  uint16_t* w_bf16 = buf.weights.data();
  for (int64_t h = 0; h < heads; ++h) {
    inv_sum[h] = softmax16(scores + h * ctx, ctx);
    weights_bf16(scores + h * ctx, ctx, w_bf16 + h * w_stride);
  }
  std::fill(acc, acc + heads * dim, 0.f);
  // the common GQA groups keep their accumulators in registers (values_bf16); others take the loop below
  const bool in_registers = kDim > 0 && (group <= 2 || (group <= 4 && kDim <= 64));
  if (in_registers) {
    for (int64_t c0 = 0; c0 < ctx; c0 += kGatherRows) {
      const int64_t c1 = std::min(ctx, c0 + kGatherRows);
      gather_rows(v_cache, rows, c0, c1, row_elems, whole_slots, s.block_size, chunk);
      queue_next_gather(pf, k_cache, v_cache, false, c1, item, row_elems, whole_slots, s.block_size);
      const int64_t lines_per_pair = pf.per_step((c1 - c0 + 1) / 2 * num_kv);
      for (int64_t kv = 0; kv < num_kv; ++kv) {
        const uint16_t* w = w_bf16 + kv * group * w_stride + c0;
        float* a = acc + kv * group * dim;
        const c10::BFloat16* v_rows = chunk + kv * dim;
        if constexpr (kDim > 0) {
          switch (group) {
            case 1: values_bf16<kDim, 1>(w, w_stride, v_rows, row_elems, c1 - c0, a, pf, lines_per_pair); break;
            case 2: values_bf16<kDim, 2>(w, w_stride, v_rows, row_elems, c1 - c0, a, pf, lines_per_pair); break;
            case 3: if constexpr (kDim <= 64) values_bf16<kDim, 3>(w, w_stride, v_rows, row_elems, c1 - c0, a, pf, lines_per_pair); break;
            case 4: if constexpr (kDim <= 64) values_bf16<kDim, 4>(w, w_stride, v_rows, row_elems, c1 - c0, a, pf, lines_per_pair); break;
            default: break;
          }
        }
      }
    }
  } else {
    for (int64_t kv = 0; kv < num_kv; ++kv)
      for (int64_t g = 0; g < group; ++g) {
        const float* w = scores + (kv * group + g) * ctx;
        float* a = acc + (kv * group + g) * dim;
        for (int64_t p = 0; p < ctx; ++p) {
          const __m512 wp = _mm512_set1_ps(w[p]);
          const c10::BFloat16* row = v_cache + rows[p] + kv * dim;
          for (int64_t c = 0; c < dim; c += 16)
            _mm512_storeu_ps(a + c, _mm512_fmadd_ps(wp, widen(row + c), _mm512_loadu_ps(a + c)));
        }
      }
  }
  c10::BFloat16* dst = out + (seq * s.num_heads + kv_begin * group) * dim;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < dim; ++d) dst[h * dim + d] = static_cast<c10::BFloat16>(acc[h * dim + d] * inv_sum[h]);
}
// float32 pool (dim % 16 == 0): the same chunks and passes as decode_item_bf16 with FMAs. Scores
// take kDim / 16 FMAs per key, 16 keys reduced together; values broadcast each weight against
// the V row shared by its GQA group, accumulators in registers. Nothing is rounded below float32.
template <int kDim, int kGroup>
void values_f32(const float* w, int64_t w_stride, const float* v_rows, int64_t v_stride, int64_t n, float* acc,
                LinePrefetcher& pf, int64_t lines_per_row) {
  constexpr int kChunks = kDim / 16;
  __m512 a[kGroup][kChunks];
  for (int g = 0; g < kGroup; ++g)
    for (int c = 0; c < kChunks; ++c) a[g][c] = _mm512_loadu_ps(acc + g * kDim + 16 * c);
  for (int64_t p = 0; p < n; ++p) {
    const float* row = v_rows + p * v_stride;
    pf.issue(lines_per_row);
    __m512 wp[kGroup];
    for (int g = 0; g < kGroup; ++g) wp[g] = _mm512_set1_ps(w[g * w_stride + p]);
    for (int c = 0; c < kChunks; ++c) {
      const __m512 v = _mm512_loadu_ps(row + 16 * c);
      for (int g = 0; g < kGroup; ++g) a[g][c] = _mm512_fmadd_ps(wp[g], v, a[g][c]);
    }
  }
  for (int g = 0; g < kGroup; ++g)
    for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(acc + g * kDim + 16 * c, a[g][c]);
}

template <int kDim>
void decode_item_f32(const float* query, const float* k_cache, const float* v_cache, const ItemRows& item,
                     const Shape& s, float scale, int64_t seq, int64_t kv_begin, int64_t kv_end, Scratch& buf,
                     float* out) {
  const int64_t* rows = item.rows;
  const int64_t ctx = item.ctx;
  static_assert(kDim % 16 == 0 && kDim > 0, "a compile-time head size, whole vectors");
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t num_kv = kv_end - kv_begin, heads = num_kv * group, row_stride = s.num_kv_heads * kDim;
  const int64_t row_elems = num_kv * kDim;
  const bool whole_slots = row_elems == row_stride;
  float *acc = buf.acc.data(), *scores = buf.scores.data(), *inv_sum = buf.inv_sum.data();
  const float* q = query + seq * s.q_stride + kv_begin * group * kDim;
  float* chunk = buf.gathered.get();
  const __m512 scale16 = _mm512_set1_ps(scale);
  LinePrefetcher& pf = buf.prefetch;
  for (int64_t c0 = 0; c0 < ctx; c0 += kGatherRows) {
    const int64_t c1 = std::min(ctx, c0 + kGatherRows);
    gather_rows(k_cache, rows, c0, c1, row_elems, whole_slots, s.block_size, chunk);
    queue_next_gather(pf, k_cache, v_cache, true, c1, item, row_elems, whole_slots, s.block_size);
    const int64_t lines_per_head = pf.per_step((c1 - c0 + 15) / 16 * heads);
    for (int64_t k0 = c0; k0 < c1; k0 += 16) {
      const int n = int(std::min<int64_t>(16, c1 - k0));
      for (int64_t h = 0; h < heads; ++h) {
        pf.issue(lines_per_head);
        const float* qh = q + h * kDim;
        const float* keys = chunk + (k0 - c0) * row_elems + h / group * kDim;
        __m512 v[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {  // a short last group repeats its last key (not stored)
          const float* key = keys + std::min(i, n - 1) * row_elems;
          v[i] = _mm512_mul_ps(_mm512_loadu_ps(qh), _mm512_loadu_ps(key));
#pragma GCC unroll 8
          for (int d = 16; d < kDim; d += 16) v[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + d), _mm512_loadu_ps(key + d), v[i]);
        }
        _mm512_mask_storeu_ps(scores + h * ctx + k0, __mmask16((1u << n) - 1), _mm512_mul_ps(lane_sums16(v), scale16));
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) inv_sum[h] = softmax16(scores + h * ctx, ctx);
  std::fill(acc, acc + heads * kDim, 0.f);
  for (int64_t c0 = 0; c0 < ctx; c0 += kGatherRows) {
    const int64_t c1 = std::min(ctx, c0 + kGatherRows), n = c1 - c0;
    gather_rows(v_cache, rows, c0, c1, row_elems, whole_slots, s.block_size, chunk);
    queue_next_gather(pf, k_cache, v_cache, false, c1, item, row_elems, whole_slots, s.block_size);
    const int64_t lines_per_row = pf.per_step(n * num_kv);
    for (int64_t kv = 0; kv < num_kv; ++kv) {
      const float* w = scores + kv * group * ctx + c0;
      float* a = acc + kv * group * kDim;
      const float* v_rows = chunk + kv * kDim;
      // accumulators in registers for up to 24 vectors of them (the common GQA groups); else one head at a time
      if (group == 1) values_f32<kDim, 1>(w, ctx, v_rows, row_elems, n, a, pf, lines_per_row);
      else if (group == 2) values_f32<kDim, 2>(w, ctx, v_rows, row_elems, n, a, pf, lines_per_row);
      else if (group == 3 && kDim <= 128) values_f32<kDim <= 128 ? kDim : 16, 3>(w, ctx, v_rows, row_elems, n, a, pf, lines_per_row);
      else if (group == 4 && kDim <= 64) values_f32<kDim <= 64 ? kDim : 16, 4>(w, ctx, v_rows, row_elems, n, a, pf, lines_per_row);
      else
        for (int64_t g = 0; g < group; ++g) values_f32<kDim, 1>(w + g * ctx, ctx, v_rows, row_elems, n, a + g * kDim, pf, lines_per_row);
    }
  }
  float* dst = out + (seq * s.num_heads + kv_begin * group) * kDim;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < kDim; ++d) dst[h * kDim + d] = acc[h * kDim + d] * inv_sum[h];
}
#endif

template <typename T, int kDim>
void decode_all(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, at::Tensor& out,
                const Shape& s) {
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t max_ctx = s.max_blocks * s.block_size;
  const T *q = query.data_ptr<T>(), *k = k_cache.data_ptr<T>(), *v = v_cache.data_ptr<T>();
  T* o = out.data_ptr<T>();
  // Whole sequences per item when there are enough of them to keep every thread busy; else one
  // item per (sequence, kv head) so that a small batch still spreads over the threads.
  const bool whole = s.num_seqs >= 4 * at::get_num_threads();
  const int64_t kv_per_item = whole ? s.num_kv_heads : 1, items_per_seq = s.num_kv_heads / kv_per_item;
  const int64_t heads_per_item = kv_per_item * (s.num_heads / s.num_kv_heads);
  at::parallel_for(0, s.num_seqs * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    Scratch buf(heads_per_item, max_ctx, s.head_dim, s.block_size, kv_per_item * s.head_dim);
    int64_t prepared = -1;  // the item whose row offsets buf.next_rows holds (the AVX-512 paths)
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / items_per_seq, kv_begin = item % items_per_seq * kv_per_item;
      const int64_t ctx = std::min<int64_t>(lens[seq], max_ctx);  // never past the block table
      TORCH_CHECK(ctx >= 1, "paged_decode: context_lens must be >= 1");
#ifdef PAGEDSERVE_BF16_DOT
      constexpr bool vector_path = (std::is_same_v<T, float> && kDim > 0) || std::is_same_v<T, c10::BFloat16>;
      if (vector_path && s.head_dim % 32 == 0) {
        // this item's row offsets (prepared during the previous item), and the next item's now, so that
        // its first K chunk is prefetched during this item's values
        const int64_t row_stride = s.num_kv_heads * s.head_dim;
        if (prepared == item)
          std::swap(buf.rows, buf.next_rows);
        else
          row_offsets(tables + seq * s.max_blocks, ctx, s, kv_begin * s.head_dim, row_stride, buf.rows.data());
        ItemRows rows{buf.rows.data(), ctx, nullptr, 0, whole};
        if (whole && item + 1 < end) {
          const int64_t next_seq = (item + 1) / items_per_seq, next_kv = (item + 1) % items_per_seq * kv_per_item;
          const int64_t next_ctx = std::min<int64_t>(lens[next_seq], max_ctx);
          row_offsets(tables + next_seq * s.max_blocks, next_ctx, s, next_kv * s.head_dim, row_stride,
                      buf.next_rows.data());
          prepared = item + 1;
          if (next_ctx > 0) rows.next_rows = buf.next_rows.data(), rows.next_ctx = next_ctx;
        }
        if constexpr (std::is_same_v<T, float> && kDim > 0)
          decode_item_f32<kDim>(q, k, v, rows, s, static_cast<float>(scale), seq, kv_begin, kv_begin + kv_per_item, buf, o);
        else if constexpr (std::is_same_v<T, c10::BFloat16>)
          decode_item_bf16<kDim>(q, k, v, rows, s, static_cast<float>(scale), seq, kv_begin, kv_begin + kv_per_item, buf, o);
        continue;
      }
#endif
      decode_item<T, kDim>(q, k, v, tables + seq * s.max_blocks, ctx, s, static_cast<float>(scale), seq, kv_begin,
                           kv_begin + kv_per_item, buf, o);
    }
  });
}

// The common head sizes get a compile-time dim (fully unrolled inner loops); others a runtime one.
template <typename T, typename... Args>
void dispatch_dim(const at::Tensor& query, Args&&... args) {
  switch (query.size(2)) {
    case 64: decode_all<T, 64>(query, args...); break;
    case 128: decode_all<T, 128>(query, args...); break;
    default: decode_all<T, 0>(query, args...);
  }
}

at::Tensor paged_decode(const at::Tensor& query_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(query_in.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV pool must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == query_in.scalar_type() && v_cache.scalar_type() == query_in.scalar_type(),
              "query and KV pool must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  // each row's heads must be dense; the rows themselves may be strided (the query part of the fused qkv)
  const bool dense_rows = query_in.stride(2) == 1 && query_in.stride(1) == query_in.size(2) &&
                          query_in.stride(0) >= query_in.size(1) * query_in.size(2);
  const at::Tensor query = dense_rows ? query_in : query_in.contiguous();
  const at::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous();
  const Shape s{query.size(0), query.size(1), k_cache.size(2), k_cache.size(3), k_cache.size(1), tables.size(1),
                k_cache.size(0), query.stride(0)};
  TORCH_CHECK(query.size(2) == s.head_dim && s.num_heads % s.num_kv_heads == 0, "head layout mismatch");
  TORCH_CHECK(tables.size(0) == s.num_seqs && lens.numel() == s.num_seqs, "one block table and length per seq");
  at::Tensor out = at::empty(query.sizes(), query.options());
  if (s.num_seqs == 0) return out;
  switch (query.scalar_type()) {
    case at::kFloat: dispatch_dim<float>(query, k_cache, v_cache, tables, lens, scale, out, s); break;
    case at::kBFloat16: dispatch_dim<c10::BFloat16>(query, k_cache, v_cache, tables, lens, scale, out, s); break;
    case at::kHalf: dispatch_dim<c10::Half>(query, k_cache, v_cache, tables, lens, scale, out, s); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported dtype ", query.scalar_type());
  }
  return out;
}

// reshape_and_cache: the step's new K/V rows into their pool slots (negative slot: a padding row,
// skipped). One memcpy per row and tensor; every slot is checked before anything is written, so a
// bad slot mapping raises and leaves the pool as it was. The rows may be strided views (value is a
// slice of the fused qkv output) as long as each row's [kv_heads, head_dim] is contiguous.
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "write_kv: bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "write_kv: the KV pool must be contiguous");
  TORCH_CHECK(key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3), "write_kv: head layout mismatch");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type() &&
                  k_cache.scalar_type() == v_cache.scalar_type(), "write_kv: rows and pool must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0),
              "write_kv: slot_mapping must be int64 [num_tokens]");
  const int64_t heads = key.size(1), dim = key.size(2);
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->stride(2) == 1 && (heads == 1 || t->stride(1) == dim), "write_kv: each row must be contiguous");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_tokens = key.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slot[t] < num_slots, "write_kv: slot ", slot[t], " out of range (", num_slots, " slots)");
  const int64_t row_bytes = heads * dim * static_cast<int64_t>(key.element_size());
  const char *k = static_cast<const char*>(key.data_ptr()), *v = static_cast<const char*>(value.data_ptr());
  char *kc = static_cast<char*>(k_cache.data_ptr()), *vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size(), v_stride = value.stride(0) * value.element_size();
  // a small decode step's rows in this thread; from 128 rows on, over the threads (each row lands on
  // lines that are not cached: a batch of 256 took 97 us a layer in one thread)
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot[t] < 0) continue;
      std::memcpy(kc + slot[t] * row_bytes, k + t * k_stride, row_bytes);
      std::memcpy(vc + slot[t] * row_bytes, v + t * v_stride, row_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def("paged_decode(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale) -> Tensor");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("write_kv", &write_kv);
}
