/* Compiled CPU kernels for one greedy decode step (kvbench; see kvbench/cpu_decode.py, which builds
 * and loads this file). A decode step reads every weight once and every cached key and value
 * once, a few MB at a time; it should run at the machine's read bandwidth.
 *
 * 1. kvb_gemv: y = W·x (+ b) for one token, W (N × K) output-major (PyTorch's nn.Linear layout,
 *    rows ldw floats apart). Four rows at a time share each 16-float slice of x; the rows are
 *    split into `parts` contiguous ranges (multiples of 4), one per OpenMP thread. Measured on
 *    2 cores (AMD EPYC, SmolLM2-135M's 211 projections and lm_head, 538 MB): 21 ms per step
 *    against 35 ms for MKL's sgemm on the input-major layout, which ran on one thread.
 * 2. kvb_decode_attention: softmax(scale·q·Kᵀ + bias)·V for one query token, grouped-query
 *    attention without repeating the cache: the G query heads of a KV head are G rows against
 *    that head's keys (Ainslie et al. 2023). The keys of each head are split into `chunks`
 *    contiguous ranges (tasks = heads × chunks, shared out over the threads); each task runs
 *    an online softmax (Milakov & Gimelshein 2018) over blocks of 64 keys, and the partial
 *    results (running max, sum, unnormalised output) are combined exactly at the end, as
 *    split-K flash decoding does. A bias of −inf (an invalid slot) gives the key probability 0.
 *
 * Both need AVX-512 (kvb_decode_has_avx512 says whether this build has it; the Python side
 * uses PyTorch operations otherwise). Built without -ffast-math: −inf biases must compare and
 * propagate as IEEE says. The exponential is a degree-6 polynomial after range reduction
 * (relative error about 2e-7, the order of float32 rounding), exactly 0 below −87.3 (where
 * expf underflows to subnormals). Results equal PyTorch's (F.linear, SDPA) within float32
 * rounding of a different summation order (tests: tests/kvbench/test_cpu_decode.py).
 * Layouts (float32):
 *   gemv:      W rows ldw apart, stride 1 within a row; x (K); b (N) or NULL; y (N)
 *   attention: q (heads, G, d) contiguous; head h's key j at k + h·kv_stride + j·d (v likewise);
 *              bias row (h, g) at bias + (h·G + g)·bias_ld, T floats, or NULL; out (heads, G, d);
 *              scratch (heads·chunks·G·(d + 2)) floats.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define KVB_MAX_G 16
#define KVB_MAX_D 256
#define KVB_BLOCK 64
#ifndef KVB_PREFETCH
#define KVB_PREFETCH 256 /* keys ahead */
#endif
#ifndef KVB_HINT
#define KVB_HINT _MM_HINT_T1
#endif

int kvb_decode_has_avx512(void) {
#ifdef __AVX512F__
  return 1;
#else
  return 0;
#endif
}

#ifdef __AVX512F__

static void gemv_rows(const float *W, int64_t ldw, const float *x, const float *bias, float *y, int64_t r0,
                      int64_t r1, int64_t K) {
  const int64_t kv = K & ~(int64_t)15;
  const __mmask16 tail = (__mmask16)((1u << (K - kv)) - 1u);
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const float *w0 = W + r * ldw, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i < kv; i += 16) {
      const __m512 xv = _mm512_loadu_ps(x + i);
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + i), xv, a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w1 + i), xv, a1);
      a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w2 + i), xv, a2);
      a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w3 + i), xv, a3);
    }
    if (tail) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, x + i);
      a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w0 + i), xv, a0);
      a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w1 + i), xv, a1);
      a2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w2 + i), xv, a2);
      a3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w3 + i), xv, a3);
    }
    y[r] = _mm512_reduce_add_ps(a0) + (bias ? bias[r] : 0.0f);
    y[r + 1] = _mm512_reduce_add_ps(a1) + (bias ? bias[r + 1] : 0.0f);
    y[r + 2] = _mm512_reduce_add_ps(a2) + (bias ? bias[r + 2] : 0.0f);
    y[r + 3] = _mm512_reduce_add_ps(a3) + (bias ? bias[r + 3] : 0.0f);
  }
  for (; r < r1; ++r) {
    const float *w = W + r * ldw;
    __m512 a = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i < kv; i += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), a);
    if (tail) a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w + i), _mm512_maskz_loadu_ps(tail, x + i), a);
    y[r] = _mm512_reduce_add_ps(a) + (bias ? bias[r] : 0.0f);
  }
}

int kvb_gemv(const float *W, int64_t ldw, const float *x, const float *bias, float *y, int64_t N, int64_t K,
             int64_t parts) {
  if (parts < 1 || N < 0 || K < 0 || ldw < K) return 1;
  if (parts == 1 || N < 64) {
    gemv_rows(W, ldw, x, bias, y, 0, N, K);
    return 0;
  }
#pragma omp parallel for schedule(static, 1) num_threads((int)parts)
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t r0 = (N * p / parts) & ~(int64_t)3;
    const int64_t r1 = p == parts - 1 ? N : (N * (p + 1) / parts) & ~(int64_t)3;
    gemv_rows(W, ldw, x, bias, y, r0, r1, K);
  }
  return 0;
}

/* exp(x) for 16 lanes; exactly 0 for x < -87.3 (−inf included), x ≤ 0 in this file's use. */
static inline __m512 exp512(__m512 x) {
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f)); /* −inf → a finite value; masked to 0 below */
  x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x); /* ln 2 = hi + lo (Cody–Waite) */
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps((__mmask16)~under, _mm512_scalef_ps(p, n));
}

/* The 16 horizontal sums of v[0..15], in order, as one vector (a transpose-and-add tree:
 * 45 shuffles and adds instead of 16 separate reductions). */
static inline __m512 reduce16(const __m512 *v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) /* per 128-bit lane: [v0 0+2, v1 0+2, v0 1+3, v1 1+3] */
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) { /* per 128-bit lane: the lane's sums of v[4i .. 4i+3] */
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* acc (GT rows d apart, 64 floats each) += Σ_jj p[g][jj]·v_jj[0..64): GT·4 accumulators in
 * registers (independent FMA chains), each value slice loaded once for the GT rows. p rows are
 * KVB_BLOCK floats apart. */
#define KVB_PV_TILE(GT)                                                                           \
  static void pv_tile##GT(const float *p, const float *vb, int64_t d, int64_t nb, float *acc) {   \
    __m512 o[GT][4];                                                                              \
    for (int g = 0; g < GT; ++g)                                                                  \
      for (int c = 0; c < 4; ++c) o[g][c] = _mm512_loadu_ps(acc + g * d + 16 * c);                \
    for (int64_t jj = 0; jj < nb; ++jj) {                                                         \
      const float *vj = vb + jj * d;                                                              \
      const __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16), v2 = _mm512_loadu_ps(vj + 32), \
                   v3 = _mm512_loadu_ps(vj + 48);                                                 \
      for (int g = 0; g < GT; ++g) {                                                              \
        const __m512 pg = _mm512_set1_ps(p[g * KVB_BLOCK + jj]);                                  \
        o[g][0] = _mm512_fmadd_ps(pg, v0, o[g][0]);                                               \
        o[g][1] = _mm512_fmadd_ps(pg, v1, o[g][1]);                                               \
        o[g][2] = _mm512_fmadd_ps(pg, v2, o[g][2]);                                               \
        o[g][3] = _mm512_fmadd_ps(pg, v3, o[g][3]);                                               \
      }                                                                                           \
    }                                                                                             \
    for (int g = 0; g < GT; ++g)                                                                  \
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + g * d + 16 * c, o[g][c]);                \
  }
KVB_PV_TILE(1)
KVB_PV_TILE(2)
KVB_PV_TILE(3)
KVB_PV_TILE(4)

/* One task: keys j0 .. j1 of head h for its G query rows; writes m (G), l (G), acc (G × d). */
static void attention_task(const float *q, const float *k, const float *v, const float *bias, int64_t bias_ld,
                           int64_t G, int64_t d, float scale, int64_t j0, int64_t j1, float *m, float *l,
                           float *acc) {
  float s[KVB_MAX_G][KVB_BLOCK] __attribute__((aligned(64)));
  const int64_t nc = d / 16;
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
    for (int64_t c = 0; c < d; ++c) acc[g * d + c] = 0.0f;
  }
  for (int64_t b0 = j0; b0 < j1; b0 += KVB_BLOCK) {
    const int64_t nb = j1 - b0 < KVB_BLOCK ? j1 - b0 : KVB_BLOCK;
    /* logits, 16 keys at a time: s[g][jj] = scale·q_g·k_j (+ bias); keys past the task: −inf */
    for (int64_t j16 = 0; j16 < nb; j16 += 16) {
      const int64_t left = nb - j16 < 16 ? nb - j16 : 16;
      const __mmask16 valid = left == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
      const float *kb = k + (b0 + j16) * d;
      if (b0 + j16 + KVB_PREFETCH + 16 <= j1) { /* these 16 keys' and values' lines, KVB_PREFETCH keys ahead */
        const char *pk = (const char *)(kb + KVB_PREFETCH * d), *pv = (const char *)(v + (b0 + j16 + KVB_PREFETCH) * d);
        for (int64_t off = 0; off < 16 * d * 4; off += 64) {
          _mm_prefetch(pk + off, KVB_HINT);
          _mm_prefetch(pv + off, KVB_HINT);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        __m512 prod[16];
        for (int64_t jj = 0; jj < 16; ++jj) prod[jj] = _mm512_setzero_ps();
        for (int64_t c = 0; c < nc; ++c) {
          const __m512 qc = _mm512_loadu_ps(q + g * d + 16 * c);
          for (int64_t jj = 0; jj < left; ++jj)
            prod[jj] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(kb + jj * d + 16 * c), prod[jj]);
        }
        __m512 lg = _mm512_mul_ps(sv, reduce16(prod));
        if (bias) lg = _mm512_add_ps(lg, _mm512_maskz_loadu_ps(valid, bias + g * bias_ld + b0 + j16));
        _mm512_store_ps(s[g] + j16, _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), lg));
      }
    }
    const int64_t nb16 = (nb + 15) & ~(int64_t)15;
    for (int64_t g = 0; g < G; ++g) {
      float *sg = s[g];
      __m512 mx = _mm512_load_ps(sg);
      for (int64_t c = 16; c < nb16; c += 16) mx = _mm512_max_ps(mx, _mm512_load_ps(sg + c));
      const float bm = _mm512_reduce_max_ps(mx);
      if (!(bm > -INFINITY)) { /* every key of this block masked for this row */
        for (int64_t jj = 0; jj < nb16; ++jj) sg[jj] = 0.0f;
        continue;
      }
      const float mnew = bm > m[g] ? bm : m[g];
      const float alpha = m[g] > -INFINITY ? expf(m[g] - mnew) : 0.0f;
      m[g] = mnew;
      __m512 sum = _mm512_setzero_ps();
      const __m512 mv = _mm512_set1_ps(mnew);
      for (int64_t c = 0; c < nb16; c += 16) {
        const __m512 p = exp512(_mm512_sub_ps(_mm512_load_ps(sg + c), mv));
        _mm512_store_ps(sg + c, p);
        sum = _mm512_add_ps(sum, p);
      }
      l[g] = l[g] * alpha + _mm512_reduce_add_ps(sum);
      if (alpha != 1.0f) {
        const __m512 av = _mm512_set1_ps(alpha);
        for (int64_t c = 0; c < nc; ++c)
          _mm512_storeu_ps(acc + g * d + 16 * c, _mm512_mul_ps(av, _mm512_loadu_ps(acc + g * d + 16 * c)));
      }
    }
    /* acc[g] += Σ_jj p[g][jj]·v_j: tiles of up to 4 rows × 64 output floats in registers, each
     * value slice loaded once per tile; the last d % 64 floats one slice at a time */
    const int64_t c64 = d & ~(int64_t)63;
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const int64_t gt = G - g0 < 4 ? G - g0 : 4;
      for (int64_t c0 = 0; c0 < c64; c0 += 64) {
        switch (gt) {
          case 1: pv_tile1(s[g0], v + b0 * d + c0, d, nb, acc + g0 * d + c0); break;
          case 2: pv_tile2(s[g0], v + b0 * d + c0, d, nb, acc + g0 * d + c0); break;
          case 3: pv_tile3(s[g0], v + b0 * d + c0, d, nb, acc + g0 * d + c0); break;
          default: pv_tile4(s[g0], v + b0 * d + c0, d, nb, acc + g0 * d + c0); break;
        }
      }
      for (int64_t g = g0; g < g0 + gt; ++g)
        for (int64_t c = c64; c < d; c += 16) {
          __m512 o = _mm512_loadu_ps(acc + g * d + c);
          for (int64_t jj = 0; jj < nb; ++jj)
            o = _mm512_fmadd_ps(_mm512_set1_ps(s[g][jj]), _mm512_loadu_ps(v + (b0 + jj) * d + c), o);
          _mm512_storeu_ps(acc + g * d + c, o);
        }
    }
  }
}

int kvb_decode_attention(const float *q, const float *k, const float *v, int64_t kv_stride, const float *bias,
                         int64_t bias_ld, float *out, float *scratch, int64_t heads, int64_t G, int64_t T, int64_t d,
                         float scale, int64_t chunks, int64_t parts) {
  if (G < 1 || G > KVB_MAX_G || d < 16 || d > KVB_MAX_D || d % 16 || chunks < 1 || parts < 1 || T < 1) return 1;
  const int64_t tasks = heads * chunks, per = G * (d + 2);
#pragma omp parallel for schedule(static, 1) num_threads((int)parts)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t h = t / chunks, c = t % chunks;
    const int64_t j0 = T * c / chunks, j1 = T * (c + 1) / chunks;
    float *part = scratch + t * per;
    attention_task(q + h * G * d, k + h * kv_stride, v + h * kv_stride, bias ? bias + h * G * bias_ld : 0, bias_ld,
                   G, d, scale, j0, j1, part, part + G, part + 2 * G);
  }
  /* combine the chunks: out = Σ_c e^{m_c − M}·acc_c / Σ_c e^{m_c − M}·l_c */
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t g = 0; g < G; ++g) {
      float M = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) {
        const float mc = scratch[(h * chunks + c) * per + g];
        M = mc > M ? mc : M;
      }
      float *o = out + (h * G + g) * d;
      for (int64_t i = 0; i < d; ++i) o[i] = 0.0f;
      if (!(M > -INFINITY)) { /* every key masked: NaN, as a softmax over nothing */
        for (int64_t i = 0; i < d; ++i) o[i] = NAN;
        continue;
      }
      float L = 0.0f;
      for (int64_t c = 0; c < chunks; ++c) {
        const float *part = scratch + (h * chunks + c) * per;
        if (!(part[g] > -INFINITY)) continue;
        const float w = expf(part[g] - M);
        L += w * part[G + g];
        const float *a = part + 2 * G + g * d;
        for (int64_t i = 0; i < d; ++i) o[i] += w * a[i];
      }
      const float inv = 1.0f / L;
      for (int64_t i = 0; i < d; ++i) o[i] *= inv;
    }
  return 0;
}

#else /* no AVX-512: the Python side does not call these (kvb_decode_has_avx512() == 0) */

int kvb_gemv(const float *W, int64_t ldw, const float *x, const float *bias, float *y, int64_t N, int64_t K,
             int64_t parts) {
  (void)W; (void)ldw; (void)x; (void)bias; (void)y; (void)N; (void)K; (void)parts;
  return 2;
}

int kvb_decode_attention(const float *q, const float *k, const float *v, int64_t kv_stride, const float *bias,
                         int64_t bias_ld, float *out, float *scratch, int64_t heads, int64_t G, int64_t T, int64_t d,
                         float scale, int64_t chunks, int64_t parts) {
  (void)q; (void)k; (void)v; (void)kv_stride; (void)bias; (void)bias_ld; (void)out; (void)scratch; (void)heads;
  (void)G; (void)T; (void)d; (void)scale; (void)chunks; (void)parts;
  return 2;
}

#endif
