// The CPU kernels of gptkit/cpu_decode.py, written once and compiled once per instruction set: cpu_decode.cpp
// includes this file twice, inside namespace gptkit_avx2 (AVX2, FMA, F16C) and namespace gptkit_avx512
// (GPTKIT_AVX512 defined: AVX-512 F/BW/VL and VNNI), each under its own `#pragma GCC target`. Where the two
// differ (float16's products: 16 floats a step; VNNI's int8 and q4_0 dot products) the AVX-512 code is under
// `#ifdef GPTKIT_AVX512`; the rest (norms, attention, GELU) is the same source compiled for either.
// No includes here: cpu_decode.cpp includes what this needs before opening the namespace.

static inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi); lo = _mm_hadd_ps(lo, lo); lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

// The four sums of a0..a3's lanes at once, into out[0..3].
static inline void hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float* out) {
  __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // per 128-bit half
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}

// 8 weights as floats: float32 loaded as they are, float16 widened (F16C). The products below are written
// once, for either weight type.
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The dot product of one weight row and one activation row, K a multiple of 32: four accumulators, so four
// independent chains of fused multiply-adds keep the loads in flight (one chain waits on its own latency).
template <typename T>
static inline float dot(const T* w, const float* x, int64_t K) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t k = 0; k < K; k += 32) {
    a0 = _mm256_fmadd_ps(load8(w + k), _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(load8(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
    a2 = _mm256_fmadd_ps(load8(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
    a3 = _mm256_fmadd_ps(load8(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
  }
  return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

// One weight row against four rows of activations (x, x + K, x + 2K, x + 3K): each weight vector is loaded
// (for float16, widened) once for the four rows. With a batch of rows (serve.py's) this keeps the products
// from being bound by the instructions rather than by memory.
template <typename T>
static inline void dot4x(const T* w, const float* x, int64_t K, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv = load8(w + k);
    a0 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + K + k), a1);
    a2 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + 2 * K + k), a2);
    a3 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + 3 * K + k), a3);
  }
  hsum4(a0, a1, a2, a3, out);
}

#ifdef GPTKIT_AVX512
// AVX-512: 16 weights as floats: float32 loaded as they are, float16 widened.
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The dot product of one weight row and one activation row, K a multiple of 32: 64 values a step in four
// independent chains of fused multiply-adds, then the last 32 if K is not a multiple of 64.
template <typename T>
static inline float dot_wide(const T* w, const float* x, int64_t K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    a0 = _mm512_fmadd_ps(load16(w + k), _mm512_loadu_ps(x + k), a0);
    a1 = _mm512_fmadd_ps(load16(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);
    a2 = _mm512_fmadd_ps(load16(w + k + 32), _mm512_loadu_ps(x + k + 32), a2);
    a3 = _mm512_fmadd_ps(load16(w + k + 48), _mm512_loadu_ps(x + k + 48), a3);
  }
  if (k < K) {
    a0 = _mm512_fmadd_ps(load16(w + k), _mm512_loadu_ps(x + k), a0);
    a1 = _mm512_fmadd_ps(load16(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

// One weight row against four rows of activations (x, x + K, x + 2K, x + 3K), each weight vector loaded once.
template <typename T>
static inline void dot4x_wide(const T* w, const float* x, int64_t K, float* out) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv = load16(w + k);
    a0 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + k), a0);
    a1 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + K + k), a1);
    a2 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + 2 * K + k), a2);
    a3 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + 3 * K + k), a3);
  }
  out[0] = _mm512_reduce_add_ps(a0); out[1] = _mm512_reduce_add_ps(a1);
  out[2] = _mm512_reduce_add_ps(a2); out[3] = _mm512_reduce_add_ps(a3);
}

#endif

// Which loop a weight type runs. AVX-512's 16-float steps pay for float16 (half the widening instructions)
// but not for float32 on the CPU this was measured on (a Zen 4 runs 512-bit operations as two 256-bit halves:
// 0.87-0.91x of the 256-bit loop, BENCHMARKS.md), so float32 keeps the 256-bit loop in both variants.
template <typename T>
static inline float row_dot(const T* w, const float* x, int64_t K) {
#ifdef GPTKIT_AVX512
  if constexpr (std::is_same_v<T, at::Half>) return dot_wide(w, x, K);
#endif
  return dot(w, x, K);
}

template <typename T>
static inline void row_dot4x(const T* w, const float* x, int64_t K, float* out) {
#ifdef GPTKIT_AVX512
  if constexpr (std::is_same_v<T, at::Half>) return dot4x_wide(w, x, K, out);
#endif
  dot4x(w, x, K, out);
}


// float32 or float16 weights W (N, K): Y (M, N) = X (M, K) @ W^T + b. The rows of W are split over torch's
// threads; each weight row is read once from memory and, while it sits in the L1 cache, used for all M rows
// of X, four at a time and the rest one by one.
template <typename T>
static void wide_rows(const float* X, int64_t M, int64_t K, const T* W, int64_t N, const float* b, float* Y) {
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
    float out[4];
    for (int64_t n = lo; n < hi; n++) {
      const float bn = b ? b[n] : 0.f;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {
        row_dot4x(W + n * K, X + m * K, K, out);
        for (int r = 0; r < 4; r++) Y[(m + r) * N + n] = out[r] + bn;
      }
      for (; m < M; m++) Y[m * N + n] = row_dot(W + n * K, X + m * K, K) + bn;
    }
  });
}

// A tile of Y: four rows of activations (x, x + K, x + 2K, x + 3K) against three float32 weight rows (w,
// w + K, w + 2K), into y[r * ldy + j] (plus b[j]). Twelve accumulators: each step loads three weight vectors
// and four activation vectors for twelve fused multiply-adds, so the loop is bound by the multiply-adds, not
// the loads (dot4x: five loads for four), and twelve independent chains hide their latency (four do not).
static inline void tile4x3(const float* w, const float* x, int64_t K, float* y, int64_t ldy, const float* b) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00;
  __m256 c20 = c00, c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00;
  const char* next = reinterpret_cast<const char*>(w + 3 * K);  // the next group's rows, one stream of 12 K bytes
  for (int64_t k = 0; k < K; k += 8) {
    // Three rows read side by side are three short streams, which the hardware's prefetcher may follow late:
    // the next group is asked for as this one is read (16 rows: 0.9x the step's time, a noisy measurement).
    _mm_prefetch(next + 12 * k, _MM_HINT_T0);  // (past the last group: a prefetch never faults)
    _mm_prefetch(next + 12 * k + 64, _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + K + k), w2 = _mm256_loadu_ps(w + 2 * K + k);
    __m256 xv = _mm256_loadu_ps(x + k);
    c00 = _mm256_fmadd_ps(xv, w0, c00); c01 = _mm256_fmadd_ps(xv, w1, c01); c02 = _mm256_fmadd_ps(xv, w2, c02);
    xv = _mm256_loadu_ps(x + K + k);
    c10 = _mm256_fmadd_ps(xv, w0, c10); c11 = _mm256_fmadd_ps(xv, w1, c11); c12 = _mm256_fmadd_ps(xv, w2, c12);
    xv = _mm256_loadu_ps(x + 2 * K + k);
    c20 = _mm256_fmadd_ps(xv, w0, c20); c21 = _mm256_fmadd_ps(xv, w1, c21); c22 = _mm256_fmadd_ps(xv, w2, c22);
    xv = _mm256_loadu_ps(x + 3 * K + k);
    c30 = _mm256_fmadd_ps(xv, w0, c30); c31 = _mm256_fmadd_ps(xv, w1, c31); c32 = _mm256_fmadd_ps(xv, w2, c32);
  }
  float out[12];
  hsum4(c00, c01, c02, c10, out); hsum4(c11, c12, c20, c21, out + 4); hsum4(c22, c30, c31, c32, out + 8);
  for (int r = 0; r < 4; r++)
    for (int j = 0; j < 3; j++) y[r * ldy + j] = out[3 * r + j] + (b ? b[j] : 0.f);
}

// float32 weights W (N, K) against a batch of rows: Y (M, N) = X (M, K) @ W^T + b, for any M. The rows of W
// are split over torch's threads in groups of three; each group, read once from memory, stays in the cache
// while every four rows of X take a tile4x3 of it (the last M % 4 rows, and the last N % 3 weight rows, one
// dot product each). 1.3-2.7x torch's matrix product from 8 to 22 rows, 0.9-1.75x at 64 (GPT-2 small's
// matrices and head, 2 threads, a Zen 4: benchmarks/cpu_products.py); from 4 rows on it replaces dot4x's loop.
static void tiled_rows(const float* X, int64_t M, int64_t K, const float* W, int64_t N, const float* b, float* Y) {
  at::parallel_for(0, (N + 2) / 3, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t g = lo; g < hi; g++) {
      const int64_t n = 3 * g, rows = std::min<int64_t>(3, N - n);
      int64_t m = 0;
      if (rows == 3)
        for (; m + 4 <= M; m += 4) tile4x3(W + n * K, X + m * K, K, Y + m * N + n, N, b ? b + n : nullptr);
      for (; m < M; m++)
        for (int64_t j = 0; j < rows; j++) Y[m * N + n + j] = dot(W + (n + j) * K, X + m * K, K) + (b ? b[n + j] : 0.f);
    }
  });
}

static inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The quantized products read their weights once per token, one sequential stream per thread, in 4 KiB pages
// where a matrix is under 2 MiB: the hardware's prefetchers, which stop at each page's end, leave the loop
// waiting on memory (BENCHMARKS.md, "Speed: where q4_0's decode step went": before and after).
// So each 64-byte line of weights is asked for PREFETCH_AHEAD bytes before it is read, and the scales as many
// blocks ahead (past the end of a thread's groups too: a prefetch never faults). -DGPTKIT_PREFETCH_AHEAD=N
// changes the distance (benchmarks).
#ifndef GPTKIT_PREFETCH_AHEAD
#define GPTKIT_PREFETCH_AHEAD 2048
#endif
static constexpr int64_t PREFETCH_AHEAD = GPTKIT_PREFETCH_AHEAD;
static inline void ahead(const void* p, int64_t bytes = PREFETCH_AHEAD) {
  _mm_prefetch(static_cast<const char*>(p) + bytes, _MM_HINT_T0);
}

// The block formats' scales, four blocks' (a group's four rows) as floats: int8's float32 as stored; q4_0's and
// q8_0's, which are float16 values (the formats' own), stored as float16 and widened here exactly (F16C).
static inline __m128 scales4(const float* p) { return _mm_loadu_ps(p); }
static inline __m128 scales4(const at::Half* p) {
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

#ifdef GPTKIT_AVX512
// int8 weights are stored in groups of four rows, interleaved (PackedLinear's layout, as llama.cpp repacks
// its q8_0 weights): for each 32-value block b, the four rows' blocks one after another, (N / 4, B, 4, 32),
// and their scales likewise, (N / 4, B, 4). The dot products of one group w, ws with one quantized activation
// row x, xs (B blocks), two rows' blocks per 64-byte load: VNNI's dpbusd multiplies unsigned by signed bytes
// and sums each four into an int32, so the weights' magnitudes meet the activations with the weights' signs.
// Lanes 0-7 of a01 are row 0's partial sums, lanes 8-15 row 1's (a23: rows 2 and 3); two blocks a step, in
// independent chains.
static inline __m512i q8_dp(__m512i w, __m512i x) {
  const __m512i signed_x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(w), signed_x);
}

static inline __m256 high8(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

// The loop of both ways below. Unsigned: corr holds the group's weight sums times -128 (group_corr_q8) and the
// activations are made unsigned; else the weights' signs are moved onto the activations (q8_dp).
template <bool Unsigned, typename S>
static inline void q8_group_dots(const int8_t* w, const int32_t* corr, const S* ws, int64_t B, const int8_t* x,
                                 const float* xs, float* out) {
  const __m512i lo_hi01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i lo_hi23 = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // x ^ 0x80, read unsigned: x + 128
  __m512 a01 = _mm512_setzero_ps(), a23 = a01, b01 = a01, b23 = a01;
  auto step = [&](int64_t b, __m512& c01, __m512& c23) {
    const __m512i xv = _mm512_broadcast_i64x4(load32(x + 32 * b));
    const __m512 s = _mm512_castps128_ps512(_mm_mul_ps(scales4(ws + 4 * b), _mm_set1_ps(xs[b])));
    if constexpr (!Unsigned) {  // (the unsigned way reads a group group_corr_q8 has just read)
      ahead(w + 128 * b); ahead(w + 128 * b + 64); ahead(ws + 4 * b, PREFETCH_AHEAD * sizeof(S) / 32);
    }
    const __m512i w01 = _mm512_loadu_si512(w + 128 * b), w23 = _mm512_loadu_si512(w + 128 * b + 64);
    __m512i d01, d23;
    if constexpr (Unsigned) {
      const __m512i xu = _mm512_xor_si512(xv, flip);
      d01 = _mm512_dpbusd_epi32(_mm512_loadu_si512(corr + 32 * b), xu, w01);
      d23 = _mm512_dpbusd_epi32(_mm512_loadu_si512(corr + 32 * b + 16), xu, w23);
    } else {
      d01 = q8_dp(w01, xv), d23 = q8_dp(w23, xv);
    }
    c01 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d01), _mm512_permutexvar_ps(lo_hi01, s), c01);
    c23 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d23), _mm512_permutexvar_ps(lo_hi23, s), c23);
  };
  int64_t b = 0;
  for (; b + 2 <= B; b += 2) { step(b, a01, a23); step(b + 1, b01, b23); }
  if (b < B) step(b, a01, a23);
  a01 = _mm512_add_ps(a01, b01); a23 = _mm512_add_ps(a23, b23);
  hsum4(_mm512_castps512_ps256(a01), high8(a01), _mm512_castps512_ps256(a23), high8(a23), out);
}

template <typename S>
static inline void dot_group_q8(const int8_t* w, const S* ws, int64_t B, const int8_t* x, const float* xs,
                                float* out) {
  q8_group_dots<false>(w, nullptr, ws, B, x, xs, out);
}

// The same dot products for a batch of 8 activation rows or more (prefills, serve.py's larger steps), with the
// activations made unsigned instead of the weights: dpbusd((x + 128), w) = x.w + 128 * (w's sum), so each
// 64-byte unit of a group starts from corr, minus 128 times its weights' four-byte sums, made once per group
// (group_corr_q8) for all the rows. A row then costs a dpbusd per unit instead of abs, sign and dpbusd; the
// integer sums are the same, so the results are dot_group_q8's to the bit.
static inline void group_corr_q8(const int8_t* w, int64_t B, int32_t* corr) {
  const __m512i k128 = _mm512_set1_epi8(static_cast<char>(0x80));  // 128, as dpbusd's unsigned operand
  for (int64_t u = 0; u < 2 * B; u++) {
    ahead(w + 64 * u);
    _mm512_storeu_si512(corr + 16 * u, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(
                                           _mm512_setzero_si512(), k128, _mm512_loadu_si512(w + 64 * u))));
  }
}

template <typename S>
static inline void dot_group_q8_rows(const int8_t* w, const int32_t* corr, const S* ws, int64_t B,
                                     const int8_t* x, const float* xs, float* out) {
  q8_group_dots<true>(w, corr, ws, B, x, xs, out);
}

#else
// 32 int8 weights wv times 32 int8 activations xv: 8 partial sums, as floats. maddubs needs one unsigned
// operand: the weights' magnitudes, their signs moved onto xv.
static inline __m256 q8_sums(__m256i wv, __m256i xv) {
  __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// int8 weights are stored in groups of four rows, interleaved (PackedLinear's layout, as llama.cpp repacks
// its q8_0 weights): for each 32-value block b, the four rows' blocks one after another, (N / 4, B, 4, 32),
// and their scales likewise, (N / 4, B, 4). The dot products of one group w, ws with one quantized activation
// row x, xs (B blocks): the activation block and its scale are loaded once for the four rows, four
// independent accumulators, and the weights are one sequential stream (four rows read side by side from
// four places in memory defeat the hardware's prefetching: 4x slower measured).
template <typename S>
static inline void dot_group_q8(const int8_t* w, const S* ws, int64_t B, const int8_t* x, const float* xs,
                                float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t b = 0; b < B; b++) {
    const __m256i xv = load32(x + 32 * b);
    const float s = xs[b];
    const int8_t* wb = w + 128 * b;
    ahead(wb); ahead(wb + 64); ahead(ws + 4 * b, PREFETCH_AHEAD * sizeof(S) / 32);
    const __m128 sb = _mm_mul_ps(scales4(ws + 4 * b), _mm_set1_ps(s));  // the four rows' scale times x's
    a0 = _mm256_fmadd_ps(q8_sums(load32(wb), xv), _mm256_set1_ps(sb[0]), a0);
    a1 = _mm256_fmadd_ps(q8_sums(load32(wb + 32), xv), _mm256_set1_ps(sb[1]), a1);
    a2 = _mm256_fmadd_ps(q8_sums(load32(wb + 64), xv), _mm256_set1_ps(sb[2]), a2);
    a3 = _mm256_fmadd_ps(q8_sums(load32(wb + 96), xv), _mm256_set1_ps(sb[3]), a3);
  }
  hsum4(a0, a1, a2, a3, out);
}

#endif

// q4_0 weights (llama.cpp's Q4_0 values: 32 weights a block, each an unsigned 4-bit q, weight = scale (q - 8))
// are stored in the same groups of four rows as int8's, two rows' values to a byte: for each block, 64 bytes,
// byte i (0-31) row 0's value i in its low nibble and row 2's in its high one, byte 32 + i rows 1 and 3
// (PackedLinear's layout, pack_q4). One 64-byte load and two masks give rows 0 and 1 (low nibbles) and rows
// 2 and 3 (high), each row's 32 values in order: exactly the two 64-byte units of int8's group, so the scales
// and sums below are int8's. The values are unsigned, as the dot-product instructions want their first operand:
// q.x is summed and 8 times the activations' sum taken off (xc: -8 x's sum per activation block, made once per
// product by q4_rows, added to one lane of each row's partial sums), which is q8's (q - 8).x to the integer.
// Packed: the group's bytes as stored, unpacked in registers (a product of few rows); else the group unpacked
// once into int8's layout (unpack_group_q4: 128 bytes a block, the values as unsigned bytes) for all the rows of
// a batch, which then only load. Both sum the same integers in the same order: the same results to the bit.
static inline void unpack_group_q4(const uint8_t* w, int64_t B, uint8_t* out) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t u = 0; u < 2 * B; u++) {  // 32 bytes: rows 0|2 or 1|3 of a block
    if (u % 2 == 0) ahead(w + 32 * u);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * u));
    const int64_t b = u / 2, r = u % 2;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 128 * b + 32 * r), _mm256_and_si256(v, nibble));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 128 * b + 64 + 32 * r),
                        _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble));
  }
}

#ifdef GPTKIT_AVX512
template <bool Packed, typename S>
static inline void dot_group_q4(const uint8_t* w, const S* ws, int64_t B, const int8_t* x, const float* xs,
                                const int32_t* xc, float* out) {
  const __m512i lo_hi01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i lo_hi23 = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 a01 = _mm512_setzero_ps(), a23 = a01, b01 = a01, b23 = a01;
  auto step = [&](int64_t b, __m512& c01, __m512& c23) {
    const __m512i xv = _mm512_broadcast_i64x4(load32(x + 32 * b));
    const __m512i corr = _mm512_maskz_set1_epi32(0x0101, xc[b]);  // lanes 0 and 8: rows 0 and 1 (2 and 3)
    const __m512 s = _mm512_castps128_ps512(_mm_mul_ps(scales4(ws + 4 * b), _mm_set1_ps(xs[b])));
    __m512i w01, w23;
    if constexpr (Packed) {
      ahead(w + 64 * b); ahead(ws + 4 * b, PREFETCH_AHEAD * sizeof(S) / 16);
      const __m512i v = _mm512_loadu_si512(w + 64 * b);
      w01 = _mm512_and_si512(v, nibble), w23 = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    } else {
      w01 = _mm512_loadu_si512(w + 128 * b), w23 = _mm512_loadu_si512(w + 128 * b + 64);
    }
    const __m512i d01 = _mm512_dpbusd_epi32(corr, w01, xv), d23 = _mm512_dpbusd_epi32(corr, w23, xv);
    c01 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d01), _mm512_permutexvar_ps(lo_hi01, s), c01);
    c23 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d23), _mm512_permutexvar_ps(lo_hi23, s), c23);
  };
  int64_t b = 0;
  for (; b + 2 <= B; b += 2) { step(b, a01, a23); step(b + 1, b01, b23); }
  if (b < B) step(b, a01, a23);
  a01 = _mm512_add_ps(a01, b01); a23 = _mm512_add_ps(a23, b23);
  hsum4(_mm512_castps512_ps256(a01), high8(a01), _mm512_castps512_ps256(a23), high8(a23), out);
}
#else
// 32 small unsigned values w times 32 int8 activations xv, plus corr: 8 partial sums, as floats. q4_0's 4-bit
// values with corr = -8 x's sum in lane 0: (w - 8).x; q6_k's 6-bit ones with the two 16-value runs' -32 x's sums
// in lanes 0 and 4: (w - 32).x, lanes 0-3 the first run's, 4-7 the second's. maddubs takes w as its unsigned
// operand as it is (63 * 127 * 2 fits its 16-bit sums).
static inline __m256 unsigned_sums(__m256i w, __m256i xv, __m256i corr) {
  const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), _mm256_set1_epi16(1));
  return _mm256_cvtepi32_ps(_mm256_add_epi32(sums, corr));
}

template <bool Packed, typename S>
static inline void dot_group_q4(const uint8_t* w, const S* ws, int64_t B, const int8_t* x, const float* xs,
                                const int32_t* xc, float* out) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t b = 0; b < B; b++) {
    const __m256i xv = load32(x + 32 * b);
    const __m256i corr = _mm256_setr_epi32(xc[b], 0, 0, 0, 0, 0, 0, 0);
    const float s = xs[b];
    const __m128 sb = _mm_mul_ps(scales4(ws + 4 * b), _mm_set1_ps(s));  // the four rows' scale times x's
    __m256i w0, w1, w2, w3;
    if constexpr (Packed) {
      ahead(w + 64 * b); ahead(ws + 4 * b, PREFETCH_AHEAD * sizeof(S) / 16);
      const __m256i v02 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * b));
      const __m256i v13 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * b + 32));
      w0 = _mm256_and_si256(v02, nibble), w2 = _mm256_and_si256(_mm256_srli_epi16(v02, 4), nibble);
      w1 = _mm256_and_si256(v13, nibble), w3 = _mm256_and_si256(_mm256_srli_epi16(v13, 4), nibble);
    } else {
      const uint8_t* u = w + 128 * b;
      w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u));
      w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 32));
      w2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 64));
      w3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 96));
    }
    a0 = _mm256_fmadd_ps(unsigned_sums(w0, xv, corr), _mm256_set1_ps(sb[0]), a0);
    a1 = _mm256_fmadd_ps(unsigned_sums(w1, xv, corr), _mm256_set1_ps(sb[1]), a1);
    a2 = _mm256_fmadd_ps(unsigned_sums(w2, xv, corr), _mm256_set1_ps(sb[2]), a2);
    a3 = _mm256_fmadd_ps(unsigned_sums(w3, xv, corr), _mm256_set1_ps(sb[3]), a3);
  }
  hsum4(a0, a1, a2, a3, out);
}
#endif

// Activations X (M, K) quantized as q8_0: a scale per 32 values (largest magnitude / 127), into XQ, XS; the
// values rounded to the nearest integer (ties to even, as std::nearbyint), eight at a time.
static void quantize_rows(const float* X, int64_t M, int64_t K, int8_t* XQ, float* XS) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs work per 128-bit half
  for (int64_t i = 0; i < M * K / 32; i++) {
    const float* v = X + 32 * i;
    __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16);
    __m256 v3 = _mm256_loadu_ps(v + 24);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                              _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    XS[i] = amax / 127.f;
    const __m256 mul = _mm256_set1_ps(inv);
    auto q = [&](__m256 x) {
      return _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(x, mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    };
    __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q(v0), q(v1)), _mm256_packs_epi32(q(v2), q(v3)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(XQ + 32 * i), _mm256_permutevar8x32_epi32(packed, order));
  }
}

// int8 weights (groups of four rows, above; N real rows of the 4 ceil(N / 4) stored): the groups are split
// over torch's threads; each group is read once from memory and, from the L1 cache, used for all M rows.
template <typename S>
static void q8_rows(const int8_t* XQ, const float* XS, int64_t M, int64_t K, const int8_t* W, const S* WS,
                    int64_t N, const float* b, float* Y) {
  const int64_t B = K / 32;
#ifdef GPTKIT_AVX512
  // From 8 rows on, dot_group_q8_rows (its group_corr_q8 pass costs about a row's work; same process, 2
  // threads, GPT-2 small's matrices: 0.7-1.0x at 2 rows, 0.8-1.1x at 4, 0.9-1.35x at 8 to 64).
  const bool many = M >= 8;
#endif
  at::parallel_for(0, (N + 3) / 4, 4, [&](int64_t lo, int64_t hi) {
    float out[4];
#ifdef GPTKIT_AVX512
    std::vector<int32_t> corr(many ? 32 * B : 0);
#endif
    for (int64_t g = lo; g < hi; g++) {
      const int rows = static_cast<int>(std::min<int64_t>(4, N - 4 * g));
      const int8_t* w = W + 4 * g * K;
      const S* ws = WS + 4 * g * B;
#ifdef GPTKIT_AVX512
      if (many) group_corr_q8(w, B, corr.data());
#endif
      for (int64_t m = 0; m < M; m++) {
#ifdef GPTKIT_AVX512
        if (many) dot_group_q8_rows(w, corr.data(), ws, B, XQ + m * K, XS + m * B, out); else
#endif
        dot_group_q8(w, ws, B, XQ + m * K, XS + m * B, out);
        for (int r = 0; r < rows; r++) Y[m * N + 4 * g + r] = out[r] + (b ? b[4 * g + r] : 0.f);
      }
    }
  });
}

// q4_0 weights (groups of four rows, two rows' values a byte: dot_group_q4): as q8_rows, each group read once
// (2 K bytes) and used from the L1 cache for all M rows; from Q4_UNPACK_ROWS rows on, unpacked once per group
// (its K * 4 bytes in int8's layout, in the L1 cache) instead of once per row: from 8 rows, where it measured
// faster, not from 4 (BENCHMARKS.md, "Speed: where q4_0's decode step went"). xc: each activation block's -8
// x's sum, made once.
// The unsigned formats' correction for their values' offset (q4_0's 8, q6_k's 32): -offset times the sum of
// each run of `run` quantized activations (n values in all), made once per product for every weight row.
static std::vector<int32_t> offset_sums(const int8_t* XQ, int64_t n, int run, int32_t offset) {
  std::vector<int32_t> out(n / run);
  for (int64_t i = 0; i < n / run; i++) {
    int32_t sum = 0;
    for (int j = 0; j < run; j++) sum += XQ[run * i + j];
    out[i] = -offset * sum;
  }
  return out;
}

#ifndef GPTKIT_Q4_UNPACK_ROWS
#define GPTKIT_Q4_UNPACK_ROWS 8
#endif
static constexpr int64_t Q4_UNPACK_ROWS = GPTKIT_Q4_UNPACK_ROWS;  // (-DGPTKIT_Q4_UNPACK_ROWS=N: benchmarks)
template <typename S>
static void q4_rows(const int8_t* XQ, const float* XS, int64_t M, int64_t K, const uint8_t* W, const S* WS,
                    int64_t N, const float* b, float* Y) {
  const int64_t B = K / 32;
  const std::vector<int32_t> xc = offset_sums(XQ, M * K, 32, 8);  // -8 x's sum per block
  const bool unpack = M >= Q4_UNPACK_ROWS;
  at::parallel_for(0, (N + 3) / 4, 4, [&](int64_t lo, int64_t hi) {
    float out[4];
    std::vector<uint8_t> unpacked(unpack ? 128 * B : 0);
    for (int64_t g = lo; g < hi; g++) {
      const int rows = static_cast<int>(std::min<int64_t>(4, N - 4 * g));
      const uint8_t* w = W + 2 * g * K;
      const S* ws = WS + 4 * g * B;
      if (unpack) unpack_group_q4(w, B, unpacked.data());
      for (int64_t m = 0; m < M; m++) {
        if (unpack) dot_group_q4<false, S>(unpacked.data(), ws, B, XQ + m * K, XS + m * B, xc.data() + m * B, out);
        else dot_group_q4<true, S>(w, ws, B, XQ + m * K, XS + m * B, xc.data() + m * B, out);
        for (int r = 0; r < rows; r++) Y[m * N + 4 * g + r] = out[r] + (b ? b[4 * g + r] : 0.f);
      }
    }
  });
}

// q6_k weights (llama.cpp's Q6_K values: super-blocks of 256 weights of a row, each run of 16 with its own int8
// scale sc and the super-block an fp16 d; each weight an unsigned 6-bit q, weight = d sc (q - 32)): the head of
// q4_0 models. Stored in the same groups of four rows, for each 32-value block 104 bytes (PackedLinear's layout,
// pack_q6_k): 64 bytes of low nibbles laid out as q4_0's (rows 0|2 in bytes 0-31, rows 1|3 in 32-63), 32 bytes
// of high bits (byte i: value i's top two bits of row r at bits 2r-2r+1), the 8 int8 scales of the block's two
// runs of 16 (row r's at 2r, 2r + 1); the d's apart, (N / 4, K / 256, 4) float16, read as q4_0's scales are.
// The unsigned q meet the q8 activations in the same dot-product instructions; each dpbusd (maddubs) lane sums
// four values of one run, so the runs' scales apply lane by lane: the lane's d sc (exact in float32) times the
// activations' scale, and -32 times each run's activation sum (xc, made once per product) added to one lane of
// the run. Packed: as stored, unpacked in registers; else a group unpacked once for all the rows of a batch
// (unpack_group_q6k: 128 bytes a block, the values as unsigned bytes, and the 8 d sc as floats): the same
// integers and floats in the same order, the same results to the bit.
// A super-block's d of the group's four rows, each twice (the order of a block's 8 run scales), as floats.
static inline __m256 q6k_d8(const at::Half* ds) {
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(scales4(ds)), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
}

static inline __m256 q6k_run_scales(const uint8_t* blk, __m256 d8) {  // a block's 8 runs' d sc, as floats
  const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 96))));
  return _mm256_mul_ps(sc, d8);
}

static inline void unpack_group_q6k(const uint8_t* w, const at::Half* ds, int64_t B, uint8_t* out, float* fs) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  for (int64_t b = 0; b < B; b++) {
    const uint8_t* blk = w + 104 * b;
    ahead(blk); ahead(blk + 64);
    const __m256i v02 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
    const __m256i v13 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64));
    __m256i* o = reinterpret_cast<__m256i*>(out + 128 * b);
    _mm256_storeu_si256(o, _mm256_or_si256(_mm256_and_si256(v02, nibble), _mm256_and_si256(_mm256_slli_epi16(h, 4), top)));
    _mm256_storeu_si256(o + 1, _mm256_or_si256(_mm256_and_si256(v13, nibble), _mm256_and_si256(_mm256_slli_epi16(h, 2), top)));
    _mm256_storeu_si256(o + 2, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v02, 4), nibble), _mm256_and_si256(h, top)));
    _mm256_storeu_si256(o + 3, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v13, 4), nibble),
                                               _mm256_and_si256(_mm256_srli_epi16(h, 2), top)));
    _mm256_storeu_ps(fs + 8 * b, q6k_run_scales(blk, q6k_d8(ds + 4 * (b / 8))));
  }
}

#ifdef GPTKIT_AVX512
template <bool Packed>
static inline void dot_group_q6k(const uint8_t* w, const at::Half* ds, const float* fs, int64_t B, const int8_t* x,
                                 const float* xs, const int32_t* xc, float* out) {
  const __m512i lanes01 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i lanes23 = _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7);
  const __m512i nibble = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  // the high bits' shifts, per 16-bit lane: rows 0 and 1 (left by 4 and 2), rows 2 and 3 (none, right by 2)
  const __m512i up01 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i down23 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  __m512 a01 = _mm512_setzero_ps(), a23 = a01, b01 = a01, b23 = a01;
  __m256 d8 = _mm256_setzero_ps();  // the super-block's d's (Packed)
  auto step = [&](int64_t b, __m512& c01, __m512& c23) {
    const __m512i xv = _mm512_broadcast_i64x4(load32(x + 32 * b));
    const __m512i corr = _mm512_mask_set1_epi32(_mm512_maskz_set1_epi32(0x0101, xc[2 * b]), 0x1010, xc[2 * b + 1]);
    __m512i w01, w23;
    __m256 runs;
    if constexpr (Packed) {
      const uint8_t* blk = w + 104 * b;
      ahead(blk); ahead(blk + 64);
      const __m512i v = _mm512_loadu_si512(blk);
      const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64)));
      w01 = _mm512_or_si512(_mm512_and_si512(v, nibble), _mm512_and_si512(_mm512_sllv_epi16(h, up01), top));
      w23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), nibble),
                            _mm512_and_si512(_mm512_srlv_epi16(h, down23), top));
      runs = q6k_run_scales(blk, d8);
    } else {
      w01 = _mm512_loadu_si512(w + 128 * b), w23 = _mm512_loadu_si512(w + 128 * b + 64);
      runs = _mm256_loadu_ps(fs + 8 * b);
    }
    const __m512 s = _mm512_castps256_ps512(_mm256_mul_ps(runs, _mm256_set1_ps(xs[b])));
    const __m512i d01 = _mm512_dpbusd_epi32(corr, w01, xv), d23 = _mm512_dpbusd_epi32(corr, w23, xv);
    c01 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d01), _mm512_permutexvar_ps(lanes01, s), c01);
    c23 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d23), _mm512_permutexvar_ps(lanes23, s), c23);
  };
  for (int64_t sb = 0; sb < B; sb += 8) {  // super-blocks of 8 blocks (K is a multiple of 256)
    if constexpr (Packed) { d8 = q6k_d8(ds + sb / 2); ahead(ds + sb / 2, PREFETCH_AHEAD / 104); }
    for (int64_t b = sb; b < sb + 8; b += 2) { step(b, a01, a23); step(b + 1, b01, b23); }
  }
  a01 = _mm512_add_ps(a01, b01); a23 = _mm512_add_ps(a23, b23);
  hsum4(_mm512_castps512_ps256(a01), high8(a01), _mm512_castps512_ps256(a23), high8(a23), out);
}
#else

template <bool Packed>
static inline void dot_group_q6k(const uint8_t* w, const at::Half* ds, const float* fs, int64_t B, const int8_t* x,
                                 const float* xs, const int32_t* xc, float* out) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  const __m256i r0 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), r1 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
  const __m256i r2 = _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), r3 = _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  __m256 d8 = _mm256_setzero_ps();  // the super-block's d's (Packed)
  for (int64_t b = 0; b < B; b++) {
    if (Packed && b % 8 == 0) { d8 = q6k_d8(ds + b / 2); ahead(ds + b / 2, PREFETCH_AHEAD / 104); }
    const __m256i xv = load32(x + 32 * b);
    const __m256i corr = _mm256_setr_epi32(xc[2 * b], 0, 0, 0, xc[2 * b + 1], 0, 0, 0);
    __m256i w0, w1, w2, w3;
    __m256 runs;
    if constexpr (Packed) {
      const uint8_t* blk = w + 104 * b;
      ahead(blk); ahead(blk + 64);
      const __m256i v02 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
      const __m256i v13 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64));
      w0 = _mm256_or_si256(_mm256_and_si256(v02, nibble), _mm256_and_si256(_mm256_slli_epi16(h, 4), top));
      w1 = _mm256_or_si256(_mm256_and_si256(v13, nibble), _mm256_and_si256(_mm256_slli_epi16(h, 2), top));
      w2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v02, 4), nibble), _mm256_and_si256(h, top));
      w3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v13, 4), nibble),
                           _mm256_and_si256(_mm256_srli_epi16(h, 2), top));
      runs = q6k_run_scales(blk, d8);
    } else {
      const uint8_t* u = w + 128 * b;
      w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u));
      w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 32));
      w2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 64));
      w3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 96));
      runs = _mm256_loadu_ps(fs + 8 * b);
    }
    const __m256 s = _mm256_mul_ps(runs, _mm256_set1_ps(xs[b]));
    a0 = _mm256_fmadd_ps(unsigned_sums(w0, xv, corr), _mm256_permutevar8x32_ps(s, r0), a0);
    a1 = _mm256_fmadd_ps(unsigned_sums(w1, xv, corr), _mm256_permutevar8x32_ps(s, r1), a1);
    a2 = _mm256_fmadd_ps(unsigned_sums(w2, xv, corr), _mm256_permutevar8x32_ps(s, r2), a2);
    a3 = _mm256_fmadd_ps(unsigned_sums(w3, xv, corr), _mm256_permutevar8x32_ps(s, r3), a3);
  }
  hsum4(a0, a1, a2, a3, out);
}
#endif

// q6_k weights (groups of four rows: dot_group_q6k; N real rows, K a multiple of 256): as q4_rows, each group
// read once (3.25 K bytes) and used from the L1 cache for all M rows, unpacked once per group from
// Q4_UNPACK_ROWS rows on. xc: each run of 16 activations' -32 x's sum, made once.
static void q6k_rows(const int8_t* XQ, const float* XS, int64_t M, int64_t K, const uint8_t* W, const at::Half* DS,
                     int64_t N, const float* b, float* Y) {
  const int64_t B = K / 32;
  const std::vector<int32_t> xc = offset_sums(XQ, M * K, 16, 32);  // -32 x's sum per run of 16
  const bool unpack = M >= Q4_UNPACK_ROWS;
  at::parallel_for(0, (N + 3) / 4, 4, [&](int64_t lo, int64_t hi) {
    float out[4];
    std::vector<uint8_t> unpacked(unpack ? 128 * B : 0);
    std::vector<float> fs(unpack ? 8 * B : 0);
    for (int64_t g = lo; g < hi; g++) {
      const int rows = static_cast<int>(std::min<int64_t>(4, N - 4 * g));
      const uint8_t* w = W + 104 * g * B;
      const at::Half* ds = DS + 4 * g * (B / 8);
      if (unpack) unpack_group_q6k(w, ds, B, unpacked.data(), fs.data());
      for (int64_t m = 0; m < M; m++) {
        if (unpack) dot_group_q6k<false>(unpacked.data(), ds, fs.data(), B, XQ + m * K, XS + m * B, xc.data() + 2 * m * B, out);
        else dot_group_q6k<true>(w, ds, nullptr, B, XQ + m * K, XS + m * B, xc.data() + 2 * m * B, out);
        for (int r = 0; r < rows; r++) Y[m * N + 4 * g + r] = out[r] + (b ? b[4 * g + r] : 0.f);
      }
    }
  });
}

// A packed weight: float32, float16, int8 or q4_0 (uint8: two values a byte; int8 and q4_0 with their scales,
// float32 or float16; n: its real rows), and its bias (or none).
struct Packed {
  at::Tensor w;
  c10::optional<at::Tensor> s, b;
  int64_t n;
};

// Y (M, n) = X (M, K) @ W^T + b into Y. xq, xs: room for int8's quantized activations (M K bytes, M K / 32
// floats). float32 batches of more than 64 rows go to torch's matrix product (as fast or faster there).
static void linear_into(const float* X, int64_t M, int64_t K, const Packed& p, float* Y, int8_t* xq, float* xs) {
  const int64_t N = p.n;
  const float* b = p.b.has_value() ? p.b->data_ptr<float>() : nullptr;
  if (p.w.scalar_type() == at::kFloat && M > 64) {
    auto opts = at::TensorOptions().dtype(at::kFloat);
    auto x = at::from_blob(const_cast<float*>(X), {M, K}, opts), y = at::from_blob(Y, {M, N}, opts);
    if (b) at::addmm_out(y, *p.b, x, p.w.t()); else at::mm_out(y, x, p.w.t());
  } else if (p.w.scalar_type() == at::kFloat && M >= 4) {
    tiled_rows(X, M, K, p.w.data_ptr<float>(), N, b, Y);
  } else if (p.w.scalar_type() == at::kFloat) {
    wide_rows(X, M, K, p.w.data_ptr<float>(), N, b, Y);
  } else if (p.w.scalar_type() == at::kHalf) {
    wide_rows(X, M, K, p.w.data_ptr<at::Half>(), N, b, Y);
  } else {  // int8, q8_0, q4_0: the activations quantized, then the integer products with either scale type
    quantize_rows(X, M, K, xq, xs);
    auto rows = [&](auto* WS) {
      if (p.w.scalar_type() == at::kByte) q4_rows(xq, xs, M, K, p.w.data_ptr<uint8_t>(), WS, N, b, Y);
      else q8_rows(xq, xs, M, K, p.w.data_ptr<int8_t>(), WS, N, b, Y);
    };
    if (p.s->scalar_type() == at::kHalf) rows(p.s->data_ptr<at::Half>()); else rows(p.s->data_ptr<float>());
  }
}

static void check_packed(const at::Tensor& x, const Packed& p) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 (M, K)");
  const bool q4 = p.w.scalar_type() == at::kByte, grouped = q4 || p.w.scalar_type() == at::kChar;
  TORCH_CHECK(p.w.dim() == 2 && p.w.is_contiguous() && p.w.size(1) * (q4 ? 2 : 1) == x.size(1) &&
              x.size(1) % 32 == 0, "w: contiguous (N, K) (q4_0: (N, K / 2) bytes), K a multiple of 32");
  TORCH_CHECK(!grouped ||
              (p.s.has_value() && (p.s->scalar_type() == at::kFloat || p.s->scalar_type() == at::kHalf) &&
               p.s->is_contiguous() && p.w.size(0) % 4 == 0 &&
               p.n <= p.w.size(0) && p.s->numel() == p.w.size(0) * x.size(1) / 32),
              "int8/q4_0 w: groups of 4 rows and their float32 (or float16) scales");
  TORCH_CHECK(grouped || p.n == p.w.size(0), "n: w's rows");
  TORCH_CHECK(!p.b.has_value() || (p.b->is_contiguous() && p.b->numel() == p.n), "bias: (n,)");
}

// The Linear layers' products as operators: y (M, n) = x (M, K) @ w (N, K)^T + bias.
static at::Tensor linear(at::Tensor x, Packed p) {
  check_packed(x, p);
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, p.n}, x.options());
  auto xq = at::empty({p.s.has_value() ? M * K : 0}, x.options().dtype(at::kChar));
  auto xs = at::empty({p.s.has_value() ? M * K / 32 : 0}, x.options());
  linear_into(x.data_ptr<float>(), M, K, p, y.data_ptr<float>(), xq.data_ptr<int8_t>(), xs.data_ptr<float>());
  return y;
}

at::Tensor linear_f32(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  return linear(x, {w, c10::nullopt, bias, w.size(0)});
}
at::Tensor linear_f16(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  return linear(x, {w, c10::nullopt, bias, w.size(0)});
}
at::Tensor linear_q8(at::Tensor x, at::Tensor w, at::Tensor ws, c10::optional<at::Tensor> bias,
                        int64_t n) {
  return linear(x, {w, ws, bias, n});
}
at::Tensor linear_q4(at::Tensor x, at::Tensor w, at::Tensor ws, c10::optional<at::Tensor> bias,
                        int64_t n) {
  TORCH_CHECK(w.scalar_type() == at::kByte, "q4_0 w: uint8, two values a byte");
  return linear(x, {w, ws, bias, n});
}

// q6_k's product (the head of q4_0 models): y (M, n) = x (M, K) @ w^T + bias, w (N4, 13 K / 16) bytes in
// pack_q6_k's layout, ds (N4, K / 256) float16 (the super-blocks' d), K a multiple of 256.
at::Tensor linear_q6k(at::Tensor x, at::Tensor w, at::Tensor ds, c10::optional<at::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 (M, K)");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 256 == 0 && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() &&
              w.size(0) % 4 == 0 && w.size(1) * 16 == K * 13 && n <= w.size(0),
              "q6_k w: uint8 (N4, 13 K / 16), groups of 4 rows, K a multiple of 256");
  TORCH_CHECK(ds.scalar_type() == at::kHalf && ds.is_contiguous() && ds.numel() == w.size(0) * K / 256,
              "q6_k ds: float16 (N4, K / 256)");
  TORCH_CHECK(!bias.has_value() || (bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == n),
              "bias: (n,)");
  auto y = at::empty({M, n}, x.options());
  auto xq = at::empty({M * K}, x.options().dtype(at::kChar));
  auto xs = at::empty({M * K / 32}, x.options());
  quantize_rows(x.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), xs.data_ptr<float>());
  q6k_rows(xq.data_ptr<int8_t>(), xs.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), ds.data_ptr<at::Half>(), n,
           bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y;
}

// ------------------------------------------------------------------------------------------ the fused block

// e^x for 8 floats (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial; relative error
// ~1e-7), x clamped to [-87.3, 88.3] so that 2^n stays a normal float.
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// GPT-2's GELU (tanh form), in place on n values (n a multiple of 8):
// 0.5 x (1 + tanh(u)) = x sigmoid(2u) = x / (1 + e^(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3).
static void gelu_tanh(float* y, int64_t n) {
  const __m256 c = _mm256_set1_ps(-2.f * 0.7978845608028654f), c3 = _mm256_set1_ps(0.044715f);
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 8) {
    __m256 x = _mm256_loadu_ps(y + i);
    __m256 u = _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_mul_ps(c3, x), _mm256_mul_ps(x, x), x));
    _mm256_storeu_ps(y + i, _mm256_div_ps(x, _mm256_add_ps(one, exp8(u))));
  }
}

// LayerNorm of M rows of C values (x -> y), gain w and bias b (or none).
static void layer_norm(const float* x, int64_t M, int64_t C, const float* w, const float* b, float eps, float* y) {
  for (int64_t m = 0; m < M; m++) {
    const float* v = x + m * C; float* out = y + m * C;
    double mean = 0.0, var = 0.0;
    for (int64_t i = 0; i < C; i++) mean += v[i];
    mean /= C;
    for (int64_t i = 0; i < C; i++) var += (v[i] - mean) * (v[i] - mean);
    const float mu = static_cast<float>(mean), rstd = static_cast<float>(1.0 / std::sqrt(var / C + eps));
    for (int64_t i = 0; i < C; i++) out[i] = (v[i] - mu) * rstd * w[i] + (b ? b[i] : 0.f);
  }
}

// A row of D floats into the cache: float32 as it is, float16 rounded to the nearest (F16C; ties to even, as
// torch's conversion rounds, so the fused step writes what Block's forward writes).
static inline void store_row(float* dst, const float* src, int64_t D) { std::memcpy(dst, src, D * sizeof(float)); }
static inline void store_row(at::Half* dst, const float* src, int64_t D) {
  for (int64_t d = 0; d < D; d += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// One row's query head q (D floats) over its cache slots 0..n-1 (kc, vc: that row and head's keys and values,
// float32 or float16, L slots of D), its own key and value written at slot n - 1 first: softmax(q.k / sqrt(D))
// weighted values into o. s: room for n scores.
template <typename T>
static void attend(const float* q, const float* k_new, const float* v_new, T* kc, T* vc, int64_t n, int64_t D,
                   float scale, float* s, float* o) {
  store_row(kc + (n - 1) * D, k_new, D);
  store_row(vc + (n - 1) * D, v_new, D);
  float mx = -INFINITY;
  int64_t j0 = 0;
  for (; j0 + 4 <= n; j0 += 4) {  // four keys at a time: four independent chains
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const T* kj = kc + j0 * D;
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      a0 = _mm256_fmadd_ps(qv, load8(kj + d), a0);
      a1 = _mm256_fmadd_ps(qv, load8(kj + D + d), a1);
      a2 = _mm256_fmadd_ps(qv, load8(kj + 2 * D + d), a2);
      a3 = _mm256_fmadd_ps(qv, load8(kj + 3 * D + d), a3);
    }
    hsum4(a0, a1, a2, a3, s + j0);
    for (int r = 0; r < 4; r++) { s[j0 + r] *= scale; mx = std::max(mx, s[j0 + r]); }
  }
  for (; j0 < n; j0++) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(kc + j0 * D + d), acc);
    s[j0] = hsum(acc) * scale;
    mx = std::max(mx, s[j0]);
  }
  __m256 sum8 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(mx)));
    _mm256_storeu_ps(s + j, e); sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum(sum8);
  for (; j < n; j++) { s[j] = std::exp(s[j] - mx); sum += s[j]; }
  const float inv = 1.f / sum;
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) {  // 64 channels at a time: eight independent chains, each value row read once
    __m256 acc[8];
    for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t jj = 0; jj < n; jj++) {
      const __m256 pj = _mm256_set1_ps(s[jj]);
      const T* vr = vc + jj * D + d;
      for (int r = 0; r < 8; r++) acc[r] = _mm256_fmadd_ps(pj, load8(vr + 8 * r), acc[r]);
    }
    for (int r = 0; r < 8; r++) _mm256_storeu_ps(o + d + 8 * r, _mm256_mul_ps(acc[r], _mm256_set1_ps(inv)));
  }
  for (; d < D; d += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t jj = 0; jj < n; jj++) acc = _mm256_fmadd_ps(_mm256_set1_ps(s[jj]), load8(vc + jj * D + d), acc);
    _mm256_storeu_ps(o + d, _mm256_mul_ps(acc, _mm256_set1_ps(inv)));
  }
}

// One GPT-2 block for M rows of one token each, row i at position pos[i] of cache row row0 + i:
//   x + attn(ln_1(x)), then + mlp(ln_2(x)), the attention over each row's slots 0..pos[i] (its own token's
//   key and value written there first).
// p: ln_1 gain, bias; c_attn w, s, b; attn c_proj w, s, b; ln_2 gain, bias; c_fc w, s, b; mlp c_proj w, s, b
// (s: int8's and q4_0's scales, else none; biases may be none). k, v: the layer's cache (R, H, L, D), float32
// or float16 (both alike).
at::Tensor block_decode(at::Tensor x, c10::List<c10::optional<at::Tensor>> p, at::Tensor k,
                           at::Tensor v, int64_t row0, at::Tensor pos, int64_t n_head, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 (M, C)");
  TORCH_CHECK(p.size() == 16, "16 block parameters");
  TORCH_CHECK((k.scalar_type() == at::kFloat || k.scalar_type() == at::kHalf) &&
              v.scalar_type() == k.scalar_type() && k.is_contiguous() && v.is_contiguous() && k.dim() == 4 &&
              k.sizes() == v.sizes(), "k, v: float32 or float16 caches (R, H, L, D)");
  const int64_t M = x.size(0), C = x.size(1), H = n_head, D = C / H, L = k.size(2), F = p.get(10)->size(0);
  TORCH_CHECK(k.size(1) == H && k.size(3) == D && D % 8 == 0 && row0 >= 0 && row0 + M <= k.size(0),
              "the cache's rows and heads");
  TORCH_CHECK(pos.scalar_type() == at::kLong && (pos.numel() == 1 || pos.numel() == M), "pos: (1,) or (M,)");
  auto P = [&](int i) { return p.get(i); };
  auto ptr = [&](int i) -> const float* { auto t = p.get(i); return t.has_value() ? t->data_ptr<float>() : nullptr; };
  Packed qkv{*P(2), P(3), P(4), 3 * C}, proj{*P(5), P(6), P(7), C}, fc{*P(10), P(11), P(12), F},
      out{*P(13), P(14), P(15), C};
  for (const Packed* q : {&qkv, &proj, &fc, &out}) TORCH_CHECK(q->w.size(0) == q->n, "block weights' rows");
  auto pos_c = pos.contiguous();
  const int64_t* ps = pos_c.data_ptr<int64_t>();
  std::vector<int64_t> at_pos(M);
  for (int64_t i = 0; i < M; i++) {
    at_pos[i] = ps[pos.numel() == 1 ? 0 : i];
    TORCH_CHECK(0 <= at_pos[i] && at_pos[i] < L, "position outside the cache");
  }

  auto y = at::empty({M, C}, x.options());
  // Scratch: h (M C), qkv (M 3C), attention output (M C), the MLP's hidden (M F), scores (M H L).
  auto scratch = at::empty({M * (5 * C + F) + M * H * L}, x.options());
  float* h = scratch.data_ptr<float>(); float* q3 = h + M * C; float* att = q3 + 3 * M * C;
  float* hid = att + M * C; float* scores = hid + M * F;
  auto xq = at::empty({M * F}, x.options().dtype(at::kChar));
  auto xs = at::empty({M * F / 32}, x.options());
  int8_t* XQ = xq.data_ptr<int8_t>(); float* XS = xs.data_ptr<float>();
  const float* X = x.data_ptr<float>(); float* Y = y.data_ptr<float>();

  layer_norm(X, M, C, ptr(0), ptr(1), eps, h);
  linear_into(h, M, C, qkv, q3, XQ, XS);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  auto attention = [&](auto* Kc, auto* Vc) {
    at::parallel_for(0, M * H, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; t++) {
        const int64_t i = t / H, hd = t % H;
        const float* q = q3 + i * 3 * C + hd * D;
        const int64_t at_cache = ((row0 + i) * H + hd) * L * D;
        attend(q, q + C, q + 2 * C, Kc + at_cache, Vc + at_cache, at_pos[i] + 1, D, scale, scores + t * L,
               att + i * C + hd * D);
      }
    });
  };
  if (k.scalar_type() == at::kHalf) attention(k.data_ptr<at::Half>(), v.data_ptr<at::Half>());
  else attention(k.data_ptr<float>(), v.data_ptr<float>());
  linear_into(att, M, C, proj, Y, XQ, XS);
  for (int64_t i = 0; i < M * C; i++) Y[i] += X[i];  // the residual
  layer_norm(Y, M, C, ptr(8), ptr(9), eps, h);
  linear_into(h, M, C, fc, hid, XQ, XS);
  gelu_tanh(hid, M * F);
  linear_into(hid, M, F, out, att, XQ, XS);
  for (int64_t i = 0; i < M * C; i++) Y[i] += att[i];
  return y;
}

