// The decode rows' attention on a CPU: one query token per row over its own KV slot, read to
// the row's own length (workers/engine/decode_kernel.py builds and loads this; attention.py calls it).
//
// SDPA's CPU flash kernel costs 2.5 to 3 ms a layer for 32 rows of ~150 positions (8 heads of 64),
// mostly its per-(row, head) blocking around small GEMMs: this reads each (row, key/value head)'s
// keys and then values once, as two contiguous streams, and keeps the scores of that head's query
// heads (grouped-query attention: the query heads of one key/value head share the reads).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// query [n, Hq, D]; key/value: a layer of the cache [slots, Hkv, max_len, D] (the last dim
// contiguous); slots, positions [n] (int64): row r attends over positions 0..positions[r] of
// slot slots[r]. Returns [n, Hq, D] (float32).
at::Tensor decode_attention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& slots,
    const at::Tensor& positions, double scale) {
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(
      query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat,
      "float32 only");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 4 && value.dim() == 4, "query [n, Hq, D], key/value [S, Hkv, L, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && positions.scalar_type() == at::kLong, "int64 slots and positions");
  TORCH_CHECK(slots.is_contiguous() && positions.is_contiguous(), "contiguous slots and positions");
  TORCH_CHECK(key.sizes() == value.sizes(), "key and value of one shape");
  const int64_t n = query.size(0), hq = query.size(1), dim = query.size(2);
  const int64_t num_slots = key.size(0), hkv = key.size(1), max_len = key.size(2);
  TORCH_CHECK(key.size(3) == dim && hq % hkv == 0, "head sizes");
  TORCH_CHECK(slots.numel() == n && positions.numel() == n, "one slot and position per row");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(3) == 1 && value.stride(3) == 1, "contiguous head dim");
  const int64_t groups = hq / hkv;
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(slot[r] >= 0 && slot[r] < num_slots && pos[r] >= 0 && pos[r] < max_len, "slot or position out of range");
  }
  at::Tensor out = at::empty({n, hq, dim}, query.options());
  const float* q = query.data_ptr<float>();
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), ks2 = key.stride(2);
  const int64_t vs0 = value.stride(0), vs1 = value.stride(1), vs2 = value.stride(2);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, n * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(groups * dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / hkv, h = item % hkv, len = pos[r] + 1;
      const float* kb = k + slot[r] * ks0 + h * ks1;
      const float* vb = v + slot[r] * vs0 + h * vs1;
      const float* qb = q + r * qs0 + h * groups * qs1;
      scores.resize(groups * len);
      for (int64_t l = 0; l < len; ++l) {
        const float* kr = kb + l * ks2;
        for (int64_t g = 0; g < groups; ++g) {
          const float* qr = qb + g * qs1;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t j = 0; j < dim; ++j) dot += qr[j] * kr[j];
          scores[g * len + l] = dot * sc;
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        float* s = scores.data() + g * len;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t l = 0; l < len; ++l) top = std::max(top, s[l]);
        float sum = 0.f;
        for (int64_t l = 0; l < len; ++l) {
          s[l] = std::exp(s[l] - top);
          sum += s[l];
        }
        const float inv = 1.f / sum;
        for (int64_t l = 0; l < len; ++l) s[l] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < len; ++l) {
        const float* vr = vb + l * vs2;
        for (int64_t g = 0; g < groups; ++g) {
          const float p = scores[g * len + l];
          float* a = acc.data() + g * dim;
#pragma omp simd
          for (int64_t j = 0; j < dim; ++j) a[j] += p * vr[j];
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        std::copy(acc.begin() + g * dim, acc.begin() + (g + 1) * dim, o + (r * hq + h * groups + g) * dim);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(spool_cpu, m) {
  m.def(
      "decode_attention(Tensor query, Tensor key, Tensor value, Tensor slots, Tensor positions, float scale) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(spool_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
