// Paged decode attention on a CPU: each query row attends over its own sequence's keys and values,
// read through its block table straight from the pools (vLLM's PagedAttention, CPU kernel).
// Built and loaded by torchmeg/batching/cpu_attention.py (torch.utils.cpp_extension), which defines the
// op's schema and its fake (shape) function; this file registers the CPU kernel only.
//
// Why our own: FlexAttention's CPU template runs a decode (one query a row) block by block, two GEMM
// calls and a softmax update per 16-position block, and on this project's 2-core CPU the static decode
// step spent ~40% of its time there (docs/generation.md). A decode query is a dot product per position
// and a weighted sum of the values: one pass over the row's keys, one over its values, vectorized over
// the head dimension. No library on PyPI offers it for torch's current releases (vLLM's CPU kernels live
// in vLLM's own binary; Intel's extension is pinned to old torch releases).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// x . y over n floats
inline float dot(const float* x, const float* y, int64_t n) {
  int64_t d = 0;
  Vec acc(0.f);
  for (; d + Vec::size() <= n; d += Vec::size()) {
    acc = at::vec::fmadd(Vec::loadu(x + d), Vec::loadu(y + d), acc);
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; d < n; ++d) s += x[d] * y[d];
  return s;
}

// acc += p * y over n floats
inline void axpy(float p, const float* y, float* acc, int64_t n) {
  int64_t d = 0;
  const Vec pv(p);
  for (; d + Vec::size() <= n; d += Vec::size()) {
    at::vec::fmadd(pv, Vec::loadu(y + d), Vec::loadu(acc + d)).store(acc + d);
  }
  for (; d < n; ++d) acc[d] += p * y[d];
}

// a row of a reduced-precision pool as floats (a float pool is read in place)
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  for (int64_t d = 0; d < n; ++d) buf[d] = static_cast<float>(src[d]);
  return buf;
}
template <>
inline const float* as_float<float>(const float* src, float*, int64_t) {
  return src;
}

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp, const int64_t* tables,
            int64_t width, const int64_t* starts, float scale, int64_t block, at::Tensor& out) {
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t K = kp.size(0), P = kp.size(1);
  const int64_t group = H / K;
  const T* qd = q.data_ptr<T>();
  const T* kd = kp.data_ptr<T>();
  const T* vd = vp.data_ptr<T>();
  T* od = out.data_ptr<T>();
  at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(D), qf(D), row(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / H, kh = (i % H) / group;
      const int64_t n = starts[r] + 1;  // positions 0 .. start: the new token's own included
      const int64_t* table = tables + r * width;
      for (int64_t d = 0; d < D; ++d) qf[d] = static_cast<float>(qd[i * D + d]) * scale;
      const T* kh_pool = kd + kh * P * D;
      const T* vh_pool = vd + kh * P * D;
      scores.resize(n);
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        const T* k = kh_pool + (table[j / block] * block + j % block) * D;
        const float s = dot(qf.data(), as_float<T>(k, row.data(), D), D);
        scores[j] = s;
        top = std::max(top, s);
      }
      // softmax's numerators and their sum, vectorized (Sleef's exp, as ATen's softmax)
      at::vec::map([top](Vec x) { return (x - Vec(top)).exp(); }, scores.data(), scores.data(), n);
      const float sum = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, scores.data(), n);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const T* v = vh_pool + (table[j / block] * block + j % block) * D;
        axpy(scores[j], as_float<T>(v, row.data(), D), acc.data(), D);
      }
      const float inv = 1.f / sum;
      for (int64_t d = 0; d < D; ++d) od[i * D + d] = static_cast<T>(acc[d] * inv);
    }
  });
}

// q [R, H, D]; k_pool, v_pool [K, P, D] (H a multiple of K: grouped-query attention); tables [R, W] int64,
// each row's blocks of `block` positions; starts [R] int64, each row's last position (its new token's,
// already written) -> [R, H, D]: each row's attention over its positions 0 .. start.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& tables, const at::Tensor& starts, double scale, int64_t block) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3, "paged_decode_attention: q [R, H, D], pools [K, P, D]");
  TORCH_CHECK(k_pool.sizes() == v_pool.sizes() && k_pool.size(2) == q.size(2), "paged_decode_attention: the pools' shapes differ from q's");
  TORCH_CHECK(q.size(1) % k_pool.size(0) == 0, "paged_decode_attention: query heads not a multiple of kv heads");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(), "paged_decode_attention: q and the pools differ in dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "paged_decode_attention: float32, bfloat16 or float16 (accumulated in float32)");
  TORCH_CHECK(tables.scalar_type() == at::kLong && starts.scalar_type() == at::kLong, "paged_decode_attention: tables and starts are int64");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) && starts.numel() == q.size(0), "paged_decode_attention: a table and a start per row");
  TORCH_CHECK(block > 0 && k_pool.size(1) % block == 0, "paged_decode_attention: the pool is not whole blocks");
  auto qc = q.contiguous();
  auto kc = k_pool.contiguous();
  auto vc = v_pool.contiguous();
  auto tb = tables.contiguous();
  auto st = starts.contiguous();
  const int64_t blocks = k_pool.size(1) / block;
  // every block a row reads must be in the pool (a bad table would read out of bounds)
  const int64_t* sp = st.data_ptr<int64_t>();
  const int64_t* tp = tb.data_ptr<int64_t>();
  for (int64_t r = 0; r < q.size(0); ++r) {
    TORCH_CHECK(sp[r] >= 0 && sp[r] < tables.size(1) * block, "paged_decode_attention: row ", r, "'s start ", sp[r], " is past its table");
    for (int64_t j = 0; j <= sp[r] / block; ++j) {
      const int64_t b = tp[r * tables.size(1) + j];
      TORCH_CHECK(b >= 0 && b < blocks, "paged_decode_attention: row ", r, " reads block ", b, " of a pool of ", blocks);
    }
  }
  auto out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "paged_decode_attention", [&] {
    decode<scalar_t>(qc, kc, vc, tp, tables.size(1), sp, static_cast<float>(scale), block, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchmeg, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
