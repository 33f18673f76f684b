// A bfloat16 linear layer for decode-sized batches through AMX tiles: y = x W^T (+ b), W read in place.
//
// On a CPU with AMX, oneDNN's GEMM is near the tile units' peak for large M but runs at about half
// the memory bandwidth for the few rows of a decode step, and the AVX512-BF16 loop of cpu_gemv.cpp
// becomes compute-bound from 3-4 rows (one VDPBF16PS per row per 32 weights). One tile product does
// 16 x 16 x 32 multiply-adds, so here a decode step streams the weights at memory speed for up to 16-32
// rows and beats oneDNN up to 128 (cpu_amx.h). TDPBF16PS wants its B operand in pairs of K (VNNI); the weights, row-major [N, K], are
// already that as the A operand of the transposed product, so nothing is prepacked:
//
//   C[n][m] += sum_k W[n][k] x[m][k]      A = 16 weight rows x 32 k (one tile load, stride K, in place)
//                                          B = x^T in K-pairs: 16 pair-rows x M columns (packed per call)
//   tmm0..1  C  n-block 0, n-block 1: 16 weight rows x 16 token rows each
//   tmm4..5  A  n-block 0, n-block 1 (two blocks of 16 weight rows in flight)
//   tmm6     B  one m-tile (16 token rows, zero-padded)
//   every tile 16 rows x 64 bytes: C 16 x 16 floats, A 16 x 32 bfloat16, B 16 K-pairs x 16 tokens
// More than 16 token rows go in tiles of 16 over the same pair of weight blocks (from cache after
// the first), in slices whose packed x stays in L2. A 2 x 2 product per k step (both m-tiles at
// once, 4 C tiles) was slower here than the m-tiles one after the other: streaming 30 layers'
// weights and the LM head, 20.2-20.5 against 25.9-26.8 ms at 32 rows, 34-35 against 41-43 at 64,
// 56-58 against 67-70 at 128 (Xeon with AMX, model 207, interleaved runs).
//
// C comes out [n][m]; a 16 x 16 float transpose in registers turns it into y's [m][n] rows.

#include "cpu_amx.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef PAGEDSERVE_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pagedserve::amx {

#ifdef PAGEDSERVE_AMX
namespace {

constexpr int64_t kTileRows = 16, kTileK = 32;

bool probe() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;  // AMX-BF16, AMX-TILE
  // Linux 5.16+ hands out the 8 KB tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
  // it then holds for every thread of the process, oneDNN's included
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

// x [M, K] bfloat16 -> packed [K / 2][cols] uint32: packed[r][m] holds x[m][2r], x[m][2r + 1] (rows
// past M up to cols zero), 16 x 16 blocks at a time through the transpose.
AMX_TARGET void pack_x(const c10::BFloat16* x, uint32_t* packed, int64_t M, int64_t K, int64_t cols) {
  const auto* xw = reinterpret_cast<const uint32_t*>(x);  // [M][K / 2] pairs
  const int64_t pairs = K / 2;
  for (int64_t m0 = 0; m0 < cols; m0 += 16) {
    for (int64_t c = 0; c < pairs; c += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = m0 + i < M ? _mm512_castsi512_ps(_mm512_loadu_si512(xw + (m0 + i) * pairs + c)) : _mm512_setzero_ps();
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_ps(reinterpret_cast<float*>(packed + (c + j) * cols + m0), r[j]);
    }
  }
}

// One C tile (16 weight rows n0.. x 16 token columns, floats at stride 16) -> y rows m < cols, + bias,
// rounded to bfloat16 or stored as they are (Y = float: a model's logits).
template <typename Y>
AMX_TARGET inline void store_rows(const float* tile, const c10::BFloat16* bias, Y* y, int64_t n0, int64_t m0,
                                  int64_t cols, int64_t N) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(tile + i * 16);
  transpose16(r);
  const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                              _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + n0))), 16))
                        : _mm512_setzero_ps();
  for (int64_t m = 0; m < cols; ++m) {
    const __m512 row = _mm512_add_ps(r[m], b);
    if constexpr (std::is_same_v<Y, float>)
      _mm512_storeu_ps(y + (m0 + m) * N + n0, row);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + m) * N + n0), (__m256i)_mm512_cvtneps_pbh(row));
  }
}

// Weight rows [16 * block_begin, 16 * block_end), NB blocks of 16 at a time, times token rows
// [m_begin, m_end) of the packed x (cols wide) in tiles of 16 (columns past m_end multiply the
// packed zeros and are not stored; every tile is 16 x 64 bytes, so the shapes of a tile product
// always match). A block's weights come from memory for the first tile, from cache after.
template <int NB, typename Y>
AMX_TARGET void run_blocks(const uint32_t* packed, int64_t cols, const c10::BFloat16* w, const c10::BFloat16* bias,
                           Y* y, int64_t m_begin, int64_t m_end, int64_t K, int64_t N,
                           int64_t block_begin, int64_t block_end) {
  static_assert(NB == 1 || NB == 2);
  const TileConfig cfg;
  _tile_loadconfig(&cfg);
  alignas(64) float tiles[2][16 * 16];
  const int64_t stride_w = K * sizeof(c10::BFloat16), stride_p = cols * sizeof(uint32_t);
  // The next group of NB blocks (contiguous in W) is prefetched into L2 while this one computes, a
  // share of its lines at every k step: the tile loads read 16-32 rows at a stride of K, more
  // streams than the hardware prefetcher follows, so without help they wait on memory.
  const int64_t group_lines = NB * kTileRows * K * int64_t(sizeof(c10::BFloat16)) / 64;
  const int64_t lines_per_step = (group_lines + K / kTileK - 1) / (K / kTileK);
  for (int64_t blk = block_begin; blk < block_end; blk += NB)
   for (int64_t mg = m_begin; mg < m_end; mg += 16) {
    const c10::BFloat16* w0 = w + blk * kTileRows * K;
    const char* next = blk + NB < block_end && mg == m_begin ? reinterpret_cast<const char*>(w0 + NB * kTileRows * K)
                                                             : nullptr;
    int64_t line = 0;
    _tile_zero(0);
    if constexpr (NB == 2) _tile_zero(1);
    for (int64_t k = 0; k < K; k += kTileK) {
      const uint32_t* p = packed + (k / 2) * cols + mg;
      if (next != nullptr)
        for (const int64_t stop = std::min(group_lines, line + lines_per_step); line < stop; ++line)
          _mm_prefetch(next + line * 64, _MM_HINT_T1);
      _tile_loadd(4, w0 + k, stride_w);
      _tile_loadd(6, p, stride_p);
      if constexpr (NB == 2) _tile_loadd(5, w0 + kTileRows * K + k, stride_w);
      _tile_dpbf16ps(0, 4, 6);  // (gcc's tile intrinsics paste their tile numbers into the asm: literals only)
      if constexpr (NB == 2) _tile_dpbf16ps(1, 5, 6);
    }
    _tile_stored(0, tiles[0], 64);
    if constexpr (NB == 2) _tile_stored(1, tiles[1], 64);
    for (int t = 0; t < NB; ++t)
      store_rows(tiles[t], bias, y, (blk + t) * kTileRows, mg, std::min<int64_t>(16, m_end - mg), N);
  }
  _tile_release();
}

template <typename Y>
void linear_into(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, Y* y, int64_t M,
                 int64_t K, int64_t N) {
  // token rows in slices whose packed x stays in L2 (~256 KB); per slice, pairs of weight blocks over
  // the threads, each pair times every tile of 16 rows of the slice
  const int64_t num_blocks = N / kTileRows, slice = std::max<int64_t>(16, (int64_t(1) << 18) / (2 * K) / 16 * 16);
  std::vector<uint32_t> packed(static_cast<size_t>(K / 2) * std::min(slice, (M + 15) / 16 * 16));
  for (int64_t m0 = 0; m0 < M; m0 += slice) {
    const int64_t rows = std::min(slice, M - m0), cols = (rows + 15) / 16 * 16;
    pack_x(x + m0 * K, packed.data(), rows, K, cols);
    at::parallel_for(0, (num_blocks + 1) / 2, 0, [&](int64_t begin, int64_t end) {
      const int64_t first = 2 * begin, last = std::min(2 * end, num_blocks), paired = first + (last - first) / 2 * 2;
      const uint32_t* p = packed.data();
      run_blocks<2>(p, cols, w, bias, y + m0 * N, 0, rows, K, N, first, paired);
      run_blocks<1>(p, cols, w, bias, y + m0 * N, 0, rows, K, N, paired, last);
    });
  }
}

}  // namespace

bool available() {
  static const bool ok = probe();
  return ok;
}

void linear(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y, int64_t M,
            int64_t K, int64_t N) {
  linear_into(x, w, bias, y, M, K, N);
}

void linear(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, float* y, int64_t M, int64_t K,
            int64_t N) {
  linear_into(x, w, bias, y, M, K, N);
}

#else
bool available() { return false; }
bool prefill_supported(int64_t) { return false; }
void paged_prefill(const PrefillProblem&) {}
void linear(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, c10::BFloat16*, int64_t, int64_t,
            int64_t) {}
void linear(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, float*, int64_t, int64_t, int64_t) {}
#endif

}  // namespace pagedserve::amx
