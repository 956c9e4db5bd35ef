// int8 linear for the CPU drafts: y = dequant(quant(x) . W^T) + b, for a few rows of x at a time.
//
// W is quantized per output row (symmetric int8, scale[n]) and packed for AVX-512 VNNI as
// [ceil(N/16)][K/4][16][4]: one 64-byte vector holds four consecutive inputs of 16 output rows, so a
// `vpdpbusd` of that vector with four broadcast activation bytes adds to 16 dot products at once and
// no horizontal sum is needed. Each row of x is quantized to uint8 over its own range [min, max]
// (widened to hold 0, as torch does); its zero point is taken out again with the row sums of W.
//
// For one or a few rows this runs 2-5x faster than torch's dynamic int8 linear (fbgemm), whose fixed
// cost per call dominates the small products of a draft step (docs/performance.md).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

// A portable build (-DSPECWHISPER_PORTABLE, made by `python -m app kernels --install`) compiles only this
// file's own functions for AVX-512 VNNI, whatever CPU builds it; torch's headers above and the module's
// set-up below stay baseline x86-64, so the library loads on any x86-64 CPU and `available()` asks the
// CPU at run time. A native build (-march=native) takes the instruction sets of the CPU that builds it.
#if defined(SPECWHISPER_PORTABLE)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
#endif

#if defined(SPECWHISPER_PORTABLE) || (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__))
#include <immintrin.h>
#define SPECWHISPER_VNNI 1
#else
#define SPECWHISPER_VNNI 0
#endif

namespace {

constexpr int64_t kRows = 16;  // output rows per packed block
constexpr int64_t kDepth = 4;  // inputs per lane of one block vector

// w [N, K] fp32 -> (packed [ceil(N/16), K/4, 16, 4] int8, scale [N], row sum [N] int32): each row
// quantized symmetrically by its largest magnitude, straight into the packed layout (rows past N are
// zero), without fp32 temporaries.
std::vector<torch::Tensor> quantize(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat, "quantize: expected an fp32 [N, K] weight");
  auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k % kDepth == 0, "quantize: the input size must be a multiple of 4");
  const int64_t blocks = (n + kRows - 1) / kRows, depth = k / kDepth;
  auto packed = torch::zeros({blocks, depth, kRows, kDepth}, torch::kInt8);
  auto scale = torch::empty({n}, torch::kFloat);
  auto row_sum = torch::empty({n}, torch::kInt);
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

#if SPECWHISPER_VNNI
// One packed int8 weight: [ceil(N/16), K/4, 16, 4] with per-row scales, row sums and an optional bias.
struct Packed {
  const int8_t* weight;
  const float* scale;
  const int32_t* row_sum;
  const float* bias;
  int64_t n, k;
};

Packed unpack(const torch::Tensor& packed, const torch::Tensor& scale, const torch::Tensor& row_sum,
              const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == torch::kInt8 && packed.dim() == 4 && packed.is_contiguous(),
              "int8 linear: expected a packed int8 weight");
  const bool has_bias = bias.has_value() && bias->defined() && bias->numel() > 0;  // empty: no bias
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  return {packed.data_ptr<int8_t>(), scale.data_ptr<float>(), row_sum.data_ptr<int32_t>(), bp, scale.size(0),
          packed.size(1) * kDepth};
}

// y[m, n] = x[m, k] . W^T (+ bias), x quantized row by row to uint8 over its range (post-GELU inputs
// are mostly positive: a symmetric range would waste half of the 256 levels).
void qlinear(const float* x, int64_t m, const Packed& w, float* y) {
  const int64_t n = w.n, k = w.k;
  std::vector<uint8_t> xq(static_cast<size_t>(m * k));
  std::vector<float> x_scale(static_cast<size_t>(m)), x_zero(static_cast<size_t>(m));
  for (int64_t r = 0; r < m; ++r) {
    const float* src = x + r * k;
    float lo = 0.f, hi = 0.f;
    for (int64_t i = 0; i < k; ++i) {
      lo = std::min(lo, src[i]);
      hi = std::max(hi, src[i]);
    }
    const float s = hi > lo ? (hi - lo) / 255.f : 1.f;
    const float inv = 1.f / s;
    const int32_t zero = std::clamp(static_cast<int32_t>(std::nearbyint(-lo * inv)), 0, 255);
    x_scale[r] = s;
    x_zero[r] = static_cast<float>(zero);
    uint8_t* dst = xq.data() + r * k;
    for (int64_t i = 0; i < k; ++i)
      dst[i] = static_cast<uint8_t>(std::clamp(static_cast<int32_t>(std::nearbyint(src[i] * inv)) + zero, 0, 255));
  }
  const int64_t blocks = (n + kRows - 1) / kRows, depth = k / kDepth;
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t first = b * kRows, width = std::min(kRows, n - first);
      const __mmask16 keep = static_cast<__mmask16>((1u << width) - 1u);
      const int8_t* block = w.weight + b * kRows * k;
      const __m512 w_scale = _mm512_maskz_loadu_ps(keep, w.scale + first);
      const __m512 w_sum = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(keep, w.row_sum + first));
      const __m512 b_vec = w.bias ? _mm512_maskz_loadu_ps(keep, w.bias + first) : _mm512_setzero_ps();
      for (int64_t r = 0; r < m; ++r) {
        const int32_t* xr = reinterpret_cast<const int32_t*>(xq.data() + r * k);
        __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
        __m512i a2 = _mm512_setzero_si512(), a3 = _mm512_setzero_si512();
        int64_t q = 0;
        for (; q + 4 <= depth; q += 4) {  // four accumulators hide the latency of vpdpbusd
          a0 = _mm512_dpbusd_epi32(a0, _mm512_set1_epi32(xr[q]), _mm512_loadu_si512(block + q * 64));
          a1 = _mm512_dpbusd_epi32(a1, _mm512_set1_epi32(xr[q + 1]), _mm512_loadu_si512(block + (q + 1) * 64));
          a2 = _mm512_dpbusd_epi32(a2, _mm512_set1_epi32(xr[q + 2]), _mm512_loadu_si512(block + (q + 2) * 64));
          a3 = _mm512_dpbusd_epi32(a3, _mm512_set1_epi32(xr[q + 3]), _mm512_loadu_si512(block + (q + 3) * 64));
        }
        for (; q < depth; ++q)
          a0 = _mm512_dpbusd_epi32(a0, _mm512_set1_epi32(xr[q]), _mm512_loadu_si512(block + q * 64));
        const __m512i dot = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
        // minus zero point * row sum of W, times both scales, plus bias
        const __m512 centered = _mm512_fnmadd_ps(_mm512_set1_ps(x_zero[r]), w_sum, _mm512_cvtepi32_ps(dot));
        const __m512 out = _mm512_fmadd_ps(_mm512_mul_ps(centered, _mm512_set1_ps(x_scale[r])), w_scale, b_vec);
        _mm512_mask_storeu_ps(y + r * n + first, keep, out);
      }
    }
  });
}
#endif

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                     const torch::Tensor& row_sum, const c10::optional<torch::Tensor>& bias) {
#if SPECWHISPER_VNNI
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "int8 linear: expected fp32 input");
  const Packed w = unpack(packed, scale, row_sum, bias);
  TORCH_CHECK(x.size(-1) == w.k, "int8 linear: the input does not match the packed weight");
  auto rows = x.reshape({-1, w.k}).contiguous();
  std::vector<int64_t> out_shape = x.sizes().vec();
  out_shape.back() = w.n;
  auto y = torch::empty({rows.size(0), w.n}, x.options());
  if (rows.size(0) > 0) qlinear(rows.data_ptr<float>(), rows.size(0), w, y.data_ptr<float>());
  return y.view(out_shape);
#else
  TORCH_CHECK(false, "int8 linear: built without AVX-512 VNNI");
#endif
}

#if SPECWHISPER_VNNI

void layer_norm(const float* x, const float* w, const float* b, int64_t d, float eps, float* y) {
  float mean = 0.f, var = 0.f;
  for (int64_t i = 0; i < d; ++i) mean += x[i];
  mean /= static_cast<float>(d);
  for (int64_t i = 0; i < d; ++i) var += (x[i] - mean) * (x[i] - mean);
  const float inv = 1.f / std::sqrt(var / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) y[i] = (x[i] - mean) * inv * w[i] + b[i];
}

// exp(x) for x <= 0 (softmax after subtracting the maximum): 2^n * 2^f with n = round(x log2 e),
// |f| <= 1/2 and 2^f by its Taylor series to degree 6 (relative error < 1e-7).
inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147181f));  // f ln 2, |.| <= 0.347
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // bfloat16 -> fp32: the 16 bits are the top of the fp32 word
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// One query per head against keys/values [1, H, T, Dh] (strides in elements; Dh contiguous), fp32 or
// bfloat16 (half the bytes: a draft step reads the audio frames' keys/values from memory each time).
template <typename E>
void attend_as(const float* q, const E* kp, const E* vp, const torch::Tensor& keys, const torch::Tensor& values,
               int64_t len, int64_t heads, float* out) {
  const int64_t dh = keys.size(3);
  const int64_t kh = keys.stride(1), kt = keys.stride(2), vh = values.stride(1), vt = values.stride(2);
  const float scale = 1.f / std::sqrt(static_cast<float>(dh));
  TORCH_CHECK(dh % 16 == 0 && dh <= 128, "attention: head size must be a multiple of 16, at most 128");
  // Few keys (self-attention over the tokens so far): not worth waking the other threads.
  const int64_t grain = len * dh < 32768 ? heads : 1;
  std::vector<float> probs(static_cast<size_t>(heads * len));  // allocated here, not in the worker threads
  at::parallel_for(0, heads, grain, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      float* p = probs.data() + h * len;
      const float* qh = q + h * dh;
      float top = -INFINITY;
      for (int64_t t = 0; t < len; ++t) {
        const E* k = kp + h * kh + t * kt;
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qh), load16(k));
        for (int64_t i = 16; i < dh; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + i), load16(k + i), acc);
        p[t] = _mm512_reduce_add_ps(acc) * scale;
        top = std::max(top, p[t]);
      }
      const __m512 top16 = _mm512_set1_ps(top);
      __m512 total = _mm512_setzero_ps();
      for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 keep = len - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (len - t)) - 1u);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, p + t), top16));
        _mm512_mask_storeu_ps(p + t, keep, e);
        total = _mm512_mask_add_ps(total, keep, total, e);
      }
      const float sum = _mm512_reduce_add_ps(total);
      float* o = out + h * dh;
      __m512 acc[8];  // dh <= 128
      const int64_t lanes = dh / 16;
      for (int64_t c = 0; c < lanes; ++c) acc[c] = _mm512_setzero_ps();
      for (int64_t t = 0; t < len; ++t) {
        const __m512 w = _mm512_set1_ps(p[t]);
        const E* v = vp + h * vh + t * vt;
        for (int64_t c = 0; c < lanes; ++c) acc[c] = _mm512_fmadd_ps(w, load16(v + 16 * c), acc[c]);
      }
      const __m512 inv = _mm512_set1_ps(1.f / sum);
      for (int64_t c = 0; c < lanes; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[c], inv));
    }
  });
}

void attend(const float* q, const torch::Tensor& keys, const torch::Tensor& values, int64_t len, int64_t heads,
            float* out) {
  TORCH_CHECK(keys.scalar_type() == values.scalar_type(), "attention: keys and values of one type");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "attention: head dimension must be contiguous");
  if (keys.scalar_type() == torch::kBFloat16) {
    attend_as(q, reinterpret_cast<const uint16_t*>(keys.data_ptr<at::BFloat16>()),
              reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>()), keys, values, len, heads, out);
  } else {
    TORCH_CHECK(keys.scalar_type() == torch::kFloat, "attention: fp32 or bfloat16 keys/values");
    attend_as(q, keys.data_ptr<float>(), values.data_ptr<float>(), keys, values, len, heads, out);
  }
}

// The layers of an int8 self-draft for rows feeding one token each: a draft step in one call instead
// of ~150 small torch ops. Same arithmetic as the module path, same int8 products.
class DraftStack {
 public:
  // Per layer, in order: norm1 w/b, qkv (packed, scale, row sum, bias), self out (4), norm2 w/b,
  // cross q (4), cross out (4), norm3 w/b, fc1 (4), fc2 (4); an empty tensor is a missing bias.
  DraftStack(std::vector<std::vector<torch::Tensor>> layers, int64_t heads, double eps)
      : params_(std::move(layers)), heads_(heads), eps_(static_cast<float>(eps)) {
    for (const auto& t : params_) {
      TORCH_CHECK(t.size() == 30, "draft stack: 30 tensors per layer");
      const auto at = [&t](size_t i) { return unpack(t[i], t[i + 1], t[i + 2], t[i + 3]); };
      products_.push_back({at(2), at(6), at(12), at(16), at(22), at(26)});
    }
  }

  // x [B, D] (token + position embeddings, one token per row) -> the last layer's output [B, D].
  // Row b writes its keys/values into each layer's cache [B, H, C, Dh] at slot writes[b] (its
  // position, or the scratch slot for a padding row) and attends over positions 0..positions[b].
  torch::Tensor step(const torch::Tensor& x, const std::vector<int64_t>& positions, const std::vector<int64_t>& writes,
                     const std::vector<torch::Tensor>& cache_k, const std::vector<torch::Tensor>& cache_v,
                     const std::vector<torch::Tensor>& cross_k, const std::vector<torch::Tensor>& cross_v) const {
    TORCH_CHECK(x.dim() == 2, "draft stack: x must be [B, D]");
    const int64_t rows = x.size(0), d = x.size(1), dh = d / heads_;
    TORCH_CHECK(static_cast<int64_t>(positions.size()) == rows && static_cast<int64_t>(writes.size()) == rows,
                "draft stack: one position and one write slot per row");
    TORCH_CHECK(cache_k.size() == params_.size() && cross_k.size() == params_.size(), "draft stack: one cache per layer");
    auto out = x.to(torch::kFloat).contiguous().clone();
    float* xs = out.data_ptr<float>();
    std::vector<float> h(rows * d), qkv(rows * 3 * d), att(rows * d), tmp(rows * d), ff;
    const auto residual = [&]() {
      for (int64_t i = 0; i < rows * d; ++i) xs[i] += tmp[i];
    };
    const auto norm = [&](const torch::Tensor& w, const torch::Tensor& b) {
      for (int64_t r = 0; r < rows; ++r)
        layer_norm(xs + r * d, w.data_ptr<float>(), b.data_ptr<float>(), d, eps_, h.data() + r * d);
    };
    for (size_t l = 0; l < params_.size(); ++l) {
      const auto& t = params_[l];
      const auto& [qkv_w, self_out, cross_q, cross_out, fc1, fc2] = products_[l];
      // self-attention over the cache
      norm(t[0], t[1]);
      qlinear(h.data(), rows, qkv_w, qkv.data());
      const auto& ck = cache_k[l];
      const auto& cv = cache_v[l];
      TORCH_CHECK(ck.size(0) == rows && ck.stride(3) == 1 && cv.stride(3) == 1, "draft stack: bad cache");
      float* ckp = ck.data_ptr<float>();
      float* cvp = cv.data_ptr<float>();
      for (int64_t r = 0; r < rows; ++r) {
        TORCH_CHECK(writes[r] < ck.size(2) && positions[r] < ck.size(2), "draft stack: position past the cache");
        const float* row = qkv.data() + r * 3 * d;
        for (int64_t hh = 0; hh < heads_; ++hh) {
          std::copy_n(row + d + hh * dh, dh, ckp + r * ck.stride(0) + hh * ck.stride(1) + writes[r] * ck.stride(2));
          std::copy_n(row + 2 * d + hh * dh, dh, cvp + r * cv.stride(0) + hh * cv.stride(1) + writes[r] * cv.stride(2));
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        attend(qkv.data() + r * 3 * d, ck.narrow(0, r, 1), cv.narrow(0, r, 1), positions[r] + 1, heads_,
               att.data() + r * d);
      qlinear(att.data(), rows, self_out, tmp.data());
      residual();
      // cross-attention over the audio frames
      norm(t[10], t[11]);
      qlinear(h.data(), rows, cross_q, qkv.data());
      for (int64_t r = 0; r < rows; ++r)
        attend(qkv.data() + r * d, cross_k[l].narrow(0, r, 1), cross_v[l].narrow(0, r, 1), cross_k[l].size(2), heads_,
               att.data() + r * d);
      qlinear(att.data(), rows, cross_out, tmp.data());
      residual();
      // feed-forward (exact GELU, as Whisper's)
      norm(t[20], t[21]);
      ff.resize(static_cast<size_t>(rows * fc1.n));
      qlinear(h.data(), rows, fc1, ff.data());
      for (auto& v : ff) v = 0.5f * v * (1.f + std::erf(v * static_cast<float>(M_SQRT1_2)));
      qlinear(ff.data(), rows, fc2, tmp.data());
      residual();
    }
    return out;
  }

 private:
  std::vector<std::vector<torch::Tensor>> params_;  // owns what products_ points into
  std::vector<std::array<Packed, 6>> products_;     // per layer: qkv, self out, cross q, cross out, fc1, fc2
  int64_t heads_;
  float eps_;
};
#endif

}  // namespace

#if defined(SPECWHISPER_PORTABLE)
#pragma GCC pop_options
#endif

namespace {

bool available() {
#if SPECWHISPER_VNNI
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "True when built with the kernel and this CPU runs it (AVX-512 VNNI)");
  m.def("quantize", &quantize, "fp32 [N, K] weight -> (packed int8 blocks, row scales, row sums)");
  m.def("linear", &linear, "y = dequant(quant(x) W^T) + b for a packed int8 W");
#if SPECWHISPER_VNNI
  pybind11::class_<DraftStack>(m, "DraftStack")
      .def(pybind11::init<std::vector<std::vector<torch::Tensor>>, int64_t, double>())
      .def("step", &DraftStack::step);
#endif
}
