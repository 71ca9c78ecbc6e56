// The sparse SGD step's address update as one XLA:CPU FFI custom call (sdm_jax/cpu_kernels.py).
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

}  // namespace

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
