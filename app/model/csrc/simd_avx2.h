// AVX2 + FMA (x86-64 since Haswell / Zen 1): the SIMD operations of the kernel library, 8 fp32 lanes.
// Included inside a namespace compiled for these instruction sets (int8_linear.cpp); includes nothing.

struct Vec {
  static constexpr int64_t kLanes = 8;
  using F = __m256;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const uint16_t* p) {  // bfloat16 -> fp32: the 16 bits are the top of the fp32 word
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  static F load_fp16(const uint16_t* p) {  // IEEE half -> fp32 (exact)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  // The sums of four vectors' lanes, in one vector: cheaper than four `sum`s (attention scores).
  static __m128 sum4(F a, F b, F c, F d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
  }
  static float sum(F v) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
  }
  static F ldexp(F p, F n) {  // p * 2^n for integral n in [-126, 127], 2^n built in the exponent field
    return _mm256_mul_ps(
        p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23)));
  }
  static F round(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static constexpr float kExpFloor = -87.f;  // keeps 2^n normal (exp(-87) ~ 1.6e-38)
};

// The fp32 steps after an integer dot product, written once for both paths (the AVX-512 `rescaled`'s): minus the
// row's zero point times the row sum of W, times both scales, plus the bias.
inline __m256 rescaled(__m256i dot, __m256 x_zero, __m256 x_scale, __m256 w_sum, __m256 w_scale, __m256 bias) {
  const __m256 centered = _mm256_fnmadd_ps(x_zero, w_sum, _mm256_cvtepi32_ps(dot));
  return _mm256_fmadd_ps(_mm256_mul_ps(centered, x_scale), w_scale, bias);
}

// How far ahead of the products the weights are fetched. A draft step streams ~50 MB of int8 weights
// (Whisper base), more than the L3 cache holds: on a Zen 3 machine the vocabulary projection took
// 1.0 ms with this against 1.5 ms without (the hardware prefetcher alone keeps fewer lines in flight).
constexpr int64_t kPrefetchBytes = 2048;

// y[m, n] = x[m, k] . W^T (+ bias) for the [ceil(N/16), K/4, 16, 4] packing of `quantize`, x already
// quantized to uint8 (`xq`, with per-row scale and zero point). AVX2 has no u8 x s8 dot product that
// cannot saturate, so both sides widen to int16 and `vpmaddwd` sums pairs into int32: the integer
// dot products are exactly those of the AVX-512 VNNI path.
void qlinear_rows(const uint8_t* xq, const float* x_scale, const float* x_zero, int64_t m, const Packed& w, float* y) {
  const int64_t n = w.n, k = w.k;
  const int64_t blocks = (n + kRows - 1) / kRows, depth = k / kDepth;
  std::vector<int16_t> wide(static_cast<size_t>(m * k));  // allocated here, not in the worker threads
  for (int64_t i = 0; i < m * k; ++i) wide[i] = xq[i];
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    alignas(32) float scale[kRows], sum[kRows], bias[kRows], out[kRows];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t first = b * kRows, width = std::min(kRows, n - first);
      const int8_t* block = w.weight + b * kRows * k;
      for (int64_t i = 0; i < kRows; ++i) {  // rows past N: zero weights, so zero sums; any scale
        scale[i] = i < width ? w.scale[first + i] : 0.f;
        sum[i] = i < width ? static_cast<float>(w.row_sum[first + i]) : 0.f;
        bias[i] = i < width && w.bias ? w.bias[first + i] : 0.f;
      }
      for (int64_t r = 0; r < m; ++r) {
        const int16_t* xr = wide.data() + r * k;
        // acc[g]: rows 4g..4g+3, two partial sums each ([r0 r0 r1 r1 | r2 r2 r3 r3])
        __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                          _mm256_setzero_si256()};
        for (int64_t q = 0; q < depth; ++q) {
          int64_t four;  // the four inputs of this depth step as int16, for every row
          std::memcpy(&four, xr + q * kDepth, sizeof four);
          const __m256i xv = _mm256_set1_epi64x(four);
          const int8_t* wq = block + q * kRows * kDepth;
          _mm_prefetch(reinterpret_cast<const char*>(wq + kPrefetchBytes), _MM_HINT_T0);
          for (int g = 0; g < 4; ++g) {
            const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wq + 16 * g)));
            acc[g] = _mm256_add_epi32(acc[g], _mm256_madd_epi16(xv, wv));
          }
        }
        // hadd pairs -> [r0 r1 r4 r5 | r2 r3 r6 r7]; the 64-bit permute puts rows in order
        const __m256i lo = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[0], acc[1]), _MM_SHUFFLE(3, 1, 2, 0));
        const __m256i hi = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[2], acc[3]), _MM_SHUFFLE(3, 1, 2, 0));
        const __m256 zero = _mm256_set1_ps(x_zero[r]), xs = _mm256_set1_ps(x_scale[r]);
        const __m256i dots[2] = {lo, hi};
        for (int h = 0; h < 2; ++h) {
          const __m256 v = rescaled(dots[h], zero, xs, _mm256_load_ps(sum + 8 * h), _mm256_load_ps(scale + 8 * h),
                                    _mm256_load_ps(bias + 8 * h));
          if (width == kRows)
            _mm256_storeu_ps(y + r * n + first + 8 * h, v);
          else
            _mm256_store_ps(out + 8 * h, v);
        }
        if (width < kRows) std::copy_n(out, width, y + r * n + first);
      }
    }
  });
}

// One row of activations to uint8 over its own range [min(0, x), max(0, x)], 8 at a time: the same bits as
// the AVX-512 `quantize_row` (min, max and one rounding per value, in IEEE fp32).
void quantize_row(const float* src, int64_t k, uint8_t* dst, float* scale, float* zero) {
  __m256 lo_v = _mm256_setzero_ps(), hi_v = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    lo_v = _mm256_min_ps(lo_v, x);
    hi_v = _mm256_max_ps(hi_v, x);
  }
  alignas(32) float los[8], his[8];
  _mm256_store_ps(los, lo_v);
  _mm256_store_ps(his, hi_v);
  float lo = 0.f, hi = 0.f;
  for (int j = 0; j < 8; ++j) {
    lo = std::min(lo, los[j]);
    hi = std::max(hi, his[j]);
  }
  for (int64_t j = i; j < k; ++j) {
    lo = std::min(lo, src[j]);
    hi = std::max(hi, src[j]);
  }
  const float s = hi > lo ? (hi - lo) / 255.f : 1.f;
  const float inv = 1.f / s;
  const int32_t z = std::clamp(static_cast<int32_t>(std::nearbyint(-lo * inv)), 0, 255);
  *scale = s;
  *zero = static_cast<float>(z);
  const __m256 inv_v = _mm256_set1_ps(inv);
  const __m256i z_v = _mm256_set1_epi32(z), floor_v = _mm256_setzero_si256(), ceil_v = _mm256_set1_epi32(255);
  alignas(32) int32_t q[8];
  for (i = 0; i + 8 <= k; i += 8) {
    const __m256 scaled =
        _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(src + i), inv_v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i v = _mm256_add_epi32(_mm256_cvtps_epi32(scaled), z_v);
    _mm256_store_si256(reinterpret_cast<__m256i*>(q), _mm256_min_epi32(_mm256_max_epi32(v, floor_v), ceil_v));
    for (int j = 0; j < 8; ++j) dst[i + j] = static_cast<uint8_t>(q[j]);
  }
  for (; i < k; ++i)
    dst[i] = static_cast<uint8_t>(std::clamp(static_cast<int32_t>(std::nearbyint(src[i] * inv)) + z, 0, 255));
}

// y[m, n] from integer products computed elsewhere: as the AVX-512 `rescale_rows`, the same bits.
void rescale_rows(const int32_t* acc, int64_t m, const float* x_scale, const float* x_zero, const Packed& w, float* y) {
  const int64_t n = w.n;
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / n), [&](int64_t r0, int64_t r1) {
    alignas(32) int32_t acc8[8], sum8[8];
    alignas(32) float scale8[8], bias8[8], out8[8];
    for (int64_t r = r0; r < r1; ++r) {
      const __m256 zero = _mm256_set1_ps(x_zero[r]), xs = _mm256_set1_ps(x_scale[r]);
      for (int64_t first = 0; first < n; first += 8) {
        const int64_t width = std::min<int64_t>(8, n - first);
        for (int64_t i = 0; i < 8; ++i) {  // lanes past n: zeros
          acc8[i] = i < width ? acc[r * n + first + i] : 0;
          sum8[i] = i < width ? w.row_sum[first + i] : 0;
          scale8[i] = i < width ? w.scale[first + i] : 0.f;
          bias8[i] = i < width && w.bias ? w.bias[first + i] : 0.f;
        }
        const __m256i sum = _mm256_load_si256(reinterpret_cast<const __m256i*>(sum8));
        const __m256i dot = _mm256_add_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(acc8)), _mm256_slli_epi32(sum, 7));
        _mm256_store_ps(out8, rescaled(dot, zero, xs, _mm256_cvtepi32_ps(sum), _mm256_load_ps(scale8),
                                       _mm256_load_ps(bias8)));
        std::copy_n(out8, width, y + r * n + first);
      }
    }
  });
}
