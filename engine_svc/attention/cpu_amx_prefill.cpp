// Paged prefill attention through AMX tiles: causal flash attention over a bfloat16 pool.
//
// cpu_prefill.cpp's AVX512-BF16 kernel spends nearly all its time in VDPBF16PS (32 multiply-adds
// an instruction); one tile product does 8,192. Here the two products of each chunk of keys run on
// the tiles and only the online softmax stays in vector code:
//
//   pack   once per (sequence, kv head), the keys it reads, 64 at a time (zero past the context):
//          K^T  [key tile of 16][dim pair][16 keys]   B operand of S = Q K^T
//          V    [key pairs 32][16 key pairs][dim]      B operand of O = P V (pairs of keys, VNNI)
//   item   16 query rows of one (sequence, kv head): row = position x group + head, as cpu_prefill.cpp
//          S [16 rows x 64 keys] = Q [16 x D] . K^T      tmm0..3 (one per 16 keys), Q in tmm4
//          softmax per row: scale, causal mask, running max and sum, P rounded to bfloat16
//          O' [16 rows x 64 dims] = P [16 x 64 keys] . V  tmm0..3 again, P in tmm4 (two halves of 32 keys)
//          o = o * correction + O' in float32 (vector code), divided by the sum at the end
//   tmm5..7 carry the B operands in turn.
//
// Every product is exact bf16 x bf16 summed in float32; the weights are rounded to bf16 before the
// values product, the output once at the end (cpu_prefill.cpp's arithmetic, another order of sums).
// Slots past a context are never read: the packed tails are zeros, masked like future keys.

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_amx.h"
#include "cpu_simd.h"

#ifdef PAGEDSERVE_AMX
namespace pagedserve::amx {
namespace {

constexpr int kRows = 16, kChunk = 64;
constexpr int64_t kPackBudget = int64_t(64) << 20;  // bytes of packed K/V alive at once (groups run in batches)

struct Group {
  int64_t seq, kv_head, ctx, q_len, packed;  // packed: offset of its K^T (then V) in the batch's buffer, in uint32
};

struct Item {
  int64_t group, row_begin, cost;
};

using pagedserve_simd::kInterleaveHi;
using pagedserve_simd::kInterleaveLo;

int64_t padded(int64_t ctx) { return (ctx + kChunk - 1) / kChunk * kChunk; }

// K^T and V of keys [k0, k0 + 64) of one group, each half as large as its padded keys x D bf16.
template <int D>
void pack_chunk(const PrefillProblem& P, const Group& g, int64_t k0, uint32_t* buf) {
  const int64_t row_stride = P.num_kv_heads * D, pad = padded(g.ctx);
  const int32_t* table = P.tables + g.seq * P.max_blocks;
  auto row = [&](const c10::BFloat16* cache, int64_t key) -> const uint32_t* {
    if (key >= g.ctx) return nullptr;
    const int64_t slot = int64_t(table[key / P.block_size]) * P.block_size + key % P.block_size;
    return reinterpret_cast<const uint32_t*>(cache + slot * row_stride + g.kv_head * D);
  };
  uint32_t* kt = buf + g.packed;
  uint32_t* vp = kt + pad * D / 2;
  for (int64_t t0 = k0; t0 < k0 + kChunk; t0 += 16) {  // K^T: one 16 x 16 transpose per 32 dims of 16 keys
    const uint32_t* rows[16];
    for (int j = 0; j < 16; ++j) rows[j] = row(P.k_cache, t0 + j);
    for (int c = 0; c < D / 2; c += 16) {
      __m512 r[16];
      for (int j = 0; j < 16; ++j)
        r[j] = rows[j] ? _mm512_castsi512_ps(_mm512_loadu_si512(rows[j] + c)) : _mm512_setzero_ps();
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(reinterpret_cast<float*>(kt + ((t0 / 16) * (D / 2) + c + i) * 16), r[i]);
    }
  }
  for (int64_t a = k0; a < k0 + kChunk; a += 2) {  // V: keys a, a + 1 interleaved per dim
    const uint32_t *va = row(P.v_cache, a), *vb = row(P.v_cache, a + 1);
    uint32_t* dst = vp + (a / 2) * D;
    for (int d0 = 0; d0 < D; d0 += 32) {
      const __m512i x = va ? _mm512_loadu_si512(va + d0 / 2) : _mm512_setzero_si512();
      const __m512i y = vb ? _mm512_loadu_si512(vb + d0 / 2) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + d0, _mm512_permutex2var_epi16(x, kInterleaveLo, y));
      _mm512_storeu_si512(dst + d0 + 16, _mm512_permutex2var_epi16(x, kInterleaveHi, y));
    }
  }
}

template <int D>
struct Scratch {
  alignas(64) c10::BFloat16 q[kRows][D];
  alignas(64) float s[kRows][kChunk];  // scores of the chunk, then (masked, scaled) again
  alignas(64) c10::BFloat16 p[kRows][kChunk];
  alignas(64) float part[kRows][64];  // one 64-dim slice of P V
  alignas(64) float o[kRows][D];
  alignas(64) float m[kRows], l[kRows], corr[kRows];
  int32_t pos[kRows];
};

// S = Q K^T for keys [k0, k0 + 64) into w.s.
template <int D>
AMX_TARGET void scores(Scratch<D>& w, const uint32_t* kt, int64_t k0) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const uint32_t* b = kt + (k0 / 16) * (D / 2) * 16;  // key tile k0 / 16, dim pair 0
  for (int d = 0; d < D; d += 32) {
    _tile_loadd(4, &w.q[0][d], D * 2);
    const uint32_t* bd = b + (d / 2) * 16;
    _tile_loadd(5, bd, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, bd + (D / 2) * 16, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, bd + 2 * (D / 2) * 16, 64);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, bd + 3 * (D / 2) * 16, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, &w.s[0][0], kChunk * 4);
  _tile_stored(1, &w.s[0][16], kChunk * 4);
  _tile_stored(2, &w.s[0][32], kChunk * 4);
  _tile_stored(3, &w.s[0][48], kChunk * 4);
}

// The online softmax of one chunk: w.p = bf16(exp(scale * s - m)) over the keys each row sees,
// w.m, w.l updated, w.corr = exp(old m - new m).
template <int D>
void softmax(Scratch<D>& w, int64_t k0, float scale) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  alignas(64) float chunk_max[kRows], sums[kRows];
  for (int r = 0; r < kRows; ++r) {
    __m512 mx = neg_inf;
    for (int j = 0; j < kChunk; j += 16) {
      const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(int(k0 + j)));
      const __mmask16 seen = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(w.pos[r]));
      const __m512 s = _mm512_mask_mul_ps(neg_inf, seen, _mm512_loadu_ps(&w.s[r][j]), _mm512_set1_ps(scale));
      _mm512_storeu_ps(&w.s[r][j], s);
      mx = _mm512_max_ps(mx, s);
    }
    chunk_max[r] = _mm512_reduce_max_ps(mx);
  }
  const __m512 m_old = _mm512_load_ps(w.m), m_new = _mm512_max_ps(m_old, _mm512_load_ps(chunk_max));
  _mm512_store_ps(w.corr, pagedserve_simd::exp512_nonpos(_mm512_sub_ps(m_old, m_new)));  // 0 on the first chunk
  _mm512_store_ps(w.m, m_new);
  for (int r = 0; r < kRows; ++r) {  // every row sees key 0, so its max is finite from the first chunk on
    const __m512 mr = _mm512_set1_ps(w.m[r]);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < kChunk; j += 32) {
      const __m512 s0 = _mm512_loadu_ps(&w.s[r][j]), s1 = _mm512_loadu_ps(&w.s[r][j + 16]);
      const __m512 e0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s0, neg_inf, _CMP_NEQ_OQ),  // masked: exactly 0
                                            pagedserve_simd::exp512_nonpos(_mm512_sub_ps(s0, mr)));
      const __m512 e1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s1, neg_inf, _CMP_NEQ_OQ),
                                            pagedserve_simd::exp512_nonpos(_mm512_sub_ps(s1, mr)));
      sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
      _mm512_storeu_si512(&w.p[r][j], (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    sums[r] = _mm512_reduce_add_ps(sum);
  }
  _mm512_store_ps(w.l, _mm512_fmadd_ps(_mm512_load_ps(w.l), _mm512_load_ps(w.corr), _mm512_load_ps(sums)));
}

// o = o * corr + P V for keys [k0, k0 + 64), 64 dims (four tiles of 16) at a time.
template <int D>
AMX_TARGET void add_values(Scratch<D>& w, const uint32_t* vp, int64_t k0) {
  for (int d0 = 0; d0 < D; d0 += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int half = 0; half < 2; ++half) {  // 32 keys = 16 key pairs each
      _tile_loadd(4, &w.p[0][32 * half], kChunk * 2);
      const uint32_t* b = vp + ((k0 + 32 * half) / 2) * D + d0;
      _tile_loadd(5, b, D * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, b + 16, D * 4);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, b + 32, D * 4);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, b + 48, D * 4);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, &w.part[0][0], 256);
    _tile_stored(1, &w.part[0][16], 256);
    _tile_stored(2, &w.part[0][32], 256);
    _tile_stored(3, &w.part[0][48], 256);
    for (int r = 0; r < kRows; ++r) {
      const __m512 c = _mm512_set1_ps(w.corr[r]);
      for (int j = 0; j < 64; j += 16)
        _mm512_store_ps(&w.o[r][d0 + j], _mm512_fmadd_ps(_mm512_load_ps(&w.o[r][d0 + j]), c, _mm512_load_ps(&w.part[r][j])));
    }
  }
}

template <int D>
void run_item(const PrefillProblem& P, const Group& g, const Item& it, const uint32_t* buf, Scratch<D>& w) {
  const int64_t group = P.num_heads / P.num_kv_heads;
  const int64_t rows = std::min<int64_t>(kRows, g.q_len * group - it.row_begin);
  const int64_t first_token = P.starts[g.seq];
  for (int r = 0; r < kRows; ++r) {  // rows past `rows`: zero queries at the last row's position, never written
    const int64_t row = it.row_begin + std::min<int64_t>(r, rows - 1);
    w.pos[r] = int32_t(g.ctx - g.q_len + row / group);
    const c10::BFloat16* q = P.query + ((first_token + row / group) * P.num_heads + g.kv_head * group + row % group) * D;
    if (r < rows)
      std::memcpy(w.q[r], q, D * sizeof(c10::BFloat16));
    else
      std::memset(w.q[r], 0, D * sizeof(c10::BFloat16));
    w.m[r] = -std::numeric_limits<float>::infinity(), w.l[r] = 0.f;
  }
  std::memset(w.o, 0, sizeof(w.o));
  const uint32_t* kt = buf + g.packed;
  const uint32_t* vp = kt + padded(g.ctx) * D / 2;
  const int64_t visible = w.pos[kRows - 1] + 1;
  for (int64_t k0 = 0; k0 < visible; k0 += kChunk) {
    scores<D>(w, kt, k0);
    softmax<D>(w, k0, P.scale);
    add_values<D>(w, vp, k0);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = it.row_begin + r;
    c10::BFloat16* dst = P.out + ((first_token + row / group) * P.num_heads + g.kv_head * group + row % group) * D;
    const __m512 inv = _mm512_set1_ps(1.f / w.l[r]);
    for (int d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&w.o[r][d]), inv)));
  }
}

// One batch of groups: pack their keys (parallel over chunks), then their items (longest first).
template <int D>
AMX_TARGET void run_batch(const PrefillProblem& P, const std::vector<Group>& groups, const std::vector<Item>& items,
                          std::vector<uint32_t>& buf) {
  std::vector<std::pair<int64_t, int64_t>> chunks;  // (group, first key)
  for (int64_t i = 0; i < int64_t(groups.size()); ++i)
    for (int64_t k0 = 0; k0 < groups[i].ctx; k0 += kChunk) chunks.emplace_back(i, k0);
  const int64_t work = std::max(chunks.size(), items.size());
  const int threads = int(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), work)));
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(dynamic, 4)
    for (int64_t c = 0; c < int64_t(chunks.size()); ++c) pack_chunk<D>(P, groups[chunks[c].first], chunks[c].second, buf.data());
    const TileConfig cfg;
    _tile_loadconfig(&cfg);
    Scratch<D> w;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < int64_t(items.size()); ++i) run_item<D>(P, groups[items[i].group], items[i], buf.data(), w);
    _tile_release();
  }
}

template <int D>
void run_all(const PrefillProblem& P) {
  const int64_t group = P.num_heads / P.num_kv_heads;
  std::vector<Group> groups;
  std::vector<Item> items;
  std::vector<uint32_t> buf;
  int64_t packed = 0;
  auto flush = [&] {
    if (groups.empty()) return;
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
    buf.resize(size_t(packed));
    run_batch<D>(P, groups, items, buf);
    groups.clear(), items.clear(), packed = 0;
  };
  for (int64_t s = 0; s < P.num_seqs; ++s) {
    const int64_t q_len = P.starts[s + 1] - P.starts[s], ctx = P.lens[s];
    if (q_len < P.min_q_len || q_len == 0) continue;
    for (int64_t h = 0; h < P.num_kv_heads; ++h) {
      const int64_t size = padded(ctx) * D;  // K^T and V, half each, in uint32 pairs
      if (packed > 0 && (packed + size) * 4 > kPackBudget) flush();
      for (int64_t row = 0; row < q_len * group; row += kRows) {
        const int64_t last = std::min(q_len * group, row + kRows) - 1;
        items.push_back({int64_t(groups.size()), row, ctx - q_len + last / group + 1});
      }
      groups.push_back({s, h, ctx, q_len, packed});
      packed += size;
    }
  }
  flush();
}

}  // namespace

bool prefill_supported(int64_t head_dim) { return available() && (head_dim == 64 || head_dim == 128); }

void paged_prefill(const PrefillProblem& P) {
  TORCH_CHECK(prefill_supported(P.head_dim), "amx paged_prefill: needs AMX-BF16 and a head size of 64 or 128");
  if (P.head_dim == 64)
    run_all<64>(P);
  else
    run_all<128>(P);
}

}  // namespace pagedserve::amx
#endif
