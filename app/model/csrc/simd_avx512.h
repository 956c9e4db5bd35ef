// AVX-512 F/BW/DQ/VL + VNNI (Intel since Cascade Lake, AMD since Zen 4): the SIMD operations of the
// kernel library, 16 fp32 lanes. Included inside a namespace compiled for these instruction sets
// (int8_linear.cpp); includes nothing.

struct Vec {
  static constexpr int64_t kLanes = 16;
  using F = __m512;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const uint16_t* p) {  // bfloat16 -> fp32: the 16 bits are the top of the fp32 word
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
  // The sums of four vectors' lanes, in one vector: cheaper than four `sum`s (attention scores).
  static __m128 sum4(F a, F b, F c, F d) {
    const auto half = [](F v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); };
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(half(a), half(b)), _mm256_hadd_ps(half(c), half(d)));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
  }
  static F ldexp(F p, F n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
  static F round(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static constexpr float kExpFloor = -100.f;
};

// y[m, n] = x[m, k] . W^T (+ bias) for the [ceil(N/16), K/4, 16, 4] packing of `quantize`, x already
// quantized to uint8 (`xq`, with per-row scale and zero point): one 64-byte vector holds four inputs
// of 16 rows, so a `vpdpbusd` with four broadcast activation bytes adds to 16 dot products at once.
void qlinear_rows(const uint8_t* xq, const float* x_scale, const float* x_zero, int64_t m, const Packed& w, float* y) {
  const int64_t n = w.n, k = w.k;
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
        const int32_t* xr = reinterpret_cast<const int32_t*>(xq + r * k);
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
