// XLA:CPU FFI custom calls of the sparse SGD step (sdm_jax/cpu_kernels.py): the address update
// (SdmSparseUpdate), the top-m selection (SdmTopValuesAndIndices) and the active units
// (SdmSparseWinners), the last two at the end of the file.
//
// SdmSparseUpdate:
//
// For each problem of a (possibly vmapped) batch of problems:
//   addresses [r, n] f32, neuron-major (aliased to the first result: updated in place)
//   x [B, n] f32 (unit-norm inputs), d_hidden [B, m] f32, winners [B, m] s32
//   values_sq [] f32 (squared norm of the output-layer gradient)
//   attributes learning_rate, clip_norm (f64; clip_norm <= 0: no clipping)
// The gradient row of neuron i is g_i = sum over slots (b, j) with winners[b, j] == i of
// d_hidden[b, j] * x[b]: B * m axpys of length n instead of a dense [r, B] @ [B, n] matmul.
// step = optax clip_by_global_norm then sgd, with the global norm sqrt(sum_i |g_i|^2 + values_sq);
// each touched row becomes l2_normalize(relu(row - step * g_i)) (layers.l2_normalize: an all-zero
// row stays zero); untouched rows are unchanged. Winners outside [0, r) are ignored, like
// XLA's dropped out-of-range scatter indices. Results: new addresses, step size [] f32.
//
// Built by cpu_kernels.py with g++ -O3 -march=native -fopenmp-simd; the loops over n are
// contiguous and the reductions carry `omp simd` so they vectorise without -ffast-math.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Scratch {
  std::vector<int32_t> offsets;   // [r + 1]: CSR offsets of each neuron's slots
  std::vector<int32_t> slots;     // [B * m]: slot ids grouped by neuron, ascending within a neuron
  std::vector<int32_t> touched;   // distinct neurons, ascending
  std::vector<float> gradients;   // [touched, n]
};

thread_local Scratch scratch;

// One problem: updates `out` ([r, n], already holding the addresses) in place; returns the step.
float UpdateOne(float* __restrict out, const float* __restrict x, const float* __restrict d_hidden,
                const int32_t* __restrict winners, float values_sq, int64_t r, int64_t n, int64_t batch,
                int64_t m, double learning_rate, double clip_norm) {
  Scratch& s = scratch;
  const int64_t num_slots = batch * m;
  s.offsets.assign(r + 1, 0);
  for (int64_t q = 0; q < num_slots; ++q) {
    const int32_t w = winners[q];
    if (w >= 0 && w < r) ++s.offsets[w + 1];
  }
  s.touched.clear();
  for (int64_t i = 0; i < r; ++i) {
    if (s.offsets[i + 1] > 0) s.touched.push_back(static_cast<int32_t>(i));
    s.offsets[i + 1] += s.offsets[i];
  }
  s.slots.resize(std::max<int64_t>(num_slots, 1));
  {
    // Counting sort of the slots by neuron (stable: ascending example within a neuron).
    std::vector<int32_t>& fill = s.offsets;  // reused below; restore afterwards
    for (int64_t q = 0; q < num_slots; ++q) {
      const int32_t w = winners[q];
      if (w >= 0 && w < r) s.slots[fill[w]++] = static_cast<int32_t>(q);
    }
    // fill[i] now holds the end of neuron i's range = start of i + 1: shift back.
    for (int64_t i = r; i > 0; --i) fill[i] = fill[i - 1];
    fill[0] = 0;
  }

  const int64_t num_touched = static_cast<int64_t>(s.touched.size());
  s.gradients.resize(std::max<int64_t>(num_touched * n, 1));
  double address_sq = 0.0;
  for (int64_t t = 0; t < num_touched; ++t) {
    const int32_t i = s.touched[t];
    float* __restrict g = s.gradients.data() + t * n;
    // The neuron's non-zero slots, four at a time (one pass over g per four axpys).
    int32_t p = s.offsets[i];
    const int32_t end = s.offsets[i + 1];
    float d[4];
    const float* xs[4];
    bool first = true;
    while (true) {
      int c = 0;
      for (; p < end && c < 4; ++p) {
        const int32_t q = s.slots[p];
        if (d_hidden[q] == 0.0f) continue;
        d[c] = d_hidden[q];
        xs[c] = x + (q / m) * n;
        ++c;
      }
      if (c == 0 && !first) break;
      for (int k = c; k < 4; ++k) {  // pad with zero slots
        d[k] = 0.0f;
        xs[k] = x;
      }
      const float d0 = d[0], d1 = d[1], d2 = d[2], d3 = d[3];
      const float *__restrict x0 = xs[0], *__restrict x1 = xs[1], *__restrict x2 = xs[2], *__restrict x3 = xs[3];
      if (first) {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) g[j] = d0 * x0[j] + d1 * x1[j] + d2 * x2[j] + d3 * x3[j];
        first = false;
      } else {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) g[j] += d0 * x0[j] + d1 * x1[j] + d2 * x2[j] + d3 * x3[j];
      }
      if (c < 4) break;
    }
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t j = 0; j < n; ++j) sq += g[j] * g[j];
    address_sq += sq;
  }

  // optax.clip_by_global_norm then sgd (sparse._clipped_step_size).
  float step = static_cast<float>(learning_rate);
  if (clip_norm > 0.0) {
    const float norm = std::sqrt(static_cast<float>(address_sq) + values_sq);
    if (!(norm < static_cast<float>(clip_norm))) {
      step = static_cast<float>(learning_rate * clip_norm) / std::max(norm, 1e-38f);
    }
  }

  for (int64_t t = 0; t < num_touched; ++t) {
    float* __restrict row = out + static_cast<int64_t>(s.touched[t]) * n;
    const float* __restrict g = s.gradients.data() + t * n;
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t j = 0; j < n; ++j) {
      const float v = std::max(row[j] - step * g[j], 0.0f);
      row[j] = v;
      sq += v * v;
    }
    const float norm = std::sqrt(sq);
    // layers.l2_normalize divides by the norm; multiplying by its reciprocal differs by <= 1 ulp.
    const float inv = 1.0f / (norm > 0.0f ? norm : 1.0f);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) row[j] = row[j] * inv;
  }
  return step;
}

ffi::Error UpdateAddressesImpl(ffi::Buffer<ffi::F32> addresses, ffi::Buffer<ffi::F32> x,
                               ffi::Buffer<ffi::F32> d_hidden, ffi::Buffer<ffi::S32> winners,
                               ffi::Buffer<ffi::F32> values_sq, double learning_rate, double clip_norm,
                               ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> step) {
  const auto a_dims = addresses.dimensions();
  const auto x_dims = x.dimensions();
  const auto d_dims = d_hidden.dimensions();
  const size_t rank = a_dims.size();
  if (rank < 2 || x_dims.size() != rank || d_dims.size() != rank || winners.dimensions().size() != rank) {
    return ffi::Error::InvalidArgument("sdm_sparse_update: addresses, x, d_hidden, winners need equal ranks >= 2");
  }
  const int64_t r = a_dims[rank - 2], n = a_dims[rank - 1];
  const int64_t batch = x_dims[rank - 2], m = d_dims[rank - 1];
  if (x_dims[rank - 1] != n || d_dims[rank - 2] != batch) {
    return ffi::Error::InvalidArgument("sdm_sparse_update: shape mismatch");
  }
  int64_t problems = 1;
  for (size_t i = 0; i + 2 < rank; ++i) problems *= a_dims[i];
  if (static_cast<int64_t>(values_sq.element_count()) != problems ||
      static_cast<int64_t>(step->element_count()) != problems ||
      static_cast<int64_t>(winners.element_count()) != problems * batch * m) {
    return ffi::Error::InvalidArgument("sdm_sparse_update: leading (vmapped) dimensions differ");
  }
  float* out_data = out->typed_data();
  const float* in_data = addresses.typed_data();
  if (out_data != in_data) {  // XLA did not alias the buffers: start from a copy
    std::memcpy(out_data, in_data, sizeof(float) * problems * r * n);
  }
  for (int64_t p = 0; p < problems; ++p) {
    step->typed_data()[p] = UpdateOne(out_data + p * r * n, x.typed_data() + p * batch * n,
                                      d_hidden.typed_data() + p * batch * m,
                                      winners.typed_data() + p * batch * m, values_sq.typed_data()[p], r, n,
                                      batch, m, learning_rate, clip_norm);
  }
  return ffi::Error::Success();
}

// Top-m values (descending) and their indices per example, from neuron-major activations
// a [r, B] (layers.top_values_and_indices(a, m, axis=0)), in two passes over a:
// 1. the maxima of chunks of C consecutive rows, and per example the m-th largest of those
//    maxima, t: a lower bound of the m-th largest value (the m chunks whose maxima are >= t hold
//    m entries >= t). All SIMD across examples: the chunk maxima are merged into a sorted
//    [m, B] table by a branchless min/max insertion;
// 2. each example keeps its m best entries >= t so far, sorted; an entry enters only if it
//    beats the m-th (strictly, so among equal values the lower index is kept, and ties count
//    with multiplicity). Blocks of 16 examples are compared at once against their bounds; only
//    ~m entries per example reach the scalar insertion.
void TopOne(const float* __restrict a, int64_t r, int64_t batch, int64_t m, float* __restrict values,
            int32_t* __restrict indices, std::vector<float>& table, std::vector<float>& chunk_max,
            std::vector<int32_t>& count) {
  table.assign(m * batch, -INFINITY);
  chunk_max.resize(batch);
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(8, r / m));  // >= m chunks
  float* __restrict cm = chunk_max.data();
  for (int64_t c0 = 0; c0 < r; c0 += chunk) {
    const int64_t c1 = std::min(r, c0 + chunk);
    const float* __restrict first = a + c0 * batch;
#pragma omp simd
    for (int64_t b = 0; b < batch; ++b) cm[b] = first[b];
    for (int64_t i = c0 + 1; i < c1; ++i) {
      const float* __restrict row = a + i * batch;
#pragma omp simd
      for (int64_t b = 0; b < batch; ++b) cm[b] = std::max(cm[b], row[b]);
    }
    for (int64_t p = 0; p < m; ++p) {  // insert cm into the descending table, branch-free
      float* __restrict level = table.data() + p * batch;
#pragma omp simd
      for (int64_t b = 0; b < batch; ++b) {
        const float hi = std::max(level[b], cm[b]);
        cm[b] = std::min(level[b], cm[b]);
        level[b] = hi;
      }
    }
  }
  float* __restrict bound = table.data() + (m - 1) * batch;  // t per example
  count.assign(batch, 0);
  for (int64_t q = 0; q < batch * m; ++q) {
    values[q] = -INFINITY;
    indices[q] = 0;
  }
  constexpr int64_t kBlock = 16;
  for (int64_t i = 0; i < r; ++i) {
    const float* __restrict row = a + i * batch;
    for (int64_t b0 = 0; b0 < batch; b0 += kBlock) {
      const int64_t bn = std::min(kBlock, batch - b0);
      const float* __restrict th = bound + b0;
      const float* __restrict rb = row + b0;
      uint32_t mask = 0;
#if defined(__AVX512F__)
      if (bn == kBlock) {
        mask = _mm512_cmp_ps_mask(_mm512_loadu_ps(rb), _mm512_loadu_ps(th), _CMP_GE_OQ);
      } else  // NOLINT: the generic loop below
#endif
      {
#pragma omp simd reduction(| : mask)
        for (int64_t j = 0; j < bn; ++j) mask |= static_cast<uint32_t>(rb[j] >= th[j]) << j;
      }
      while (mask) {
        const int j = __builtin_ctz(mask);
        mask &= mask - 1;
        const float v = rb[j];
        const int64_t b = b0 + j;
        float* __restrict vals = values + b * m;
        int32_t* __restrict idx = indices + b * m;
        int64_t p;
        if (count[b] < m) {
          p = count[b]++;
        } else if (v > vals[m - 1]) {
          p = m - 1;
        } else {
          continue;  // a tie with the m-th: the lower index stays
        }
        while (p > 0 && vals[p - 1] < v) {
          vals[p] = vals[p - 1];
          idx[p] = idx[p - 1];
          --p;
        }
        vals[p] = v;
        idx[p] = static_cast<int32_t>(i);
        if (count[b] == m) bound[b] = vals[m - 1];
      }
    }
  }
}

ffi::Error TopValuesAndIndicesImpl(ffi::Buffer<ffi::F32> a, ffi::ResultBuffer<ffi::F32> values,
                                   ffi::ResultBuffer<ffi::S32> indices) {
  const auto a_dims = a.dimensions();
  const auto v_dims = values->dimensions();
  const size_t rank = a_dims.size();
  if (rank < 2 || v_dims.size() != rank) {
    return ffi::Error::InvalidArgument("sdm_top_values_and_indices: a [..., r, B] -> values [..., B, m]");
  }
  const int64_t r = a_dims[rank - 2], batch = a_dims[rank - 1], m = v_dims[rank - 1];
  if (v_dims[rank - 2] != batch || m > r || m < 1) {
    return ffi::Error::InvalidArgument("sdm_top_values_and_indices: shape mismatch or m > r");
  }
  int64_t problems = 1;
  for (size_t i = 0; i + 2 < rank; ++i) problems *= a_dims[i];
  thread_local std::vector<float> table, chunk_max;
  thread_local std::vector<int32_t> count;
  for (int64_t p = 0; p < problems; ++p) {
    TopOne(a.typed_data() + p * r * batch, r, batch, m, values->typed_data() + p * batch * m,
           indices->typed_data() + p * batch * m, table, chunk_max, count);
  }
  return ffi::Error::Success();
}

// The sparse step's active units (sparse.train_step): from a [r, B] (neuron-major, >= 0) and
// the GABA lambdas [r], with I_b the (k+1)-th largest a[:, b] (Eq. 4 / Eq. 8):
//   hidden [B, c], winners [B, c]: the c largest relu(a[:, b] - lambda I_b) and their neurons;
//   active [B]: #{i : a[i, b] > lambda_i I_b} (the units that fire; > c means the step is not exact).
// After the switch (every lambda = 1) the c largest a[:, b] give both, from the one selection of
// m = max(k + 1, c) values (a > lambda I >= I only for the top k). While some lambda < 1, a
// second pass counts and a second selection runs on relu(a - lambda I).
ffi::Error SparseWinnersImpl(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> lam, int64_t k,
                             ffi::ResultBuffer<ffi::F32> hidden, ffi::ResultBuffer<ffi::S32> winners,
                             ffi::ResultBuffer<ffi::S32> active) {
  const auto a_dims = a.dimensions();
  const auto h_dims = hidden->dimensions();
  const size_t rank = a_dims.size();
  if (rank < 2 || h_dims.size() != rank || lam.dimensions().size() != rank - 1) {
    return ffi::Error::InvalidArgument("sdm_sparse_winners: a [..., r, B], lambda [..., r] -> [..., B, c]");
  }
  const int64_t r = a_dims[rank - 2], batch = a_dims[rank - 1], c = h_dims[rank - 1];
  const int64_t m = std::max(k + 1, c);
  if (h_dims[rank - 2] != batch || lam.dimensions()[rank - 2] != r || k < 0 || c < 1 || m > r) {
    return ffi::Error::InvalidArgument("sdm_sparse_winners: shape mismatch, or max(k + 1, c) > r");
  }
  int64_t problems = 1;
  for (size_t i = 0; i + 2 < rank; ++i) problems *= a_dims[i];
  thread_local std::vector<float> table, chunk_max, values, reduced, reduced_values;
  thread_local std::vector<int32_t> count, indices;
  values.resize(batch * m);
  indices.resize(batch * m);
  for (int64_t p = 0; p < problems; ++p) {
    const float* ap = a.typed_data() + p * r * batch;
    const float* lp = lam.typed_data() + p * r;
    float* hp = hidden->typed_data() + p * batch * c;
    int32_t* wp = winners->typed_data() + p * batch * c;
    int32_t* np_ = active->typed_data() + p * batch;
    TopOne(ap, r, batch, m, values.data(), indices.data(), table, chunk_max, count);
    bool switched = true;
    for (int64_t i = 0; i < r; ++i) switched &= lp[i] >= 1.0f;
    if (switched) {
      for (int64_t b = 0; b < batch; ++b) {
        const float* vals = values.data() + b * m;
        const int32_t* idx = indices.data() + b * m;
        const float threshold = vals[k];
        int32_t fired = 0;
        for (int64_t q = 0; q < k; ++q) fired += vals[q] > lp[idx[q]] * threshold;
        np_[b] = fired;
        for (int64_t q = 0; q < c; ++q) {
          hp[b * c + q] = std::max(vals[q] - threshold, 0.0f);
          wp[b * c + q] = idx[q];
        }
      }
      continue;
    }
    // During the switch: relu(a - lambda I) over all units, counted and selected again.
    reduced.resize(r * batch);
    reduced_values.resize(batch * c);
    std::vector<float> threshold(batch);
    for (int64_t b = 0; b < batch; ++b) threshold[b] = values[b * m + k];
    for (int64_t b = 0; b < batch; ++b) np_[b] = 0;
    for (int64_t i = 0; i < r; ++i) {
      const float* __restrict row = ap + i * batch;
      float* __restrict out = reduced.data() + i * batch;
      const float li = lp[i];
      for (int64_t b = 0; b < batch; ++b) {
        const float bar = li * threshold[b];
        np_[b] += row[b] > bar;
        out[b] = std::max(row[b] - bar, 0.0f);
      }
    }
    TopOne(reduced.data(), r, batch, c, hp, wp, table, chunk_max, count);
  }
  return ffi::Error::Success();
}

}  // namespace

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* SdmSparseWinners(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmSparseWinners, SparseWinnersImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // a [..., r, B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // lambda [..., r]
                                  .Attr<int64_t>("k")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // hidden [..., B, c]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // winners [..., B, c]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // active [..., B]

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* SdmTopValuesAndIndices(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmTopValuesAndIndices, TopValuesAndIndicesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // a [..., r, B]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // values [..., B, m]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // indices [..., B, m]

// Exported (the library is built with -fvisibility=hidden); looked up by ctypes.
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* SdmSparseUpdate(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmSparseUpdate, UpdateAddressesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // addresses
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // d_hidden
                                  .Arg<ffi::Buffer<ffi::S32>>()  // winners
                                  .Arg<ffi::Buffer<ffi::F32>>()  // values_sq
                                  .Attr<double>("learning_rate")
                                  .Attr<double>("clip_norm")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // new addresses
                                  .Ret<ffi::Buffer<ffi::F32>>());  // step size
