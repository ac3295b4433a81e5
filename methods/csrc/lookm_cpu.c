/* Compiled CPU kernels for LOOK-M (kvbench; see methods/cpu_kernels.py, which builds and loads this file).
 *
 * 1. kvb_attention_column_sums: causal attention of the last W prompt queries over the n prompt
 *    keys and, from the same probabilities, the column sums of the softmax matrix (LOOK-M's
 *    cumulative score, Wan et al. 2024; H2O's accumulated attention). One block of query rows at a
 *    time: S = scale·Q_blk·K^T (BLAS sgemm) into a cache-sized buffer, an exact row softmax over
 *    the keys each row may see (one exp per causal (query, key) pair, no online rescaling since
 *    the whole row is in the buffer), the column sums, then O_blk = E·V (sgemm, E = the
 *    unnormalised exponentials) with each row scaled by its 1 / Σ exp (one write pass over the
 *    buffer fewer than normalising it). The probabilities never leave the cache.
 * 2. kvb_nearest_kept: for unit-norm evicted keys, the most cosine-similar unit-norm kept key
 *    (LOOK-M's merge target), one block of evicted rows at a time: S = E_blk·K^T (sgemm) and a
 *    row argmax in the cache (first index of the maximum, as torch.max on CPU).
 *
 * The BLAS sgemm (Fortran interface) comes as a pointer (torch's own MKL, resolved by the Python
 * side). Called inside the OpenMP region, MKL runs each product on the calling thread. (Setting
 * MKL's thread-local thread count here would outlive the region on the calling thread, the
 * one that runs torch's own matrix products: measured 2x slower linear layers afterwards.)
 * Work is split into `parts` contiguous ranges of work items, cuts[p] .. cuts[p+1] (the Python
 * side balances them); an OpenMP parallel region runs the parts, each part single-threaded with its own scratch (and column-sum buffer). This
 * library links libgomp.so.1, the OpenMP runtime torch has already loaded, so the parts run on
 * torch's own intra-op threads (no second thread pool competing for the cores). Part p always
 * covers the same items, whichever thread runs it: results do not depend on scheduling.
 * Layouts (float32, contiguous):
 *   q   (B, H_kv, W, G, d)   the W queries of each KV head's G query heads, row (w, g)
 *   k,v (B, H_kv, n, d)
 *   out (B, H_kv, W, G, d)   may be NULL (column sums only)
 *   sums(B, H_kv, G, n)      accumulated (+=), the caller zeroes it
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef void (*kvb_sgemm_t)(const char *, const char *, const int *, const int *, const int *, const float *,
                            const float *, const int *, const float *, const int *, const float *, float *,
                            const int *);

static int attention_part(void *sgemm_p, const float *q, const float *k, const float *v,
                          float *out, float *sums, float *scratch, int64_t heads, int64_t g, int64_t w, int64_t n,
                          int64_t d, float scale, float softcap, int64_t block, int64_t item_begin,
                          int64_t item_end) {
  kvb_sgemm_t sgemm = (kvb_sgemm_t)sgemm_p;
  const int64_t nblocks = (w + block - 1) / block, first = n - w;
  const float one = 1.0f, zero = 0.0f;
  const float alpha = softcap > 0.0f ? 1.0f : scale;
  const int di = (int)d;
  float *row_inv = scratch + block * g * n; /* block·g floats after the logits */
  for (int64_t it = item_begin; it < item_end; ++it) {
    const int64_t blk = it % nblocks, bh = it / nblocks;
    if (bh >= heads) return 1;
    const int64_t r0 = blk * block, r1 = r0 + block < w ? r0 + block : w;
    int rows = (int)((r1 - r0) * g), keys = (int)(first + r1);
    const float *Q = q + (bh * w + r0) * g * d;
    /* S (rows × keys, row-major) = alpha · Q_blk · K^T: column-major S^T = K · Q_blk^T */
    sgemm("T", "N", &keys, &rows, &di, &alpha, k + bh * n * d, &di, Q, &di, &zero, scratch, &keys);
    for (int rr = 0; rr < rows; ++rr) {
      const int64_t r = rr / g, h = rr % g, visible = first + r0 + r + 1;
      float *s = scratch + (int64_t)rr * keys;
      float *col = sums + (bh * g + h) * n;
      if (softcap > 0.0f) {
        const float c = scale / softcap;
        for (int64_t j = 0; j < visible; ++j) s[j] = softcap * tanhf(s[j] * c);
      }
      float mx = s[0];
      for (int64_t j = 1; j < visible; ++j) mx = s[j] > mx ? s[j] : mx;
      float total = 0.0f;
      for (int64_t j = 0; j < visible; ++j) {
        const float e = expf(s[j] - mx);
        s[j] = e;
        total += e;
      }
      const float inv = 1.0f / total;
      for (int64_t j = 0; j < visible; ++j) col[j] += s[j] * inv; /* S keeps exp(s - max): no write pass */
      row_inv[rr] = inv;
      for (int64_t j = visible; j < keys; ++j) s[j] = 0.0f;
    }
    if (out) {
      /* O_blk (rows × d) = P · V: column-major O^T = V^T · E^T with E = exp(S - row max), then
       * each row scaled by its 1 / Σ exp */
      float *o = out + (bh * w + r0) * g * d;
      sgemm("N", "N", &di, &rows, &keys, &one, v + bh * n * d, &di, scratch, &keys, &zero, o, &di);
      for (int rr = 0; rr < rows; ++rr)
        for (int64_t c = 0; c < d; ++c) o[(int64_t)rr * d + c] *= row_inv[rr];
    }
  }
  return 0;
}

#ifdef __AVX512F__
/* Four evicted rows e[0..3] (d floats each) against the kept keys kT (d × m, column j = kept key
 * j): best similarity and first index of it per row. The products stay in registers: 4 rows ×
 * 64 columns per tile (16 accumulators), then a masked running max per lane. */
static void kvb_nearest4_avx512(const float *e, const float *kT, int64_t m, int64_t d, float *best, int64_t *arg) {
  __m512 bv[4], acc[4][4];
  __m512i bi[4];
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int r = 0; r < 4; ++r) {
    bv[r] = _mm512_set1_ps(-INFINITY);
    bi[r] = _mm512_setzero_si512();
  }
  int64_t j0 = 0;
  for (; j0 + 64 <= m; j0 += 64) {
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < d; ++k) {
      const float *row = kT + k * m + j0;
      const __m512 b0 = _mm512_loadu_ps(row), b1 = _mm512_loadu_ps(row + 16), b2 = _mm512_loadu_ps(row + 32),
                   b3 = _mm512_loadu_ps(row + 48);
      for (int r = 0; r < 4; ++r) {
        const __m512 a = _mm512_set1_ps(e[r * d + k]);
        acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(a, b2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(a, b3, acc[r][3]);
      }
    }
    for (int c = 0; c < 4; ++c) {
      const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(j0 + 16 * c)));
      for (int r = 0; r < 4; ++r) {
        const __mmask16 gt = _mm512_cmp_ps_mask(acc[r][c], bv[r], _CMP_GT_OQ);
        bv[r] = _mm512_mask_mov_ps(bv[r], gt, acc[r][c]);
        bi[r] = _mm512_mask_mov_epi32(bi[r], gt, idx);
      }
    }
  }
  for (; j0 < m; j0 += 16) { /* the last < 64 columns, 16 at a time, the final ones masked */
    const int64_t left = m - j0;
    const __mmask16 valid = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
    __m512 a4[4];
    for (int r = 0; r < 4; ++r) a4[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < d; ++k) {
      const __m512 b = _mm512_maskz_loadu_ps(valid, kT + k * m + j0);
      for (int r = 0; r < 4; ++r) a4[r] = _mm512_fmadd_ps(_mm512_set1_ps(e[r * d + k]), b, a4[r]);
    }
    const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32((int)j0));
    for (int r = 0; r < 4; ++r) {
      const __mmask16 gt = _mm512_mask_cmp_ps_mask(valid, a4[r], bv[r], _CMP_GT_OQ);
      bv[r] = _mm512_mask_mov_ps(bv[r], gt, a4[r]);
      bi[r] = _mm512_mask_mov_epi32(bi[r], gt, idx);
    }
  }
  for (int r = 0; r < 4; ++r) {
    const float mx = _mm512_reduce_max_ps(bv[r]);
    const __mmask16 at = _mm512_cmp_ps_mask(bv[r], _mm512_set1_ps(mx), _CMP_EQ_OQ);
    best[r] = mx;
    arg[r] = at ? _mm512_mask_reduce_min_epi32(at, bi[r]) : 0; /* first index of the maximum */
  }
}
#endif

/* 2. evicted (heads, E, d), kept (heads, m, d), both unit rows; kept_t (heads, d, m) the same
 *    keys transposed (used with AVX-512; NULL otherwise); sim, target (heads, E). */
static int nearest_part(void *sgemm_p, const float *evicted, const float *kept,
                        const float *kept_t, float *sim, int64_t *target, float *scratch, int64_t heads, int64_t e,
                        int64_t m, int64_t d, int64_t block, int64_t item_begin, int64_t item_end) {
  kvb_sgemm_t sgemm = (kvb_sgemm_t)sgemm_p;
  const int64_t nblocks = (e + block - 1) / block;
  const float one = 1.0f, zero = 0.0f;
  const int di = (int)d, mi = (int)m;
  for (int64_t it = item_begin; it < item_end; ++it) {
    const int64_t blk = it % nblocks, bh = it / nblocks;
    if (bh >= heads) return 1;
    const int64_t r0 = blk * block, r1 = r0 + block < e ? r0 + block : e;
    int64_t r = r0;
#ifdef __AVX512F__
    if (kept_t)
      for (; r + 4 <= r1; r += 4)
        kvb_nearest4_avx512(evicted + (bh * e + r) * d, kept_t + bh * d * m, m, d, sim + bh * e + r, target + bh * e + r);
#endif
    if (r == r1) continue;
    int rows = (int)(r1 - r);
    sgemm("T", "N", &mi, &rows, &di, &one, kept + bh * m * d, &di, evicted + (bh * e + r) * d, &di, &zero,
          scratch, &mi);
    for (int i = 0; i < rows; ++i) {
      const float *s = scratch + (int64_t)i * m;
      float mx = s[0];
      for (int64_t j = 1; j < m; ++j) mx = s[j] > mx ? s[j] : mx;
      int64_t idx = 0;
      while (idx < m - 1 && s[idx] != mx) ++idx;
      sim[bh * e + r + i] = mx;
      target[bh * e + r + i] = idx;
    }
  }
  return 0;
}

int kvb_attention_column_sums(void *sgemm_p, const float *q, const float *k, const float *v,
                              float *out, float *sums, float *scratch, int64_t scratch_stride, int64_t heads,
                              int64_t g, int64_t w, int64_t n, int64_t d, float scale, float softcap, int64_t block,
                              int64_t parts, const int64_t *cuts) {
  int status = 0;
  if (scratch_stride < block * g * (n + 1)) return 4; /* logits and the rows' 1 / Σ exp */
#pragma omp parallel num_threads((int)parts) reduction(| : status)
  for (int64_t p = omp_get_thread_num(); p < parts; p += omp_get_num_threads())
    status |= attention_part(sgemm_p, q, k, v, out, sums + p * heads * g * n, scratch + p * scratch_stride,
                             heads, g, w, n, d, scale, softcap, block, cuts[p], cuts[p + 1]);
  return status;
}

int kvb_nearest_kept(void *sgemm_p, const float *evicted, const float *kept, const float *kept_t,
                     float *sim, int64_t *target, float *scratch, int64_t scratch_stride, int64_t heads, int64_t e,
                     int64_t m, int64_t d, int64_t block, int64_t parts, const int64_t *cuts) {
  int status = 0;
#pragma omp parallel num_threads((int)parts) reduction(| : status)
  for (int64_t p = omp_get_thread_num(); p < parts; p += omp_get_num_threads())
    status |= nearest_part(sgemm_p, evicted, kept, kept_t, sim, target, scratch + p * scratch_stride,
                           heads, e, m, d, block, cuts[p], cuts[p + 1]);
  return status;
}

/* 1 when the AVX-512 nearest-kept path is compiled in (kept_t is then used) */
int kvb_has_avx512(void) {
#ifdef __AVX512F__
  return 1;
#else
  return 0;
#endif
}

/* 3. kvb_merge_into_targets: LOOK-M's merge of evicted rows into their targets, heads
 *    [item_begin, item_end):  x_t <- (x_t + sum_{j->t} w_j c_j) / (1 + sum_{j->t} w_j), with
 *    c_j = x_j (mode 0, avg), (x_j + x_t)/2 (mode 1, pivot; x_t the kept row before merging) or
 *    s_j x_j (mode 2, weighted). kept (heads, m, d), evicted (heads, E, d), target/weight/sim
 *    (heads, E) (weight NULL: all 1), out (heads, m, d), den: m floats of scratch per thread. */
static int merge_part(const float *kept, const float *evicted, const int64_t *target, const float *weight,
                      const float *sim, int64_t mode, float *out, float *den, int64_t heads, int64_t m, int64_t e,
                      int64_t d, int64_t item_begin, int64_t item_end) {
  for (int64_t h = item_begin; h < item_end; ++h) {
    if (h >= heads) return 1;
    const float *xk = kept + h * m * d, *xe = evicted + h * e * d;
    float *o = out + h * m * d;
    for (int64_t i = 0; i < m * d; ++i) o[i] = xk[i];
    for (int64_t t = 0; t < m; ++t) den[t] = 1.0f;
    for (int64_t j = 0; j < e; ++j) {
      const float w = weight ? weight[h * e + j] : 1.0f;
      const int64_t t = target[h * e + j];
      if (w == 0.0f) continue;
      if (t < 0 || t >= m) return 2;
      const float *xj = xe + j * d, *xt = xk + t * d;
      float *ot = o + t * d;
      if (mode == 1) {
        for (int64_t c = 0; c < d; ++c) ot[c] += w * ((xj[c] + xt[c]) * 0.5f);
      } else {
        const float s = mode == 2 ? sim[h * e + j] : 1.0f;
        for (int64_t c = 0; c < d; ++c) ot[c] += w * (s * xj[c]);
      }
      den[t] += w;
    }
    for (int64_t t = 0; t < m; ++t) {
      const float inv = den[t];
      if (inv != 1.0f)
        for (int64_t c = 0; c < d; ++c) o[t * d + c] /= inv;
    }
  }
  return 0;
}

int kvb_merge_into_targets(const float *kept, const float *evicted, const int64_t *target, const float *weight,
                           const float *sim, int64_t mode, float *out, float *den, int64_t heads, int64_t m,
                           int64_t e, int64_t d, int64_t parts, const int64_t *cuts) {
  int status = 0;
#pragma omp parallel num_threads((int)parts) reduction(| : status)
  for (int64_t p = omp_get_thread_num(); p < parts; p += omp_get_num_threads())
    status |= merge_part(kept, evicted, target, weight, sim, mode, out, den + p * m, heads, m, e, d, cuts[p],
                         cuts[p + 1]);
  return status;
}
