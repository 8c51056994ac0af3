/* ScaleCom's per-tensor passes over fp32 memory m and gradient g (Chen et al., NeurIPS 2020,
 * Algorithm 1; see hvd_scalecom/torch/clt_k.py for the equations and the torch version of each).
 *
 * hsc_select:              I, m[I], p[I] and finiteness on the leader (steps 1-3): one read-only pass.
 * hsc_take:                m[I], p[I] and finiteness on a non-leader (step 3): one read-only pass.
 * hsc_filter_scatter:      the memory update and the reduced values into g (steps 4-5): one pass in place.
 *
 * Compiled by hvd_scalecom/native/__init__.py with -ffp-contract=off: every rounding is the one
 * written here (m + beta g is fmaf, as torch's add(alpha=) computes it on the CPU).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static void swap_floats(float *a, float *b) { float t = *a; *a = *b; *b = t; }

/* The r-th largest (r from 1) of x[0..n), which it reorders (Hoare's selection). */
static float kth_largest(float *x, int64_t n, int64_t r) {
    int64_t lo = 0, hi = n - 1, want = r - 1;
    while (lo < hi) {
        float pivot = x[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (x[i] > pivot) i++;
            while (x[j] < pivot) j--;
            if (i <= j) { swap_floats(&x[i], &x[j]); i++; j--; }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return x[want];
    }
    return x[want];
}

/* Exact top-k of |a + b| (b may be NULL: |a|) into out_idx[0..k) in ascending index order, with
 * a_at = a[I] and p_at = a[I] + b[I] (steps 2-3 on the leader): the threshold t is the rank-th largest
 * magnitude at the sample positions (NaN counted as 0); one read-only pass collects the candidates
 * |a + b| >= t (index, magnitude, a, b) and checks that every b (a when b is NULL) is finite
 * (*finite_out); the k largest are picked among the candidates, ties at the k-th magnitude going to
 * the lowest indices. Returns k; -1 when t is not positive (before the pass) or fewer than k reach it
 * (the caller falls back to a full top-k); -2 when more than cap do (retry with more room). NaN
 * entries are never selected. cand_* hold cap + 16 entries (whole-vector stores), scratch
 * max(cap, s). */
int64_t hsc_select(const float *restrict a, const float *restrict b, int64_t n, int64_t k,
                   const int64_t *sample, int64_t s, int64_t rank, int64_t *restrict cand_idx,
                   float *restrict cand_mag, float *restrict cand_a, float *restrict cand_b, int64_t cap,
                   float *restrict scratch, int64_t *restrict out_idx, float *restrict a_at,
                   float *restrict p_at, int *finite_out) {
    for (int64_t i = 0; i < s; i++) {
        int64_t at = sample[i];
        float mag = fabsf(b ? a[at] + b[at] : a[at]);
        scratch[i] = mag == mag ? mag : 0.0f;
    }
    const float t = kth_largest(scratch, s, rank);
    if (!(t > 0.0f)) return -1;
    const float *checked = b ? b : a;
    int64_t c = 0, i = 0;
    int finite = 1;
#ifdef __AVX512F__
    const __m512 vt = _mm512_set1_ps(t), vmax = _mm512_set1_ps(FLT_MAX);
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
    const __m512i lanes = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
    __mmask16 bad = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 va = _mm512_loadu_ps(a + i);
        __m512 vb = b ? _mm512_loadu_ps(b + i) : _mm512_setzero_ps();
        __m512 p = b ? _mm512_add_ps(va, vb) : va;
        __m512 abs_p = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(p), absmask));
        __m512 abs_c = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(b ? vb : va), absmask));
        bad |= _mm512_cmp_ps_mask(abs_c, vmax, _CMP_NLE_UQ);  /* > FLT_MAX, or NaN */
        __mmask16 hit = _mm512_cmp_ps_mask(abs_p, vt, _CMP_GE_OQ);
        if (!hit) continue;
        if (c <= cap) {
            __m512i low = _mm512_add_epi64(_mm512_set1_epi64(i), lanes);
            __m512i high = _mm512_add_epi64(low, _mm512_set1_epi64(8));
            int n_low = __builtin_popcount(hit & 0xff);
            _mm512_storeu_ps(cand_mag + c, _mm512_maskz_compress_ps(hit, abs_p));
            _mm512_storeu_ps(cand_a + c, _mm512_maskz_compress_ps(hit, va));
            _mm512_storeu_ps(cand_b + c, _mm512_maskz_compress_ps(hit, vb));
            _mm512_storeu_si512((void *)(cand_idx + c), _mm512_maskz_compress_epi64((__mmask8)(hit & 0xff), low));
            _mm512_storeu_si512((void *)(cand_idx + c + n_low),
                                _mm512_maskz_compress_epi64((__mmask8)(hit >> 8), high));
        }
        c += __builtin_popcount(hit);
    }
    finite &= bad == 0;
#endif
    for (; i < n; i++) {
        float ai = a[i], bi = b ? b[i] : 0.0f, mag = fabsf(b ? ai + bi : ai);
        finite &= fabsf(checked[i]) <= FLT_MAX;
        if (mag >= t) {
            if (c < cap) { cand_idx[c] = i; cand_mag[c] = mag; cand_a[c] = ai; cand_b[c] = bi; }
            c++;
        }
    }
    *finite_out = finite;
    if (c < k) return -1;
    if (c > cap) return -2;
    memcpy(scratch, cand_mag, (size_t)c * sizeof(float));
    const float kth = kth_largest(scratch, c, k);
    int64_t above = 0;
    for (int64_t q = 0; q < c; q++) above += cand_mag[q] > kth;
    int64_t ties = k - above, o = 0;
    for (int64_t q = 0; q < c; q++) {
        if (cand_mag[q] > kth || (cand_mag[q] == kth && ties-- > 0)) {
            out_idx[o] = cand_idx[q];
            a_at[o] = cand_a[q];
            p_at[o] = b ? cand_a[q] + cand_b[q] : cand_a[q];
            o++;
        }
    }
    return o;
}

/* Step 3 on a non-leader: m_at = m[I], p_at = m[I] + g[I] (idx in any order; ascending is fastest),
 * and whether every g is finite (one read-only pass over g; with check 0 no pass, and 1 is returned).
 * Returns 1 or 0; -1 (before writing anything) if an index is out of [0, n). */
int hsc_take(const float *restrict m, const float *restrict g, int64_t n, const int64_t *restrict idx,
             int64_t k, float *restrict m_at, float *restrict p_at, int check) {
    int ascending = 1;
    for (int64_t j = 0; j < k; j++) {
        if (idx[j] < 0 || idx[j] >= n) return -1;
        if (j > 0 && idx[j] <= idx[j - 1]) ascending = 0;
    }
    enum { AHEAD = 32 };  /* m[I] lines requested this many indices ahead of their use */
    if (!check || !ascending) {
        for (int64_t j = 0; j < k; j++) {
            if (j + AHEAD < k) {
                __builtin_prefetch(m + idx[j + AHEAD], 0, 0);
                __builtin_prefetch(g + idx[j + AHEAD], 0, 0);
            }
            m_at[j] = m[idx[j]];
            p_at[j] = m[idx[j]] + g[idx[j]];
        }
        if (!check) return 1;
    }
    /* the finiteness pass over g, taking g[I] (and m[I]) on the way when the indices ascend */
    int64_t i = 0, j = 0;
    int finite = 1;
#ifdef __AVX512F__
    const __m512 vmax = _mm512_set1_ps(FLT_MAX);
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
    __mmask16 bad = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 abs_g = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(g + i)), absmask));
        bad |= _mm512_cmp_ps_mask(abs_g, vmax, _CMP_NLE_UQ);
        if (ascending) {
            for (; j < k && idx[j] < i + 16; j++) {
                if (j + AHEAD < k) __builtin_prefetch(m + idx[j + AHEAD], 0, 0);
                m_at[j] = m[idx[j]];
                p_at[j] = m[idx[j]] + g[idx[j]];
            }
        }
    }
    finite = bad == 0;
#endif
    for (; i < n; i++) finite &= fabsf(g[i]) <= FLT_MAX;
    if (ascending) {
        for (; j < k; j++) {
            m_at[j] = m[idx[j]];
            p_at[j] = m[idx[j]] + g[idx[j]];
        }
    }
    return finite;
}

/* Steps 4-5 in place, in one pass, once the reduced values are known: if every value is finite,
 *   off I: m = m + beta g (fmaf), at I: m = keep m (keep = 1 - beta; p - v = 0 for fp32 values);
 * then in every case g = 0 off I and g[I[j]] = values[j] (idx ascending). Returns 1 if the memory was
 * updated, 0 if a value was not finite (m untouched); -1 (before writing anything) if an index is
 * out of [0, n), -2 if the indices are not ascending. */
int hsc_filter_scatter(float *restrict m, float *restrict g, int64_t n, float beta, float keep,
                       const int64_t *restrict idx, int64_t k, const float *restrict values) {
    int update = 1;
    for (int64_t j = 0; j < k; j++) {
        if (idx[j] < 0 || idx[j] >= n) return -1;
        if (j > 0 && idx[j] <= idx[j - 1]) return -2;
        update &= fabsf(values[j]) <= FLT_MAX;
    }
    int64_t i = 0, j = 0;
#ifdef __AVX512F__
    const __m512 vbeta = _mm512_set1_ps(beta), zero = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m512 vm = _mm512_loadu_ps(m + i);
        __m512 rm = update ? _mm512_fmadd_ps(vbeta, _mm512_loadu_ps(g + i), vm) : vm;
        __m512 rg = zero;
        if (j < k && idx[j] < i + 16) {  /* patch the lanes at I */
            float lanes_m[16], lanes_g[16];
            _mm512_storeu_ps(lanes_m, rm);
            _mm512_storeu_ps(lanes_g, rg);
            for (; j < k && idx[j] < i + 16; j++) {
                if (update) lanes_m[idx[j] - i] = keep * m[idx[j]];
                lanes_g[idx[j] - i] = values[j];
            }
            rm = _mm512_loadu_ps(lanes_m);
            rg = _mm512_loadu_ps(lanes_g);
        }
        if (update) _mm512_storeu_ps(m + i, rm);
        _mm512_storeu_ps(g + i, rg);
    }
#endif
    for (; i < n; i++) {
        if (j < k && idx[j] == i) {
            if (update) m[i] = keep * m[i];
            g[i] = values[j++];
        } else {
            if (update) m[i] = fmaf(beta, g[i], m[i]);
            g[i] = 0.0f;
        }
    }
    return update;
}
