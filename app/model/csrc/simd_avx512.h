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
  static F load_fp16(const uint16_t* p) {  // IEEE half -> fp32 (exact)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
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

// The fp32 steps after an integer dot product, written once for every path (so that each gives a row the same
// bits): minus the row's zero point times the row sum of W, times both scales, plus the bias.
inline __m512 rescaled(__m512i dot, __m512 x_zero, __m512 x_scale, __m512 w_sum, __m512 w_scale, __m512 bias) {
  const __m512 centered = _mm512_fnmadd_ps(x_zero, w_sum, _mm512_cvtepi32_ps(dot));
  return _mm512_fmadd_ps(_mm512_mul_ps(centered, x_scale), w_scale, bias);
}

// The first `count` of 16 lanes (all 16 from 16 on).
inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << count) - 1u);
}

// y[m, n] = x[m, k] . W^T (+ bias) for the [ceil(N/16), K/4, 16, 4] packing of `quantize`, x already
// quantized to uint8 (`xq`, with per-row scale and zero point): one 64-byte vector holds four inputs
// of 16 rows, so a `vpdpbusd` with four broadcast activation bytes adds to 16 dot products at once.
void qlinear_rows(const uint8_t* xq, const float* x_scale, const float* x_zero, int64_t m, const Packed& w, float* y) {
  const int64_t n = w.n, k = w.k;
  const int64_t blocks = (n + kRows - 1) / kRows, depth = k / kDepth;
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t first = b * kRows, width = std::min(kRows, n - first);
      const __mmask16 keep = first_lanes(width);
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
        const __m512 out = rescaled(dot, _mm512_set1_ps(x_zero[r]), _mm512_set1_ps(x_scale[r]), w_sum, w_scale, b_vec);
        _mm512_mask_storeu_ps(y + r * n + first, keep, out);
      }
    }
  });
}

// One row of activations to uint8 over its own range [min(0, x), max(0, x)]: `scale`, `zero` and the
// values, 16 at a time (the AVX2 `quantize_row` gives the same bits).
void quantize_row(const float* src, int64_t k, uint8_t* dst, float* scale, float* zero) {
  __m512 lo_v = _mm512_setzero_ps(), hi_v = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 keep = first_lanes(k - i);
    const __m512 x = _mm512_maskz_loadu_ps(keep, src + i);  // a missing lane reads 0: within the range
    lo_v = _mm512_min_ps(lo_v, x);
    hi_v = _mm512_max_ps(hi_v, x);
  }
  const float lo = _mm512_reduce_min_ps(lo_v), hi = _mm512_reduce_max_ps(hi_v);
  const float s = hi > lo ? (hi - lo) / 255.f : 1.f;
  const float inv = 1.f / s;
  const int32_t z = std::clamp(static_cast<int32_t>(std::nearbyint(-lo * inv)), 0, 255);
  *scale = s;
  *zero = static_cast<float>(z);
  const __m512 inv_v = _mm512_set1_ps(inv);
  const __m512i z_v = _mm512_set1_epi32(z), floor_v = _mm512_setzero_si512(), ceil_v = _mm512_set1_epi32(255);
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 keep = first_lanes(k - i);
    const __m512 scaled = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(keep, src + i), inv_v),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(scaled), z_v);
    q = _mm512_min_epi32(_mm512_max_epi32(q, floor_v), ceil_v);
    _mm512_mask_cvtepi32_storeu_epi8(dst + i, keep, q);
  }
}

// y[m, n] for many rows (an encoder's 1500 frames, a long verification pass): tiles of R rows by C blocks
// of 16 outputs, R x C accumulators in registers, so that each weight vector loaded serves R rows and each
// broadcast activation word C blocks. The integer dot products and the fp32 steps after them are
// `qlinear_rows`'s, in its order: every row gets the bits it gets there.
constexpr int kTileRows = 6, kTileBlocks = 4;

template <int R, int C>
void qlinear_tile(const uint8_t* xq, const float* x_scale, const float* x_zero, int64_t r0, int64_t b0,
                  const Packed& w, float* y) {
  const int64_t n = w.n, k = w.k, depth = k / kDepth;
  __m512i acc[R][C];
  const int32_t* xr[R];
  const int8_t* wb[C];
  for (int i = 0; i < R; ++i) xr[i] = reinterpret_cast<const int32_t*>(xq + (r0 + i) * k);
  for (int j = 0; j < C; ++j) wb[j] = w.weight + (b0 + j) * kRows * k;
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = _mm512_setzero_si512();
  for (int64_t q = 0; q < depth; ++q) {
    __m512i wv[C];
    for (int j = 0; j < C; ++j) wv[j] = _mm512_loadu_si512(wb[j] + q * 64);
    for (int i = 0; i < R; ++i) {
      const __m512i xv = _mm512_set1_epi32(xr[i][q]);
      for (int j = 0; j < C; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xv, wv[j]);
    }
  }
  for (int j = 0; j < C; ++j) {
    const int64_t first = (b0 + j) * kRows, width = std::min(kRows, n - first);
    const __mmask16 keep = first_lanes(width);
    const __m512 w_scale = _mm512_maskz_loadu_ps(keep, w.scale + first);
    const __m512 w_sum = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(keep, w.row_sum + first));
    const __m512 b_vec = w.bias ? _mm512_maskz_loadu_ps(keep, w.bias + first) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i) {
      const int64_t r = r0 + i;
      const __m512 out = rescaled(acc[i][j], _mm512_set1_ps(x_zero[r]), _mm512_set1_ps(x_scale[r]), w_sum, w_scale, b_vec);
      _mm512_mask_storeu_ps(y + r * n + first, keep, out);
    }
  }
}

using TileFn = void (*)(const uint8_t*, const float*, const float*, int64_t, int64_t, const Packed&, float*);

template <int R>
constexpr std::array<TileFn, kTileBlocks> tiles_of_rows() {
  return {&qlinear_tile<R, 1>, &qlinear_tile<R, 2>, &qlinear_tile<R, 3>, &qlinear_tile<R, 4>};
}

void qlinear_many(const uint8_t* xq, const float* x_scale, const float* x_zero, int64_t m, const Packed& w, float* y) {
  static constexpr std::array<std::array<TileFn, kTileBlocks>, kTileRows> kTiles{
      tiles_of_rows<1>(), tiles_of_rows<2>(), tiles_of_rows<3>(),
      tiles_of_rows<4>(), tiles_of_rows<5>(), tiles_of_rows<6>()};
  const int64_t blocks = (w.n + kRows - 1) / kRows;
  const int64_t groups = (blocks + kTileBlocks - 1) / kTileBlocks, row_tiles = (m + kTileRows - 1) / kTileRows;
  // tile i: row tile i % row_tiles of block group i / row_tiles, so that a thread's run of tiles mostly
  // reads one group's weights (in cache) with row after row of activations
  at::parallel_for(0, groups * row_tiles, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / row_tiles, t = i % row_tiles;
      const int64_t r0 = t * kTileRows, b0 = g * kTileBlocks;
      const int64_t rows = std::min<int64_t>(kTileRows, m - r0), cols = std::min<int64_t>(kTileBlocks, blocks - b0);
      kTiles[rows - 1][cols - 1](xq, x_scale, x_zero, r0, b0, w, y);
    }
  });
}

// y[m, n] from integer products computed elsewhere (oneDNN's exact int8 matmul over the activations less
// 128, as int8): acc + 128 * row sum is the uint8 dot product `qlinear_rows` computes, and the fp32 steps
// after it are its own, so a row gets the same bits either way.
void rescale_rows(const int32_t* acc, int64_t m, const float* x_scale, const float* x_zero, const Packed& w, float* y) {
  const int64_t n = w.n;
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const __m512 zero = _mm512_set1_ps(x_zero[r]), xs = _mm512_set1_ps(x_scale[r]);
      for (int64_t first = 0; first < n; first += kRows) {
        const int64_t width = std::min(kRows, n - first);
        const __mmask16 keep = first_lanes(width);
        const __m512i sum = _mm512_maskz_loadu_epi32(keep, w.row_sum + first);
        const __m512i dot = _mm512_add_epi32(_mm512_maskz_loadu_epi32(keep, acc + r * n + first), _mm512_slli_epi32(sum, 7));
        const __m512 b_vec = w.bias ? _mm512_maskz_loadu_ps(keep, w.bias + first) : _mm512_setzero_ps();
        const __m512 out =
            rescaled(dot, zero, xs, _mm512_cvtepi32_ps(sum), _mm512_maskz_loadu_ps(keep, w.scale + first), b_vec);
        _mm512_mask_storeu_ps(y + r * n + first, keep, out);
      }
    }
  });
}
