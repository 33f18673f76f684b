// AMX (Advanced Matrix Extensions) kernels for bfloat16: the small-batch linear layer (cpu_amx.cpp,
// called by cpu_gemv.cpp) and paged prefill attention (cpu_amx_prefill.cpp, called by
// cpu_prefill.cpp), plus the pieces both use. Compiled in the AVX512-BF16 build only; the tile
// instructions are enabled per function (AMX_TARGET), and `available()` says at run time whether
// this CPU and kernel give this process the tiles. Part of the build's hash (cpu_ops.HEADERS).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

// the tile intrinsics need g++ 11 or clang 12; an older compiler builds everything else, without them
#if defined(__x86_64__) && defined(__AVX512BF16__) && defined(__AVX512F__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#include <immintrin.h>
#define PAGEDSERVE_AMX 1
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#endif

namespace pagedserve::amx {

// token rows the AMX linear takes: measured on one Xeon VM against oneDNN (30 layers' weights), the tiles
// won up to 128 rows (29 against 38 ms) and lost from 256 (62 against 52 ms), where oneDNN's blocking
// runs faster. The linear op's own limit (cpu_gemv.cpp's amx_rows) is measured at start-up, up to this.
constexpr int64_t kMaxRows = 128;

// True once this CPU has AMX-BF16 and Linux granted this process the tile state.
bool available();

// y[M, N] = x[M, K] W[N, K]^T (+ bias[N]), all bfloat16 and contiguous; 1 <= M <= kMaxRows, K % 32 == 0,
// N % 16 == 0. Accumulates in float32 (pairwise bfloat16 products, as VDPBF16PS); rounds once, or not at
// all into a float32 y (a model's logits).
void linear(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y, int64_t M,
            int64_t K, int64_t N);
void linear(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, float* y, int64_t M, int64_t K,
            int64_t N);

// Causal paged prefill attention over a bfloat16 pool (cpu_prefill.cpp's contract, checked there).
struct PrefillProblem {
  const c10::BFloat16 *query, *k_cache, *v_cache;
  const int32_t *tables, *starts, *lens;  // block tables [S, max_blocks], query_start_loc [S + 1], context_lens [S]
  c10::BFloat16* out;
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  float scale;
  int64_t min_q_len;  // sequences with fewer query rows are left to the caller
};
bool prefill_supported(int64_t head_dim);  // available() and a head size of 64 or 128
void paged_prefill(const PrefillProblem& P);

#ifdef PAGEDSERVE_AMX
// Palette 1 with every tile 16 rows x 64 bytes: C 16 x 16 floats, A 16 x 32 bfloat16, B 16 pairs x 16.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) rows[t] = 16, colsb[t] = 64;
  }
};

// 16 rows of 16 32-bit lanes -> their transpose, in place (in-lane unpacks, then two rounds of
// cross-lane shuffles).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // each 128-bit lane L of r[4g + j]: column 4L + j of rows 4g..4g+3
    r[4 * g] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
    r[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
    r[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
    r[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
    t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);
    t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
    r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
    r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xDD);
  }
}
#endif

}  // namespace pagedserve::amx
