// Structured outputs on CPU: set to -inf, in place, the logits a grammar's token bitmask forbids.
//
// bitmask[r] holds ceil(vocab / 32) int32 words, bit j of word w allowing token 32 * w + j (xgrammar's
// layout). Only the listed rows are touched; ids past the bitmask's width are forbidden too. A word
// that allows all 32 tokens (the common case in free text) costs one compare; a word that forbids
// all (the common case inside a JSON number) is one run of stores.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

namespace {

// Works on the raw bits (U: uint32_t for float, uint16_t for bfloat16 and half): -inf is one bit
// pattern, and a branch-free select per token vectorizes.
template <typename U>
void mask_row(U* logits, const int32_t* words, int64_t vocab, int64_t num_words, U neg_inf) {
  const int64_t covered = std::min(vocab, num_words * 32);
  int64_t w = 0;
  for (; (w + 1) * 32 <= covered; ++w) {
    const uint32_t word = static_cast<uint32_t>(words[w]);
    if (word == 0xFFFFFFFFu) continue;
    U* out = logits + w * 32;
    if (word == 0) {
      std::fill(out, out + 32, neg_inf);
      continue;
    }
    for (int j = 0; j < 32; ++j) out[j] = ((word >> j) & 1u) ? out[j] : neg_inf;
  }
  for (int64_t j = w * 32; j < covered; ++j)
    if (!((static_cast<uint32_t>(words[w]) >> (j - w * 32)) & 1u)) logits[j] = neg_inf;
  for (int64_t j = covered; j < vocab; ++j) logits[j] = neg_inf;
}

template <typename U>
void mask_rows(U* base, const int32_t* words, const int64_t* row_ids, int64_t n, int64_t vocab, int64_t num_words,
               U neg_inf) {
#pragma omp parallel for if (n > 8)
  for (int64_t i = 0; i < n; ++i)
    mask_row(base + row_ids[i] * vocab, words + row_ids[i] * num_words, vocab, num_words, neg_inf);
}

void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.device().is_cpu(), "logits: contiguous 2-D CPU");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() &&
              bitmask.size(0) == logits.size(0), "bitmask: contiguous int32 [rows, words]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows: int64 indices");
  const auto rows_c = rows.contiguous();
  const int64_t* row_ids = rows_c.data_ptr<int64_t>();
  const int64_t n = rows_c.numel(), vocab = logits.size(1), num_words = bitmask.size(1);
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < logits.size(0), "row out of range");
  const int32_t* words = bitmask.data_ptr<int32_t>();
  switch (logits.scalar_type()) {
    case at::kFloat:
      return mask_rows(static_cast<uint32_t*>(logits.data_ptr()), words, row_ids, n, vocab, num_words,
                       static_cast<uint32_t>(0xFF800000u));
    case at::kBFloat16:
      return mask_rows(static_cast<uint16_t*>(logits.data_ptr()), words, row_ids, n, vocab, num_words,
                       static_cast<uint16_t>(0xFF80u));
    case at::kHalf:
      return mask_rows(static_cast<uint16_t*>(logits.data_ptr()), words, row_ids, n, vocab, num_words,
                       static_cast<uint16_t>(0xFC00u));
    default:
      TORCH_CHECK(false, "apply_token_bitmask: float32, bfloat16 or float16 logits");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("apply_token_bitmask", &apply_token_bitmask); }
