// int8 linear for the CPU drafts and an int8 main model: y = dequant(quant(x) . W^T) + b, for a few rows
// of x at a time (`qlinear_rows`) or many (`qlinear_many`, AVX-512), or around oneDNN's int8 matmul
// (`quantize_activations`, `rescale`), every way the same bits for a row; the layers of an int8 self-draft
// in one call per draft step (draft_stack.inc); the decoders' batch-invariant attention (`attention`,
// attention.inc); and fp32 products over fp16 weights for an fp32 decoder (`half_linear`, half_linear.inc).
//
// W is quantized per output row (symmetric int8, scale[n]) and packed as [ceil(N/16)][K/4][16][4]: one
// 64-byte block holds four consecutive inputs of 16 output rows, so the products need no horizontal
// sums. Each row of x is quantized to uint8 over its own range [min, max] (widened to hold 0, as torch
// does); its zero point is taken out again with the row sums of W.
//
// Two instruction sets run the same packing and compute the same integer dot products: AVX-512 VNNI
// (`vpdpbusd`, simd_avx512.h) and AVX2 (`vpmaddwd` on int16, simd_avx2.h). Each is compiled for its
// own target below, whatever CPU builds the library, and the best one this CPU runs is picked at load
// time (`isa()`). For one or a few rows this runs 2-5x faster than torch's dynamic int8 linear
// (fbgemm), whose fixed cost per call dominates the small products of a draft step
// (docs/history/performance-log.md).

// ATen's tensor, the two factory ops used and torch's pybind11 casters, not <torch/extension.h>: the C++
// front end it pulls in tripled the compile time (70 s against 31 s on a 2-core machine).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

constexpr int64_t kRows = 16;  // output rows per packed block
constexpr int64_t kDepth = 4;  // inputs per row in one block vector

// w [N, K] fp32 -> (packed [ceil(N/16), K/4, 16, 4] int8, scale [N], row sum [N] int32): each row
// quantized symmetrically by its largest magnitude, straight into the packed layout (rows past N are
// zero), without fp32 temporaries.
std::vector<at::Tensor> quantize(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "quantize: expected an fp32 [N, K] weight");
  auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k % kDepth == 0, "quantize: the input size must be a multiple of 4");
  const int64_t blocks = (n + kRows - 1) / kRows, depth = k / kDepth;
  auto packed = at::zeros({blocks, depth, kRows, kDepth}, at::kChar);
  auto scale = at::empty({n}, at::kFloat);
  auto row_sum = at::empty({n}, at::kInt);
  const float* wp = w.data_ptr<float>();
  int8_t* pp = packed.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  int32_t* rp = row_sum.data_ptr<int32_t>();
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = wp + r * k;
      float amax = 0.f;
      for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(row[i]));
      const float s = std::max(amax, 1e-12f) / 127.f;
      sp[r] = s;
      int32_t sum = 0;
      int8_t* base = pp + (r / kRows) * depth * kRows * kDepth + (r % kRows) * kDepth;
      for (int64_t i = 0; i < k; ++i) {
        const int32_t q = std::clamp(static_cast<int32_t>(std::nearbyint(row[i] / s)), -127, 127);
        base[(i / kDepth) * kRows * kDepth + i % kDepth] = static_cast<int8_t>(q);
        sum += q;
      }
      rp[r] = sum;
    }
  });
  return {packed, scale, row_sum};
}

// One packed int8 weight: [ceil(N/16), K/4, 16, 4] with per-row scales, row sums and an optional bias.
struct Packed {
  const int8_t* weight;
  const float* scale;
  const int32_t* row_sum;
  const float* bias;
  int64_t n, k;
};

Packed unpack(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& row_sum,
              const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.is_contiguous(),
              "int8 linear: expected a packed int8 weight");
  const bool has_bias = bias.has_value() && bias->defined() && bias->numel() > 0;  // empty: no bias
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  return {packed.data_ptr<int8_t>(), scale.data_ptr<float>(), row_sum.data_ptr<int32_t>(), bp, scale.size(0),
          packed.size(1) * kDepth};
}

// x [m, k] fp32 -> uint8 row by row over the row's range (post-GELU inputs are mostly positive: a
// symmetric range would waste half of the 256 levels), with each row's scale and zero point.
struct QuantizedRows {
  std::vector<uint8_t> values;
  std::vector<float> scale, zero;
};

// The SIMD code, once per instruction set. Only what is defined between push and pop is compiled for
// that target, so the library loads on any x86-64 CPU and runs what `isa()` finds there.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#include "simd_avx2.h"
#include "attention.inc"
#include "half_linear.inc"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
namespace avx512 {
#include "simd_avx512.h"
#include "attention.inc"
#include "half_linear.inc"
}  // namespace avx512
#pragma GCC pop_options

bool cpu_has_avx512_vnni() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
}

bool cpu_has_avx2_fma() {  // F16C: every AVX2 CPU has it (Intel since Ivy Bridge, AMD since Piledriver)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

// What each instruction set implements: the int8 products, attention and the fp16-weight products.
struct Ops {
  const char* name;
  bool (*runs_here)();
  void (*quantize_row)(const float*, int64_t, uint8_t*, float*, float*);
  void (*qlinear_rows)(const uint8_t*, const float*, const float*, int64_t, const Packed&, float*);
  void (*qlinear_many)(const uint8_t*, const float*, const float*, int64_t, const Packed&, float*);
  void (*rescale_rows)(const int32_t*, int64_t, const float*, const float*, const Packed&, float*);
  void (*attend)(const float*, const at::Tensor&, const at::Tensor&, int64_t, int64_t, float*);
  void (*attend_rows)(const float*, const at::Tensor&, const at::Tensor&, const int64_t*, int64_t, int64_t, float*);
  void (*half_linear_rows)(const float*, int64_t, int64_t, const uint16_t*, const float*, int64_t, float*);
};

constexpr Ops kAvx512{"avx512_vnni",        cpu_has_avx512_vnni, avx512::quantize_row, avx512::qlinear_rows,
                       avx512::qlinear_many, avx512::rescale_rows, avx512::attend, avx512::attend_rows,
                       avx512::half_linear_rows};
// AVX2 runs many rows as it runs a few (no tiled path of its own yet)
constexpr Ops kAvx2{"avx2",          cpu_has_avx2_fma, avx2::quantize_row, avx2::qlinear_rows,
                    avx2::qlinear_rows, avx2::rescale_rows, avx2::attend, avx2::attend_rows,
                    avx2::half_linear_rows};
constexpr std::array<const Ops*, 2> kWidestFirst{&kAvx512, &kAvx2};

const Ops* best() {
  __builtin_cpu_init();  // best() runs from a static initializer, maybe before libgcc's own
  for (const Ops* ops : kWidestFirst)
    if (ops->runs_here()) return ops;
  return nullptr;
}

const Ops* g_ops = best();  // what new products and draft stacks use

const Ops& ops() {
  TORCH_CHECK(g_ops != nullptr, "kernel library: this CPU has neither AVX2 + FMA nor AVX-512 VNNI");
  return *g_ops;
}

std::string isa() { return g_ops ? g_ops->name : ""; }

// Use the instruction set `name` ("avx512_vnni" or "avx2") from now on: for tests and for measuring
// one against the other. Draft stacks built before keep theirs.
std::string use_isa(const std::string& name) {
  for (const Ops* candidate : kWidestFirst) {
    if (name == candidate->name) {
      TORCH_CHECK(candidate->runs_here(), "int8 linear: this CPU does not run ", name);
      g_ops = candidate;
      return isa();
    }
  }
  TORCH_CHECK(false, "int8 linear: unknown instruction set ", name);
  return "";
}

// Rows from which a product takes the tiled path (`qlinear_many`): it gives each row the bits the row path
// gives it, so the choice is only one of speed.
constexpr int64_t kManyRows = 16;

QuantizedRows quantize_rows(const Ops& with, const float* x, int64_t m, int64_t k) {
  QuantizedRows out{std::vector<uint8_t>(static_cast<size_t>(m * k)), std::vector<float>(static_cast<size_t>(m)),
                    std::vector<float>(static_cast<size_t>(m))};
  at::parallel_for(0, m, std::max<int64_t>(1, 32768 / k), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      with.quantize_row(x + r * k, k, out.values.data() + r * k, &out.scale[r], &out.zero[r]);
  });
  return out;
}

void qlinear(const Ops& with, const float* x, int64_t m, const Packed& w, float* y) {
  const QuantizedRows xq = quantize_rows(with, x, m, w.k);
  const auto product = m >= kManyRows ? with.qlinear_many : with.qlinear_rows;
  product(xq.values.data(), xq.scale.data(), xq.zero.data(), m, w, y);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                  const at::Tensor& row_sum, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int8 linear: expected fp32 input");
  const Packed w = unpack(packed, scale, row_sum, bias);
  TORCH_CHECK(x.size(-1) == w.k, "int8 linear: the input does not match the packed weight");
  auto rows = x.reshape({-1, w.k}).contiguous();
  std::vector<int64_t> out_shape = x.sizes().vec();
  out_shape.back() = w.n;
  auto y = at::empty({rows.size(0), w.n}, x.options());
  if (rows.size(0) > 0) qlinear(ops(), rows.data_ptr<float>(), rows.size(0), w, y.data_ptr<float>());
  return y.view(out_shape);
}

// x [..., k] fp32 -> (int8 [rows, k], scale [rows], zero [rows]): each row quantized to uint8 over its own
// range as `linear` does, less 128 so that the values fit int8 (for oneDNN's int8 matmul, `torch._int_mm`).
std::vector<at::Tensor> quantize_activations(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "quantize_activations: expected fp32 input");
  const int64_t k = x.size(-1);
  auto rows = x.reshape({-1, k}).contiguous();
  const int64_t m = rows.size(0);
  QuantizedRows q = quantize_rows(ops(), rows.data_ptr<float>(), m, k);
  auto values = at::empty({m, k}, at::kChar);
  auto scale = at::empty({m}, at::kFloat), zero = at::empty({m}, at::kFloat);
  int8_t* vp = values.data_ptr<int8_t>();
  at::parallel_for(0, m * k, 65536, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) vp[i] = static_cast<int8_t>(static_cast<int32_t>(q.values[i]) - 128);
  });
  std::copy(q.scale.begin(), q.scale.end(), scale.data_ptr<float>());
  std::copy(q.zero.begin(), q.zero.end(), zero.data_ptr<float>());
  return {values, scale, zero};
}

// acc [rows, n] int32 (the int8 activations of `quantize_activations` times the int8 weights) -> fp32
// [rows, n], rescaled and biased as `linear` does its own integer products: the same bits.
at::Tensor rescale(const at::Tensor& acc, const at::Tensor& x_scale, const at::Tensor& x_zero, const at::Tensor& scale,
                   const at::Tensor& row_sum, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(acc.scalar_type() == at::kInt && acc.dim() == 2, "rescale: expected int32 [rows, n]");
  const int64_t m = acc.size(0), n = acc.size(1);
  TORCH_CHECK(scale.numel() == n && row_sum.numel() == n && x_scale.numel() == m && x_zero.numel() == m,
              "rescale: scales do not match the products");
  const bool has_bias = bias.has_value() && bias->defined() && bias->numel() > 0;
  const Packed w{nullptr, scale.data_ptr<float>(), row_sum.data_ptr<int32_t>(),
                 has_bias ? bias->data_ptr<float>() : nullptr, n, 0};
  auto a = acc.contiguous();
  auto y = at::empty({m, n}, at::kFloat);
  if (m > 0)
    ops().rescale_rows(a.data_ptr<int32_t>(), m, x_scale.contiguous().data_ptr<float>(),
                       x_zero.contiguous().data_ptr<float>(), w, y.data_ptr<float>());
  return y;
}

// x [..., k] fp32 times an fp16 weight [ceil(n/16), k, 16] (half_linear.inc), plus an fp32 bias [n] if given ->
// [..., n] fp32: each output one chain of FMAs over the inputs in order, so a row gets the same bits whatever
// else the call holds.
at::Tensor half_linear(const at::Tensor& x, const at::Tensor& weight, int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.is_cpu() && weight.is_cpu(), "half_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "half_linear: expected fp32 input");
  TORCH_CHECK(weight.scalar_type() == at::kHalf && weight.dim() == 3 && weight.size(2) == 16 && weight.is_contiguous(),
              "half_linear: expected a contiguous fp16 weight [ceil(n/16), k, 16]");
  const int64_t k = weight.size(1);
  TORCH_CHECK(x.size(-1) == k, "half_linear: the input does not match the weight");
  TORCH_CHECK(n > 0 && (n + 15) / 16 == weight.size(0), "half_linear: n does not match the weight");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous()),
              "half_linear: the bias must be fp32 [n], contiguous");
  auto rows = x.reshape({-1, k}).contiguous();
  std::vector<int64_t> out_shape = x.sizes().vec();
  out_shape.back() = n;
  auto y = at::empty({rows.size(0), n}, x.options());
  if (rows.size(0) > 0)
    ops().half_linear_rows(rows.data_ptr<float>(), rows.size(0), k,
                           reinterpret_cast<const uint16_t*>(weight.data_ptr<at::Half>()),
                           has_bias ? bias->data_ptr<float>() : nullptr, n, y.data_ptr<float>());
  return y.view(out_shape);
}

void layer_norm(const float* x, const float* w, const float* b, int64_t d, float eps, float* y) {
  float mean = 0.f, var = 0.f;
  for (int64_t i = 0; i < d; ++i) mean += x[i];
  mean /= static_cast<float>(d);
  for (int64_t i = 0; i < d; ++i) var += (x[i] - mean) * (x[i] - mean);
  const float inv = 1.f / std::sqrt(var / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) y[i] = (x[i] - mean) * inv * w[i] + b[i];
}

// What both attention entries need of their keys/values: one type, fp32 or bfloat16, Dh contiguous.
void check_keys_values(const at::Tensor& keys, const at::Tensor& values) {
  TORCH_CHECK(keys.scalar_type() == values.scalar_type(), "attention: keys and values of one type");
  TORCH_CHECK(keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16,
              "attention: fp32 or bfloat16 keys/values");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "attention: head dimension must be contiguous");
}

void attend(const Ops& with, const float* q, const at::Tensor& keys, const at::Tensor& values, int64_t len,
            int64_t heads, float* out) {
  check_keys_values(keys, values);
  with.attend(q, keys, values, len, heads, out);
}

// Attention whose every query gets the same bits whatever else the call holds (see `attend_rows_as`):
// q [B, S, H * Dh] fp32, keys/values [B, H, T, Dh] fp32 or bfloat16 (Dh contiguous), lengths [B, S]
// int64 (the keys each query attends, 1..T) -> [B, S, H * Dh] fp32.
at::Tensor attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& lengths) {
  TORCH_CHECK(q.is_cpu() && keys.is_cpu() && values.is_cpu() && lengths.is_cpu(), "attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "attention: q must be fp32 [B, S, D]");
  TORCH_CHECK(keys.dim() == 4 && values.dim() == 4 && keys.sizes() == values.sizes(),
              "attention: keys and values must be [B, H, T, Dh] alike");
  check_keys_values(keys, values);
  const int64_t rows = q.size(0), steps = q.size(1);
  TORCH_CHECK(keys.size(0) == rows && keys.size(1) * keys.size(3) == q.size(2), "attention: q does not match keys");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.dim() == 2 && lengths.size(0) == rows &&
                  lengths.size(1) == steps, "attention: lengths must be int64 [B, S]");
  auto lens = lengths.contiguous();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows * steps; ++i)
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= keys.size(2), "attention: each length must be within 1..T");
  auto qc = q.contiguous();
  auto out = at::empty({rows, steps, q.size(2)}, q.options());
  if (rows * steps > 0) ops().attend_rows(qc.data_ptr<float>(), keys, values, lp, rows, steps, out.data_ptr<float>());
  return out;
}

#include "draft_stack.inc"
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", []() { return best() != nullptr; }, "True when this CPU runs the kernel (AVX2 + FMA at least)");
  m.def("isa", &isa, "the instruction set in use: 'avx512_vnni', 'avx2', or '' where neither runs");
  m.def("use_isa", &use_isa, "use the given instruction set from now on (it must run on this CPU)");
  m.def("quantize", &quantize, "fp32 [N, K] weight -> (packed int8 blocks, row scales, row sums)");
  m.def("linear", &linear, "y = dequant(quant(x) W^T) + b for a packed int8 W");
  m.def("quantize_activations", &quantize_activations, "fp32 rows -> (int8 rows less 128, row scales, zero points)");
  m.def("rescale", &rescale, "int32 products of quantize_activations' rows -> fp32, as `linear` gives them");
  m.def("half_linear", &half_linear, "x . W^T + b for an fp16 W in 16-output blocks; per row the same bits in any call",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none());
  m.def("attention", &attention, "attention over each query's own prefix of keys; per query the same bits in any call");
  pybind11::class_<DraftStack>(m, "DraftStack")
      .def(pybind11::init<std::vector<std::vector<at::Tensor>>, int64_t, double>())
      .def("step", &DraftStack::step);
}
