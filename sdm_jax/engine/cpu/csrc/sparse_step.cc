// XLA:CPU FFI custom calls of the sparse SGD step (sdm_jax/cpu_kernels.py, sdm_jax/sparse.py):
//   SdmActiveUnits         the active units a* > 0 of a batch as a flat list of slots;
//   SdmSparseUpdate        the address update from those slots (SGD, clip, projection);
//   SdmSparseUpdatePenalized  the same plus a quadratic penalty (EWC, MAS, SI, L2);
//   SdmSparseUpdatePathIntegral  the penalised update plus SI's path integral w -= g_si * delta theta;
//   SdmTopValuesAndIndices the top-m values and indices per example (topk.top_values_and_indices);
//   SdmDenseUpdate         the DENSE step's address update: clip, SGD, projection in 3 passes;
//   SdmCacheRows, SdmCacheWrite  the forward cache's row traffic: a batch's rows read and written back (end of file).
//
// Slots. A batch's active units are S slots (example, neuron, value), sorted by example; the
// first `total` hold the units with a* = relu(a - lambda I) > 0 (Eq. 4; lambda of the GABA
// switch, App. B.3), the rest are padding (example B, neuron r, value 0). S is a capacity on the
// batch's TOTAL active count, not on any one example's: an example may have any number of
// active units (neurons short of lambda = +1 fire beyond the top k), and the step's work is in
// proportion to the total. total > S means the step dropped units (the caller redoes the block
// with the dense step).
//
// The address update, per problem of a (possibly vmapped) batch of problems:
//   addresses [r, n] f32, neuron-major (aliased to the first result: updated in place)
//   x [B, n] f32 (unit-norm inputs); d [S] f32 (dL/da* per slot), neuron [S] s32, example [S] s32
//   values_sq [] f32 (squared norm of the output layer's whole gradient)
//   attributes learning_rate, clip_norm (f64; clip_norm <= 0: no clipping)
// The data gradient row of neuron i is g_i = sum over its slots s of d[s] * x[example[s]]. The
// penalised variant adds 2 strength A_i * (theta_i - m_i) (the folded quadratic penalty
// strength * sum A (theta - m)^2 of regularizers.RegState: curvature A, center m) on the rows
// `penalty_rows` marks (rows whose A is not all zero), and returns the penalty's value at the
// current addresses. A row only the penalty moves costs one read of theta, A and m and one write
// of theta: its |g|^2 and value for the norm pass are carried from the previous step's update
// pass (`row_stats`, [2, r], valid within a block of sparse steps; the caller starts each block
// with them invalid) instead of a second read. step = optax clip_by_global_norm then sgd over the global norm
// sqrt(sum_i |g_i|^2 + values_sq); each row with a non-zero gradient becomes
// l2_normalize(relu(row - step * g_i)) (an all-zero row stays zero); other rows are unchanged.
// Slots with a neuron outside [0, r) are ignored, like XLA's dropped out-of-range scatters.
//
// Built by cpu_kernels.py with g++ -O3 -march=native -fopenmp-simd; the loops over n are
// contiguous and the reductions carry `omp simd` so they vectorise without -ffast-math.

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The quadratic penalty of one problem (null `curvature`: none).
struct Penalty {
  const float* curvature = nullptr;  // A [r, n]
  const float* center = nullptr;     // m [r, n]
  const uint8_t* rows = nullptr;     // [r]: 1 where A's row is not all zero
  float strength = 0.0f;
  // Per-row statistics at the current addresses, [2, r]: |2 strength A_i (theta_i - m_i)|^2, then
  // sum A_i (theta_i - m_i)^2. `row_stats` (null or `row_stats_valid` false: compute them) is read
  // for the rows the data does not touch; `next_row_stats` receives them at the new addresses.
  const float* row_stats = nullptr;
  bool row_stats_valid = false;
  float* next_row_stats = nullptr;
};

// SI's path integral (Zenke et al. 2017, Eq. 3): w -= g_si * (new theta - old theta) on the rows
// g_si touches, with g_si the gradient from the slots' `d` (null `w`: none).
struct PathIntegral {
  float* w = nullptr;        // [r, n], updated in place
  const float* d = nullptr;  // [S]
};

struct Scratch {
  std::vector<int32_t> offsets;   // [r + 1]: CSR offsets of each neuron's slots
  std::vector<int32_t> slots;     // slot ids grouped by neuron, ascending within a neuron
  std::vector<int32_t> rows;      // rows with a gradient (data or penalty), ascending
  std::vector<int64_t> data_rows;  // positions in `rows` of the rows with a data gradient
  std::vector<float> gradients;   // [rows, n]
  std::vector<float> si_gradients;  // [rows, n] (SI: the path integral's gradient, data rows only)
  std::vector<float> old_row;     // [n] (SI: the row before the step)
  std::vector<float> penalty_row;  // [n]: one row's penalty gradient (rows the data does not touch)
};

thread_local Scratch scratch;

// g = the data gradient of neuron i from its slots [p, end), four slots per pass over g.
void DataGradientRow(float* __restrict g, int32_t p, int32_t end, const int32_t* __restrict slots,
                     const float* __restrict d, const int32_t* __restrict example, const float* __restrict x,
                     int64_t n, int64_t batch) {
  bool first = true;
  while (true) {
    float dc[4];
    const float* xs[4];
    int c = 0;
    for (; p < end && c < 4; ++p) {
      const int32_t s = slots[p];
      const int32_t b = example[s];
      if (d[s] == 0.0f || b < 0 || b >= batch) continue;
      dc[c] = d[s];
      xs[c] = x + static_cast<int64_t>(b) * n;
      ++c;
    }
    if (c == 0 && !first) break;
    for (int q = c; q < 4; ++q) {  // pad with zero slots
      dc[q] = 0.0f;
      xs[q] = x;
    }
    const float d0 = dc[0], d1 = dc[1], d2 = dc[2], d3 = dc[3];
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
}

// One row's penalty gradient g = 2 strength A (theta - m) and its statistics: value = sum A (theta -
// m)^2 and sq = |g|^2. Not inlined, so the statistics carried from one step's update pass and the
// ones computed afresh come from the same machine code, bit for bit.
__attribute__((noinline)) void PenaltyRow(const float* __restrict row, const float* __restrict a,
                                          const float* __restrict m, float two_strength, int64_t n,
                                          float* __restrict g, float* value_out, float* sq_out) {
  float value = 0.0f;
#pragma omp simd reduction(+ : value)
  for (int64_t j = 0; j < n; ++j) {
    const float diff = row[j] - m[j];
    value += a[j] * (diff * diff);
    g[j] = two_strength * (a[j] * diff);
  }
  float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
  for (int64_t j = 0; j < n; ++j) sq += g[j] * g[j];
  *value_out = value;
  *sq_out = sq;
}

// row = l2_normalize(relu(row - step * g)): the SGD step and the SDM projection of one row. Not
// inlined, so every row (data or penalty) gets the same vectorised machine code and summation order.
__attribute__((noinline)) void StepAndProjectRow(float* __restrict row, const float* __restrict g, float step,
                                                 int64_t n) {
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

// One problem: updates `out` ([r, n], already holding the addresses) in place; returns the step
// and writes the penalty's value at the old addresses into `penalty_value` (0 without one).
float UpdateOne(float* __restrict out, const float* __restrict x, const float* __restrict d,
                const int32_t* __restrict neuron, const int32_t* __restrict example, float values_sq, int64_t r,
                int64_t n, int64_t batch, int64_t num_slots, double learning_rate, double clip_norm,
                const Penalty& penalty, const PathIntegral& si, float* penalty_value) {
  Scratch& s = scratch;
  // Counting sort of the slots by neuron (stable: ascending slot within a neuron).
  s.offsets.assign(r + 2, 0);
  for (int64_t q = 0; q < num_slots; ++q) {
    const int32_t w = neuron[q];
    if (w >= 0 && w < r) ++s.offsets[w + 2];
  }
  for (int64_t i = 0; i < r; ++i) s.offsets[i + 2] += s.offsets[i + 1];
  s.slots.resize(std::max<int64_t>(num_slots, 1));
  for (int64_t q = 0; q < num_slots; ++q) {
    const int32_t w = neuron[q];
    if (w >= 0 && w < r) s.slots[s.offsets[w + 1]++] = static_cast<int32_t>(q);
  }
  // offsets[i] .. offsets[i + 1] are now neuron i's slots.
  s.rows.clear();
  s.data_rows.clear();
  for (int64_t i = 0; i < r; ++i) {
    if (s.offsets[i + 1] > s.offsets[i]) s.data_rows.push_back(static_cast<int64_t>(s.rows.size()));
    if (s.offsets[i + 1] > s.offsets[i] || (penalty.curvature && penalty.rows[i])) s.rows.push_back(i);
  }
  const int64_t num_rows = static_cast<int64_t>(s.rows.size());
  s.gradients.resize(std::max<int64_t>(num_rows * n, 1));
  if (si.w) {
    s.si_gradients.resize(std::max<int64_t>(num_rows * n, 1));
    s.old_row.resize(std::max<int64_t>(n, 1));
  }
  const float two_strength = 2.0f * penalty.strength;
  if (penalty.curvature) s.penalty_row.resize(std::max<int64_t>(n, 1));
  double address_sq = 0.0, penalty_sum = 0.0;
  for (int64_t t = 0; t < num_rows; ++t) {
    const int32_t i = s.rows[t];
    float* __restrict g = s.gradients.data() + t * n;
    const bool has_data = s.offsets[i + 1] > s.offsets[i];
    const bool penalized = penalty.curvature && penalty.rows[i];
    const float* __restrict a = penalized ? penalty.curvature + static_cast<int64_t>(i) * n : nullptr;
    const float* __restrict m = penalized ? penalty.center + static_cast<int64_t>(i) * n : nullptr;
    const float* __restrict row = out + static_cast<int64_t>(i) * n;
    if (!has_data) {
      // Only the penalty moves this row: its statistics were carried from the last step's update
      // pass (or are computed here); its gradient is recomputed in the update pass, not stored.
      float value, sq;
      if (penalty.row_stats != nullptr && penalty.row_stats_valid) {
        sq = penalty.row_stats[i];
        value = penalty.row_stats[r + i];
      } else {
        PenaltyRow(row, a, m, two_strength, n, s.penalty_row.data(), &value, &sq);
      }
      penalty_sum += value;
      address_sq += sq;
      continue;
    }
    DataGradientRow(g, s.offsets[i], s.offsets[i + 1], s.slots.data(), d, example, x, n, batch);
    if (si.w) {
      DataGradientRow(s.si_gradients.data() + t * n, s.offsets[i], s.offsets[i + 1], s.slots.data(), si.d, example, x,
                      n, batch);
    }
    if (penalized) {
      float value = 0.0f;
#pragma omp simd reduction(+ : value)
      for (int64_t j = 0; j < n; ++j) {
        const float diff = row[j] - m[j];
        value += a[j] * (diff * diff);
        g[j] += two_strength * (a[j] * diff);
      }
      penalty_sum += value;
    }
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t j = 0; j < n; ++j) sq += g[j] * g[j];
    address_sq += sq;
  }
  *penalty_value = static_cast<float>(penalty_sum);

  // optax.clip_by_global_norm then sgd (sparse._clipped_step_size).
  float step = static_cast<float>(learning_rate);
  if (clip_norm > 0.0) {
    const float norm = std::sqrt(static_cast<float>(address_sq) + values_sq);
    if (!(norm < static_cast<float>(clip_norm))) {
      step = static_cast<float>(learning_rate * clip_norm) / std::max(norm, 1e-38f);
    }
  }

  // The rows with a data gradient (every moved row, without a penalty). They go through the same
  // out-of-line StepAndProjectRow as the penalty's rows: written inline here, GCC vectorised only
  // the first row and left every later one a scalar chain of dependent FMAs (~1 us per row of 784:
  // 12% of the main job's time); the function's loop is vectorised (16 partial sums).
  for (const int64_t t : s.data_rows) {
    const int32_t i = s.rows[t];
    float* __restrict row = out + static_cast<int64_t>(i) * n;
    const float* __restrict g = s.gradients.data() + t * n;
    const bool path_integral = si.w != nullptr;  // SI's w moves on every row with a data gradient
    if (path_integral) std::memcpy(s.old_row.data(), row, sizeof(float) * n);
    StepAndProjectRow(row, g, step, n);
    if (path_integral) {  // regularizers.si_accumulate: w - g * (new - old)
      float* __restrict w = si.w + static_cast<int64_t>(i) * n;
      const float* __restrict gsi = s.si_gradients.data() + t * n;
      const float* __restrict old = s.old_row.data();
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) w[j] = w[j] - gsi[j] * (row[j] - old[j]);
    }
  }
  // The rows only the penalty moves, with their gradient recomputed here (it was not stored), and
  // every penalised row's statistics at its new address for the next step's norm pass.
  if (penalty.curvature == nullptr) return step;
  if (penalty.next_row_stats != nullptr) std::fill(penalty.next_row_stats, penalty.next_row_stats + 2 * r, 0.0f);
  for (int64_t t = 0; t < num_rows; ++t) {
    const int32_t i = s.rows[t];
    if (!penalty.rows[i]) continue;
    float* __restrict row = out + static_cast<int64_t>(i) * n;
    const float* __restrict a = penalty.curvature + static_cast<int64_t>(i) * n;
    const float* __restrict m = penalty.center + static_cast<int64_t>(i) * n;
    float* __restrict pg = s.penalty_row.data();
    if (s.offsets[i + 1] == s.offsets[i]) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) pg[j] = two_strength * (a[j] * (row[j] - m[j]));
      StepAndProjectRow(row, pg, step, n);
    }
    if (penalty.next_row_stats != nullptr) {
      PenaltyRow(row, a, m, two_strength, n, pg, &penalty.next_row_stats[r + i], &penalty.next_row_stats[i]);
    }
  }
  return step;
}

// Shapes of the update's operands: [..., r, n], x [..., B, n], slots [..., S]; `problems` is the
// product of the leading (vmapped) dimensions.
struct UpdateShape {
  int64_t r, n, batch, num_slots, problems;
};

ffi::Error CheckUpdateShapes(const ffi::Buffer<ffi::F32>& addresses, const ffi::Buffer<ffi::F32>& x,
                             const ffi::Buffer<ffi::F32>& d, const ffi::Buffer<ffi::S32>& neuron,
                             const ffi::Buffer<ffi::S32>& example, const ffi::Buffer<ffi::F32>& values_sq,
                             UpdateShape& shape) {
  const auto a_dims = addresses.dimensions();
  const auto x_dims = x.dimensions();
  const size_t rank = a_dims.size();
  if (rank < 2 || x_dims.size() != rank || d.dimensions().size() != rank - 1 ||
      neuron.dimensions().size() != rank - 1 || example.dimensions().size() != rank - 1) {
    return ffi::Error::InvalidArgument("sdm_sparse_update: addresses [..., r, n], x [..., B, n], slots [..., S]");
  }
  shape = UpdateShape{a_dims[rank - 2], a_dims[rank - 1], x_dims[rank - 2], d.dimensions()[rank - 2], 1};
  for (size_t i = 0; i + 2 < rank; ++i) shape.problems *= a_dims[i];
  if (x_dims[rank - 1] != shape.n || static_cast<int64_t>(neuron.element_count()) != shape.problems * shape.num_slots ||
      static_cast<int64_t>(example.element_count()) != shape.problems * shape.num_slots ||
      static_cast<int64_t>(d.element_count()) != shape.problems * shape.num_slots ||
      static_cast<int64_t>(values_sq.element_count()) != shape.problems) {
    return ffi::Error::InvalidArgument("sdm_sparse_update: shape mismatch (or leading dimensions differ)");
  }
  return ffi::Error::Success();
}

ffi::Error RunUpdates(const UpdateShape& sh, const float* in_data, float* out_data, const float* x, const float* d,
                      const int32_t* neuron, const int32_t* example, const float* values_sq, double learning_rate,
                      double clip_norm, const float* curvature, const float* center, const uint8_t* rows,
                      const float* strength, float* step, float* penalty_value, const float* row_stats = nullptr,
                      const uint8_t* row_stats_valid = nullptr, float* next_row_stats = nullptr,
                      const float* si_d = nullptr, const float* w_in = nullptr, float* w_out = nullptr) {
  if (out_data != in_data) {  // XLA did not alias the buffers: start from a copy
    std::memcpy(out_data, in_data, sizeof(float) * sh.problems * sh.r * sh.n);
  }
  const int64_t rn = sh.r * sh.n;
  if (w_out != nullptr && w_out != w_in) std::memcpy(w_out, w_in, sizeof(float) * sh.problems * rn);
  for (int64_t p = 0; p < sh.problems; ++p) {
    Penalty penalty;
    if (curvature != nullptr) {
      penalty = Penalty{curvature + p * rn, center + p * rn, rows + p * sh.r, strength[p]};
      if (row_stats != nullptr) {
        penalty.row_stats = row_stats + p * 2 * sh.r;
        penalty.row_stats_valid = row_stats_valid[p] != 0;
        penalty.next_row_stats = next_row_stats + p * 2 * sh.r;
      }
    }
    PathIntegral si;
    if (w_out != nullptr) si = PathIntegral{w_out + p * rn, si_d + p * sh.num_slots};
    float value = 0.0f;
    step[p] = UpdateOne(out_data + p * rn, x + p * sh.batch * sh.n, d + p * sh.num_slots, neuron + p * sh.num_slots,
                        example + p * sh.num_slots, values_sq[p], sh.r, sh.n, sh.batch, sh.num_slots, learning_rate,
                        clip_norm, penalty, si, &value);
    if (penalty_value != nullptr) penalty_value[p] = value;
  }
  return ffi::Error::Success();
}

ffi::Error UpdateAddressesImpl(ffi::Buffer<ffi::F32> addresses, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> d,
                               ffi::Buffer<ffi::S32> neuron, ffi::Buffer<ffi::S32> example,
                               ffi::Buffer<ffi::F32> values_sq, double learning_rate, double clip_norm,
                               ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> step) {
  UpdateShape shape;
  if (auto error = CheckUpdateShapes(addresses, x, d, neuron, example, values_sq, shape); error.failure()) {
    return error;
  }
  if (static_cast<int64_t>(step->element_count()) != shape.problems) {
    return ffi::Error::InvalidArgument("sdm_sparse_update: step shape");
  }
  return RunUpdates(shape, addresses.typed_data(), out->typed_data(), x.typed_data(), d.typed_data(),
                    neuron.typed_data(), example.typed_data(), values_sq.typed_data(), learning_rate, clip_norm,
                    nullptr, nullptr, nullptr, nullptr, step->typed_data(), nullptr);
}

ffi::Error UpdatePenalizedImpl(ffi::Buffer<ffi::F32> addresses, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> d,
                               ffi::Buffer<ffi::S32> neuron, ffi::Buffer<ffi::S32> example,
                               ffi::Buffer<ffi::F32> values_sq, ffi::Buffer<ffi::F32> curvature,
                               ffi::Buffer<ffi::F32> center, ffi::Buffer<ffi::U8> rows,
                               ffi::Buffer<ffi::F32> strength, ffi::Buffer<ffi::F32> row_stats,
                               ffi::Buffer<ffi::U8> row_stats_valid, double learning_rate, double clip_norm,
                               ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> step,
                               ffi::ResultBuffer<ffi::F32> penalty_value, ffi::ResultBuffer<ffi::F32> next_row_stats) {
  UpdateShape shape;
  if (auto error = CheckUpdateShapes(addresses, x, d, neuron, example, values_sq, shape); error.failure()) {
    return error;
  }
  const int64_t p = shape.problems;
  if (curvature.element_count() != addresses.element_count() || center.element_count() != addresses.element_count() ||
      static_cast<int64_t>(rows.element_count()) != p * shape.r ||
      static_cast<int64_t>(strength.element_count()) != p || static_cast<int64_t>(step->element_count()) != p ||
      static_cast<int64_t>(penalty_value->element_count()) != p ||
      static_cast<int64_t>(row_stats.element_count()) != 2 * p * shape.r ||
      static_cast<int64_t>(next_row_stats->element_count()) != 2 * p * shape.r ||
      static_cast<int64_t>(row_stats_valid.element_count()) != p) {
    return ffi::Error::InvalidArgument("sdm_sparse_update_penalized: penalty operand shapes");
  }
  return RunUpdates(shape, addresses.typed_data(), out->typed_data(), x.typed_data(), d.typed_data(),
                    neuron.typed_data(), example.typed_data(), values_sq.typed_data(), learning_rate, clip_norm,
                    curvature.typed_data(), center.typed_data(), rows.typed_data(), strength.typed_data(),
                    step->typed_data(), penalty_value->typed_data(), row_stats.typed_data(),
                    row_stats_valid.typed_data(), next_row_stats->typed_data());
}

ffi::Error UpdatePathIntegralImpl(ffi::Buffer<ffi::F32> addresses, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> d,
                                  ffi::Buffer<ffi::S32> neuron, ffi::Buffer<ffi::S32> example,
                                  ffi::Buffer<ffi::F32> values_sq, ffi::Buffer<ffi::F32> curvature,
                                  ffi::Buffer<ffi::F32> center, ffi::Buffer<ffi::U8> rows,
                                  ffi::Buffer<ffi::F32> strength, ffi::Buffer<ffi::F32> row_stats,
                                  ffi::Buffer<ffi::U8> row_stats_valid, ffi::Buffer<ffi::F32> w,
                                  ffi::Buffer<ffi::F32> si_d, double learning_rate, double clip_norm,
                                  ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> step,
                                  ffi::ResultBuffer<ffi::F32> penalty_value, ffi::ResultBuffer<ffi::F32> w_out,
                                  ffi::ResultBuffer<ffi::F32> next_row_stats) {
  UpdateShape shape;
  if (auto error = CheckUpdateShapes(addresses, x, d, neuron, example, values_sq, shape); error.failure()) {
    return error;
  }
  const int64_t p = shape.problems;
  if (curvature.element_count() != addresses.element_count() || center.element_count() != addresses.element_count() ||
      w.element_count() != addresses.element_count() || w_out->element_count() != addresses.element_count() ||
      si_d.element_count() != d.element_count() || static_cast<int64_t>(rows.element_count()) != p * shape.r ||
      static_cast<int64_t>(strength.element_count()) != p || static_cast<int64_t>(step->element_count()) != p ||
      static_cast<int64_t>(penalty_value->element_count()) != p ||
      static_cast<int64_t>(row_stats.element_count()) != 2 * p * shape.r ||
      static_cast<int64_t>(next_row_stats->element_count()) != 2 * p * shape.r ||
      static_cast<int64_t>(row_stats_valid.element_count()) != p) {
    return ffi::Error::InvalidArgument("sdm_sparse_update_path_integral: operand shapes");
  }
  return RunUpdates(shape, addresses.typed_data(), out->typed_data(), x.typed_data(), d.typed_data(),
                    neuron.typed_data(), example.typed_data(), values_sq.typed_data(), learning_rate, clip_norm,
                    curvature.typed_data(), center.typed_data(), rows.typed_data(), strength.typed_data(),
                    step->typed_data(), penalty_value->typed_data(), row_stats.typed_data(),
                    row_stats_valid.typed_data(), next_row_stats->typed_data(), si_d.typed_data(), w.typed_data(),
                    w_out->typed_data());
}

// Top-m values (descending) and their indices per example, from neuron-major activations
// a [r, B] (topk.top_values_and_indices(a, m, axis=0)), in two passes over a:
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

// The sparse step's active units (sparse.train_step) as slots: from a [r, B] (neuron-major,
// >= 0) and the GABA lambdas [r], with I_b the (k+1)-th largest a[:, b] (Eq. 4 and the GABA
// switch): every (b, i) with a[i, b] > lambda_i I_b, i.e. a*[b, i] = relu(a - lambda_i I_b) > 0,
// as slots sorted by example (the first `total`, see the top of the file), and total.
// After the switch (every lambda >= 1) only the top k of an example can fire: they come from
// the one selection of the top k + 1. While some lambda < 1, two passes over a (count per
// example, then write at each example's offset) collect every unit that fires, however many.
void ActiveOne(const float* __restrict a, const float* __restrict lam, int64_t r, int64_t batch, int64_t k,
               int64_t num_slots, int32_t* __restrict example, int32_t* __restrict neuron, float* __restrict value,
               int32_t* total, std::vector<float>& top_values, std::vector<int32_t>& top_indices,
               std::vector<float>& table, std::vector<float>& chunk_max, std::vector<int32_t>& count) {
  const int64_t m = k + 1;
  top_values.resize(batch * m);
  top_indices.resize(batch * m);
  TopOne(a, r, batch, m, top_values.data(), top_indices.data(), table, chunk_max, count);
  for (int64_t q = 0; q < num_slots; ++q) {
    example[q] = static_cast<int32_t>(batch);
    neuron[q] = static_cast<int32_t>(r);
    value[q] = 0.0f;
  }
  bool switched = true;
  for (int64_t i = 0; i < r; ++i) switched &= lam[i] >= 1.0f;
  int64_t written = 0;
  if (switched) {
    for (int64_t b = 0; b < batch; ++b) {
      const float* vals = top_values.data() + b * m;
      const int32_t* idx = top_indices.data() + b * m;
      const float threshold = vals[k];
      for (int64_t q = 0; q < k; ++q) {
        const float bar = lam[idx[q]] * threshold;
        if (!(vals[q] > bar)) continue;
        if (written < num_slots) {
          example[written] = static_cast<int32_t>(b);
          neuron[written] = idx[q];
          value[written] = vals[q] - bar;
        }
        ++written;
      }
    }
    *total = static_cast<int32_t>(std::min<int64_t>(written, INT32_MAX));
    return;
  }
  // During the switch: count per example, then each example's slots start at its offset.
  std::vector<float> threshold(batch);
  for (int64_t b = 0; b < batch; ++b) threshold[b] = top_values[b * m + k];
  count.assign(batch, 0);
  int32_t* __restrict cnt = count.data();
  const float* __restrict th = threshold.data();
  for (int64_t i = 0; i < r; ++i) {
    const float* __restrict row = a + i * batch;
    const float li = lam[i];
#pragma omp simd
    for (int64_t b = 0; b < batch; ++b) cnt[b] += row[b] > li * th[b];
  }
  std::vector<int64_t> offset(batch);
  for (int64_t b = 0; b < batch; ++b) {
    offset[b] = written;
    written += cnt[b];
  }
  for (int64_t i = 0; i < r; ++i) {
    const float* __restrict row = a + i * batch;
    const float li = lam[i];
    for (int64_t b = 0; b < batch; ++b) {
      const float bar = li * th[b];
      if (!(row[b] > bar)) continue;
      const int64_t q = offset[b]++;
      if (q < num_slots) {
        example[q] = static_cast<int32_t>(b);
        neuron[q] = static_cast<int32_t>(i);
        value[q] = row[b] - bar;
      }
    }
  }
  *total = static_cast<int32_t>(std::min<int64_t>(written, INT32_MAX));
}

ffi::Error ActiveUnitsImpl(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> lam, int64_t k,
                           ffi::ResultBuffer<ffi::S32> example, ffi::ResultBuffer<ffi::S32> neuron,
                           ffi::ResultBuffer<ffi::F32> value, ffi::ResultBuffer<ffi::S32> total) {
  const auto a_dims = a.dimensions();
  const size_t rank = a_dims.size();
  if (rank < 2 || lam.dimensions().size() != rank - 1 || example->dimensions().size() != rank - 1) {
    return ffi::Error::InvalidArgument("sdm_active_units: a [..., r, B], lambda [..., r] -> slots [..., S]");
  }
  const int64_t r = a_dims[rank - 2], batch = a_dims[rank - 1];
  const int64_t num_slots = example->dimensions()[rank - 2];
  if (lam.dimensions()[rank - 2] != r || k < 0 || k + 1 > r || num_slots < 1) {
    return ffi::Error::InvalidArgument("sdm_active_units: shape mismatch, or k + 1 > r");
  }
  int64_t problems = 1;
  for (size_t i = 0; i + 2 < rank; ++i) problems *= a_dims[i];
  thread_local std::vector<float> table, chunk_max, top_values;
  thread_local std::vector<int32_t> count, top_indices;
  for (int64_t p = 0; p < problems; ++p) {
    ActiveOne(a.typed_data() + p * r * batch, lam.typed_data() + p * r, r, batch, k, num_slots,
              example->typed_data() + p * num_slots, neuron->typed_data() + p * num_slots,
              value->typed_data() + p * num_slots, total->typed_data() + p, top_values, top_indices, table, chunk_max,
              count);
  }
  return ffi::Error::Success();
}

}  // namespace

// Exported (the library is built with -fvisibility=hidden); looked up by ctypes.
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* SdmActiveUnits(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmActiveUnits, ActiveUnitsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // a [..., r, B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // lambda [..., r]
                                  .Attr<int64_t>("k")
                                  .Ret<ffi::Buffer<ffi::S32>>()   // example [..., S]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // neuron [..., S]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // value [..., S]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // total [...]

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* SdmTopValuesAndIndices(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmTopValuesAndIndices, TopValuesAndIndicesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // a [..., r, B]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // values [..., B, m]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // indices [..., B, m]

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* SdmSparseUpdate(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmSparseUpdate, UpdateAddressesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // addresses [..., r, n]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., B, n]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // d [..., S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // neuron [..., S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // example [..., S]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // values_sq [...]
                                  .Attr<double>("learning_rate")
                                  .Attr<double>("clip_norm")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // new addresses
                                  .Ret<ffi::Buffer<ffi::F32>>());  // step size [...]

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* SdmSparseUpdatePenalized(
    XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmSparseUpdatePenalized, UpdatePenalizedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // addresses [..., r, n]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., B, n]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // d [..., S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // neuron [..., S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // example [..., S]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // values_sq [...]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // curvature A [..., r, n]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // center m [..., r, n]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // penalty rows [..., r]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // strength [...]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // row stats [..., 2, r]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // row stats valid [...]
                                  .Attr<double>("learning_rate")
                                  .Attr<double>("clip_norm")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // new addresses
                                  .Ret<ffi::Buffer<ffi::F32>>()  // step size [...]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // penalty value [...]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // row stats at the new addresses [..., 2, r]

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* SdmSparseUpdatePathIntegral(
    XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmSparseUpdatePathIntegral, UpdatePathIntegralImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // addresses [..., r, n]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., B, n]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // d [..., S] (the optimiser's)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // neuron [..., S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // example [..., S]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // values_sq [...]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // curvature A [..., r, n]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // center m [..., r, n]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // penalty rows [..., r]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // strength [...]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // row stats [..., 2, r]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // row stats valid [...]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // SI's w [..., r, n]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // SI's d [..., S] (the path integral's gradient)
                                  .Attr<double>("learning_rate")
                                  .Attr<double>("clip_norm")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // new addresses
                                  .Ret<ffi::Buffer<ffi::F32>>()  // step size [...]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // penalty value [...]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // new w
                                  .Ret<ffi::Buffer<ffi::F32>>());  // row stats at the new addresses [..., 2, r]

// -------------------------------------------------------------------------------------------------
// SdmDenseUpdate: the DENSE SGD step's address update (sdm_jax/engine/cpu/fused_dense.py), fused.
//   addresses X [..., n, r] f32, input-major (Flax's [in, out] kernel: a neuron's address is a
//     COLUMN; aliased to the first result, updated in place)
//   gradient G [..., n, r] f32 (dL/dX, the weight-gradient matmul's output, penalty included)
//   values_sq [...] f32 (the squared norm of the rest of the gradient: the output layer's)
//   attributes learning_rate, clip_norm (f64; clip_norm <= 0: no clipping)
// step = optax clip_by_global_norm then sgd over ||g|| = sqrt(sum G^2 + values_sq)
// (sparse._clipped_step_size), then every column j: v = max(X[:, j] - step G[:, j], 0),
// X[:, j] = v / ||v|| (topk.l2_normalize: an all-zero column stays zero); models.project_params.
// XLA:CPU makes ~13 passes over the [n, r] matrices for clip -> sgd -> projection; this makes 3
// from memory: one read of G for the norm (skipped without a clip), then, tile by tile of
// kDenseTile columns x all n rows, one read of X and G and one write of X. The tile's first sweep
// writes v to the output and sums each column's squares; the second rescales the tile, which it
// finds in cache (784 x 256 x 4 B = 784 KB: L2, else L3), not in memory. Column tiles read and
// write 1 KB of each row: with 4 KB pages each row of a tile is a page of its own, and narrower
// tiles (32 columns, 128 B per row, a scratch tile of 100 KB held in L2) took 1.5x as long
// (7.3 ms against 4.7 ms at r = 10,000, one core of the AVX-512 VM). Unlike the kernels above it
// splits its work over the cores the process may run on (`DenseThreads`): the column tiles, and the
// chunks of the norm's sum. Every column's arithmetic and every chunk's partial sum are the same
// whichever thread computes them, and the partials are added in chunk order, so the result is bit
// for bit the single-threaded one.
namespace {

constexpr int64_t kDenseTile = 256;  // columns per tile: 1 KB of each row

constexpr int64_t kSquaresChunk = 4096;

// The threads the dense update runs on: the CPUs this process may use (its affinity mask, so that
// `taskset -c 1` means one), at most one per `min_work` units and at most 8;
// $SDM_JAX_DENSE_THREADS overrides (1: the calling thread alone). Starting a thread costs tens of
// microseconds, so a part must be large: 8 tiles (the 1K layer's 3 tiles stay on one thread, where
// two were slower), 512 chunks of the norm's sum (8 MB).
int DenseThreads(int64_t work, int64_t min_work) {
  static const int available = [] {
    if (const char* env = std::getenv("SDM_JAX_DENSE_THREADS")) return std::max(1, std::atoi(env));
    cpu_set_t set;
    return sched_getaffinity(0, sizeof(set), &set) == 0 ? std::max(1, CPU_COUNT(&set)) : 1;
  }();
  return static_cast<int>(std::clamp<int64_t>(work / std::max<int64_t>(min_work, 1), 1, std::min(available, 8)));
}

// Runs body(begin, end) over [0, count) in `threads` contiguous parts, the first on the calling thread.
template <typename Body>
void InParts(int64_t count, int threads, const Body& body) {
  if (threads <= 1) {
    body(int64_t{0}, count);
    return;
  }
  std::vector<std::thread> workers;
  const int64_t part = (count + threads - 1) / threads;
  for (int t = 1; t < threads; ++t) {
    const int64_t begin = std::min(count, t * part), end = std::min(count, begin + part);
    if (begin < end) workers.emplace_back([&body, begin, end] { body(begin, end); });
  }
  body(int64_t{0}, std::min(count, part));
  for (auto& worker : workers) worker.join();
}

// The lanes of ChunkSquares: the vector width g++ gave the `omp simd` reduction it replaces, so that
// the sum is the same, bit for bit, as before: 16 floats with AVX-512 on AMD Zen 4, 8 with AVX2
// (both tested against the old loop), 4 for 128-bit vectors (SSE, NEON; not tested). Where g++ had
// chosen another width (Intel AVX-512 tunings prefer 256-bit vectors) the sum moves by rounding.
#if defined(__AVX512F__)
constexpr int64_t kSquaresLanes = 16;
#elif defined(__AVX__)
constexpr int64_t kSquaresLanes = 8;
#else
constexpr int64_t kSquaresLanes = 4;
#endif

// sum of g^2 over `length` contiguous floats in float: lane k accumulates g[j]^2 (fused multiply-add)
// over j = k mod kSquaresLanes in order, the last length mod kSquaresLanes floats go to lane 0, and
// the lanes are added in order. That is the order g++ 12's `omp simd reduction` had, written out in a
// function of its own: inside the threads' lambda, which captured `g` by reference, g++ gathered
// every float and kept the lanes on the stack, several times slower than a stream (benchmarks/README.md).
float ChunkSquares(const float* __restrict g, int64_t length) {
  float lanes[kSquaresLanes] = {};
  const int64_t body = length - length % kSquaresLanes;
  for (int64_t j = 0; j < body; j += kSquaresLanes) {
#pragma omp simd
    for (int64_t k = 0; k < kSquaresLanes; ++k) lanes[k] = std::fma(g[j + k], g[j + k], lanes[k]);
  }
  for (int64_t j = body; j < length; ++j) lanes[0] = std::fma(g[j], g[j], lanes[0]);
  float sq = 0.0f;
  for (int64_t k = 0; k < kSquaresLanes; ++k) sq += lanes[k];
  return sq;
}

// sum of G^2 over `count` contiguous floats: a float partial sum per chunk (ChunkSquares; the
// chunks in parallel), the chunks added in order in double.
double SumOfSquares(const float* __restrict g, int64_t count) {
  const int64_t chunks = (count + kSquaresChunk - 1) / kSquaresChunk;
  std::vector<float> partial(chunks);
  float* const out = partial.data();
  InParts(chunks, DenseThreads(chunks, 512), [g, out, count](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const int64_t start = c * kSquaresChunk;
      out[c] = ChunkSquares(g + start, std::min(count, start + kSquaresChunk) - start);
    }
  });
  double total = 0.0;
  for (const float sq : partial) total += sq;
  return total;
}

// One tile of W columns [j0, j0 + W) of a [n, r] problem: out = v = max(x - step g, 0) and the
// columns' sums of squares (one sweep), then out = v / norm (norm 0: v stays 0). `out` may be `x`
// (aliased): no __restrict on either. W is a compile-time width (the accumulators stay in
// registers); W = 0 is the runtime width `w` < 16 of the last columns.
template <int64_t W>
void DenseTile(const float* x, const float* __restrict g, float* out, int64_t n, int64_t r, int64_t j0, float step,
               int64_t w = W) {
  constexpr int64_t kWidth = W > 0 ? W : 16;
  const int64_t width = W > 0 ? W : w;
  float sq[kWidth], norm[kWidth];
  for (int64_t t = 0; t < width; ++t) sq[t] = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float* xr = x + i * r + j0;
    const float* __restrict gr = g + i * r + j0;
    float* vr = out + i * r + j0;
#pragma omp simd
    for (int64_t t = 0; t < width; ++t) {
      const float value = std::max(xr[t] - step * gr[t], 0.0f);
      vr[t] = value;
      sq[t] += value * value;
    }
  }
  for (int64_t t = 0; t < width; ++t) {
    const float root = std::sqrt(sq[t]);
    norm[t] = root > 0.0f ? root : 1.0f;  // topk.l2_normalize: x / where(norm > 0, norm, 1)
  }
  for (int64_t i = 0; i < n; ++i) {
    float* vr = out + i * r + j0;
#pragma omp simd
    for (int64_t t = 0; t < width; ++t) vr[t] = vr[t] / norm[t];
  }
}

// One problem: reads x and g, writes out (which may be x itself); returns the step.
float DenseUpdateOne(const float* x, const float* __restrict g, float* out, float values_sq, int64_t n, int64_t r,
                     double learning_rate, double clip_norm) {
  // optax.clip_by_global_norm then sgd (sparse._clipped_step_size), as UpdateOne above.
  float step = static_cast<float>(learning_rate);
  if (clip_norm > 0.0) {
    const float norm = std::sqrt(static_cast<float>(SumOfSquares(g, n * r)) + values_sq);
    if (!(norm < static_cast<float>(clip_norm))) {
      step = static_cast<float>(learning_rate * clip_norm) / std::max(norm, 1e-38f);
    }
  }
  // The full tiles, split over the threads; then the last r mod 256 columns on this thread.
  const int64_t full_tiles = r / kDenseTile;
  InParts(full_tiles, DenseThreads(full_tiles, 8), [&](int64_t first, int64_t last) {
    for (int64_t tile = first; tile < last; ++tile) DenseTile<kDenseTile>(x, g, out, n, r, tile * kDenseTile, step);
  });
  int64_t j0 = full_tiles * kDenseTile;
  // The last r mod 256 columns: tiles of 128, 64, 32 and 16 as they fit, then fewer than 16.
  if (j0 + 128 <= r) {
    DenseTile<128>(x, g, out, n, r, j0, step);
    j0 += 128;
  }
  if (j0 + 64 <= r) {
    DenseTile<64>(x, g, out, n, r, j0, step);
    j0 += 64;
  }
  if (j0 + 32 <= r) {
    DenseTile<32>(x, g, out, n, r, j0, step);
    j0 += 32;
  }
  if (j0 + 16 <= r) {
    DenseTile<16>(x, g, out, n, r, j0, step);
    j0 += 16;
  }
  if (j0 < r) DenseTile<0>(x, g, out, n, r, j0, step, r - j0);
  return step;
}

ffi::Error DenseUpdateImpl(ffi::Buffer<ffi::F32> addresses, ffi::Buffer<ffi::F32> gradient,
                           ffi::Buffer<ffi::F32> values_sq, double learning_rate, double clip_norm,
                           ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> step) {
  const auto dims = addresses.dimensions();
  const size_t rank = dims.size();
  if (rank < 2 || gradient.dimensions().size() != rank) {
    return ffi::Error::InvalidArgument("sdm_dense_update: addresses and gradient [..., n, r]");
  }
  for (size_t i = 0; i < rank; ++i) {
    if (gradient.dimensions()[i] != dims[i]) {
      return ffi::Error::InvalidArgument("sdm_dense_update: the gradient's shape differs from the addresses'");
    }
  }
  const int64_t n = dims[rank - 2], r = dims[rank - 1];
  int64_t problems = 1;
  for (size_t i = 0; i + 2 < rank; ++i) problems *= dims[i];
  if (static_cast<int64_t>(values_sq.element_count()) != problems ||
      static_cast<int64_t>(step->element_count()) != problems || out->element_count() != addresses.element_count()) {
    return ffi::Error::InvalidArgument("sdm_dense_update: values_sq and step [...] (the leading dimensions)");
  }
  // Not aliased: the tiles read `addresses` and write `out` directly (no copy first).
  for (int64_t p = 0; p < problems; ++p) {
    const int64_t offset = p * n * r;
    step->typed_data()[p] = DenseUpdateOne(addresses.typed_data() + offset, gradient.typed_data() + offset,
                                           out->typed_data() + offset, values_sq.typed_data()[p], n, r, learning_rate,
                                           clip_norm);
  }
  return ffi::Error::Success();
}

}  // namespace

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* SdmDenseUpdate(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmDenseUpdate, DenseUpdateImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // addresses X [..., n, r]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gradient G [..., n, r]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // values_sq [...]
                                  .Attr<double>("learning_rate")
                                  .Attr<double>("clip_norm")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // new addresses
                                  .Ret<ffi::Buffer<ffi::F32>>());  // step size [...]

// SdmCacheRows and SdmCacheWrite: the forward cache's row traffic (sdm_jax/engine/cpu/forward_cache.py).
//   rows [..., N, r] f32: each training example's cached activations, example-major
//   index [..., B] s32: each batch column's row in `rows`; N or more (padding): none
// CacheRows:  out [..., r, B], out[i, b] = rows[index[b], i], 0 where index[b] >= N: the batch's
//   cached activations, neuron-major as the sparse step takes them.
// CacheWrite: rows[index[b], :] = a[:, b] for every b with index[b] < N; `rows` is aliased to the
//   result and updated in place (indices are distinct, as a batch of a permutation is).
// XLA:CPU gathers the rows, then transposes them in a second pass (and the reverse, plus a scatter
// with its own copy, to write them back); these move each float once, in tiles of 16 examples x 16
// neurons (a 64 B line of each of 16 rows: 16 sequential streams, and each line of the [r, B]
// side written or read whole). Pure data movement: the same bits as the XLA code.
namespace {

constexpr int64_t kCacheTile = 16;

// The 16 x 16 transpose of a tile: out[i][b] = in[b][i] (fixed sizes, for the compiler to vectorise).
inline void Transpose16(const float (&in)[kCacheTile][kCacheTile], float (&out)[kCacheTile][kCacheTile]) {
  for (int64_t i = 0; i < kCacheTile; ++i) {
#pragma omp simd
    for (int64_t b = 0; b < kCacheTile; ++b) out[i][b] = in[b][i];
  }
}

#if defined(__AVX512F__)
// The same on 16 registers in place (32-bit, 64-bit, then two 128-bit-lane interleaves): 64 shuffles.
inline void Transpose16Registers(__m512 r[16]) {
  __m512 t[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {
    __m512d a = _mm512_castps_pd(t[4 * k]), b = _mm512_castps_pd(t[4 * k + 1]);
    __m512d c = _mm512_castps_pd(t[4 * k + 2]), d = _mm512_castps_pd(t[4 * k + 3]);
    r[4 * k + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
    t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
    t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
    r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xdd);
  }
}
#endif

// One full tile: the 16 x 16 floats at from[k] + offset (k = 0..15) to to[j] + offset2 (j = 0..15),
// transposed: to[j][offset2 + k] = from[k][offset + j].
inline void MoveTile(float* const from[kCacheTile], int64_t offset, float* const to[kCacheTile], int64_t offset2) {
#if defined(__AVX512F__)
  __m512 v[kCacheTile];
  for (int64_t k = 0; k < kCacheTile; ++k) v[k] = _mm512_loadu_ps(from[k] + offset);
  Transpose16Registers(v);
  for (int64_t j = 0; j < kCacheTile; ++j) _mm512_storeu_ps(to[j] + offset2, v[j]);
#else
  alignas(64) float in[kCacheTile][kCacheTile], out[kCacheTile][kCacheTile];
  for (int64_t k = 0; k < kCacheTile; ++k) std::memcpy(in[k], from[k] + offset, sizeof(in[k]));
  Transpose16(in, out);
  for (int64_t j = 0; j < kCacheTile; ++j) std::memcpy(to[j] + offset2, out[j], sizeof(out[j]));
#endif
}

// rows -> out [r, B] (to_neuron_major) or a [r, B] -> rows (!to_neuron_major), tile by tile of 16
// batch columns x 16 neurons; padding columns (index >= N) read as 0 and are not written. A full
// tile of 16 real rows goes through fixed-size loops (vector loads, a register transpose, vector
// stores); the rest element by element.
template <bool kToNeuronMajor>
void CacheMove(float* rows, float* nm, const int32_t* index, int64_t N, int64_t r, int64_t B) {
  for (int64_t b0 = 0; b0 < B; b0 += kCacheTile) {
    const int64_t nb = std::min(kCacheTile, B - b0);
    float* starts[kCacheTile];
    bool full = nb == kCacheTile;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t e = index[b0 + b];
      starts[b] = e >= 0 && e < N ? rows + e * r : nullptr;
      full = full && starts[b] != nullptr;
    }
    int64_t i0 = 0;
    if (full) {
      float* nm_rows[kCacheTile];
      for (; i0 + kCacheTile <= r; i0 += kCacheTile) {
        for (int64_t i = 0; i < kCacheTile; ++i) nm_rows[i] = nm + (i0 + i) * B;
        if (kToNeuronMajor) {
          MoveTile(starts, i0, nm_rows, b0);
        } else {
          MoveTile(nm_rows, b0, starts, i0);
        }
      }
    }
    for (; i0 < r; ++i0) {  // what no full tile covered: one neuron at a time
      for (int64_t b = 0; b < nb; ++b) {
        float* row = starts[b];
        if (kToNeuronMajor) {
          nm[i0 * B + b0 + b] = row != nullptr ? row[i0] : 0.0f;
        } else if (row != nullptr) {
          row[i0] = nm[i0 * B + b0 + b];
        }
      }
    }
  }
}

ffi::Error CacheRowsImpl(ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::S32> index, ffi::ResultBuffer<ffi::F32> out) {
  const auto dims = rows.dimensions();
  const size_t rank = dims.size();
  if (rank < 2 || index.dimensions().size() != rank - 1) {
    return ffi::Error::InvalidArgument("sdm_cache_rows: rows [..., N, r] and index [..., B]");
  }
  const int64_t N = dims[rank - 2], r = dims[rank - 1], B = index.dimensions()[rank - 2];
  const int64_t problems = N * r == 0 ? 0 : static_cast<int64_t>(rows.element_count()) / (N * r);
  if (static_cast<int64_t>(index.element_count()) != problems * B ||
      static_cast<int64_t>(out->element_count()) != problems * r * B) {
    return ffi::Error::InvalidArgument("sdm_cache_rows: the leading dimensions differ");
  }
  for (int64_t p = 0; p < problems; ++p) {
    const float* src = rows.typed_data() + p * N * r;
    float* dst = out->typed_data() + p * r * B;
    CacheMove<true>(const_cast<float*>(src), dst, index.typed_data() + p * B, N, r, B);
  }
  return ffi::Error::Success();
}

ffi::Error CacheWriteImpl(ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::S32> index,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto dims = rows.dimensions();
  const size_t rank = dims.size();
  if (rank < 2 || a.dimensions().size() != rank || index.dimensions().size() != rank - 1) {
    return ffi::Error::InvalidArgument("sdm_cache_write: rows [..., N, r], a [..., r, B] and index [..., B]");
  }
  const int64_t N = dims[rank - 2], r = dims[rank - 1], B = index.dimensions()[rank - 2];
  const int64_t problems = N * r == 0 ? 0 : static_cast<int64_t>(rows.element_count()) / (N * r);
  if (a.dimensions()[rank - 2] != r || a.dimensions()[rank - 1] != B ||
      static_cast<int64_t>(a.element_count()) != problems * r * B ||
      static_cast<int64_t>(index.element_count()) != problems * B) {
    return ffi::Error::InvalidArgument("sdm_cache_write: a is not [..., r, B] for rows [..., N, r] and index [..., B]");
  }
  for (int64_t p = 0; p < problems; ++p) {
    const float* src = a.typed_data() + p * r * B;
    float* dst = out->typed_data() + p * N * r;
    if (dst != rows.typed_data() + p * N * r) {  // not aliased (XLA could not donate): start from a copy
      std::copy(rows.typed_data() + p * N * r, rows.typed_data() + (p + 1) * N * r, dst);
    }
    CacheMove<false>(dst, const_cast<float*>(src), index.typed_data() + p * B, N, r, B);
  }
  return ffi::Error::Success();
}

}  // namespace

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* SdmCacheRows(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmCacheRows, CacheRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // rows [..., N, r]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // index [..., B]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [..., r, B]

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* SdmCacheWrite(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmCacheWrite, CacheWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // rows [..., N, r]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // a [..., r, B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // index [..., B]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // rows, updated
