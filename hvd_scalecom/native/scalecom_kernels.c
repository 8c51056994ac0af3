/* ScaleCom's per-tensor passes over fp32 memory m and gradient g (Chen et al., NeurIPS 2020,
 * Algorithm 1; see hvd_scalecom/torch/clt_k.py for the equations and the torch version of each).
 *
 * hsc_select:              I, m[I], p[I] and finiteness on the leader (steps 1-3): one read-only pass.
 * hsc_take:                m[I], p[I] and finiteness on a non-leader (step 3): one read-only pass.
 * hsc_mark:                the set I as a bitmap, for the passes below.
 * hsc_filter_scatter:      the memory update and the reduced values into g (steps 4-5): one pass in place.
 * hsc_filter_scatter_cut:  the same on the leader, I found again from its selection's threshold
 *                          (AVX-512 builds only).
 * hsc_take_advancing:      step 3 on a non-leader and step 4 written over g (the new memory, adopted
 *                          if the reduction is finite): one pass, in place over g.
 * hsc_scatter_marked:      step 5 into a buffer that is not read (zeros with the values at I).
 * hsc_scatter_if_finite:   step 5 after hsc_take_advancing, into the buffer that the values'
 *                          finiteness frees.
 * hsc_all_finite:          whether every entry is finite (the reduced values, before step 4).
 * hsc_fused_pass:          not used by the compressor: the least any compress + decompress must
 *                          move, the second floor of benchmarks/kernels.py.
 *
 * Compiled by hvd_scalecom/native/__init__.py with -ffp-contract=off: every rounding is the one
 * written here (m + beta g is fmaf, as torch's add(alpha=) computes it on the CPU).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* hsc_take goes by blocks: a block's whole vectors first (no branch per vector), then its few
 * indices, while the block is still in L1; the blocks are short, as the m[I] lines it requests one
 * block ahead must arrive in time (the size chosen by timing 1M- and 25M-entry tensors). */
enum { TAKE_BLOCK = 512, SCAN_BLOCK = 512 /* hsc_select's pass */,
       AHEAD = 32 /* gathers: lines requested this many ahead */ };

static uint32_t float_bits(float x) { uint32_t u; memcpy(&u, &x, sizeof u); return u; }

#ifdef __AVX512F__
/* The lanes of v that are not finite: |v| > FLT_MAX, or NaN. */
static inline __mmask16 nonfinite_lanes(__m512 v) {
    const __m512 abs_v = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)));
    return _mm512_cmp_ps_mask(abs_v, _mm512_set1_ps(FLT_MAX), _CMP_NLE_UQ);
}
#endif

#ifdef __AVX512F__
/* |va + vb| (vb zero when the caller has no b). */
static inline __m512 magnitude(__m512 va, __m512 vb) {
    const __m512 p = _mm512_add_ps(va, vb);
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(p), _mm512_set1_epi32(0x7fffffff)));
}

/* Appends the lanes of entries i..i+16 set in hit to the candidates at c: index (int32: n < 2^31)
 * and a + b (b zero when NULL). Whole-vector stores: the buffers hold 16 entries of slack. */
static inline void keep_candidates(const float *a, const float *b, int64_t i, __mmask16 hit, int64_t c,
                                   int32_t *cand_idx, float *cand_p) {
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 va = _mm512_loadu_ps(a + i), vb = b ? _mm512_loadu_ps(b + i) : _mm512_setzero_ps();
    _mm512_storeu_ps(cand_p + c, _mm512_maskz_compress_ps(hit, _mm512_add_ps(va, vb)));
    _mm512_storeu_si512((void *)(cand_idx + c),
                        _mm512_maskz_compress_epi32(hit, _mm512_add_epi32(_mm512_set1_epi32((int32_t)i), lanes)));
}
#endif

/* The r-th largest (r from 1, r <= n) of x[0..n), non-negative and not NaN, which it reorders: a
 * radix selection on the bit patterns (ordered like the values for x >= 0). Each round counts
 * BUCKETS-wide slices of the patterns' current range (one branch-free pass), keeps the slice that
 * holds the r-th largest (compacted to the front) and narrows the range to it, until the range is
 * one pattern: about two passes over x, where a comparison-based selection mispredicts a branch
 * at almost every element. The counts go into COPIES tables in turn, summed after: neighbouring
 * entries often fall in the same slice (the candidates crowd above the threshold), and a single
 * table would make each count wait for the previous one's store. */
static float kth_largest(float *x, int64_t n, int64_t r) {
    enum { BITS = 10, BUCKETS = 1 << BITS, COPIES = 4 };
    uint32_t lo = UINT32_MAX, hi = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t u = float_bits(x[i]);
        lo = u < lo ? u : lo;
        hi = u > hi ? u : hi;
    }
    uint32_t count[COPIES][BUCKETS];
    while (lo < hi) {
        int shift = 0;
        while (((hi - lo) >> shift) >= BUCKETS) shift++;
        const uint32_t used = ((hi - lo) >> shift) + 1;
        for (int h = 0; h < COPIES; h++) memset(count[h], 0, used * sizeof **count);
        int64_t i = 0;
        for (; i + COPIES <= n; i += COPIES)
            for (int h = 0; h < COPIES; h++) count[h][(float_bits(x[i + h]) - lo) >> shift]++;
        for (; i < n; i++) count[0][(float_bits(x[i]) - lo) >> shift]++;
        for (uint32_t slice = 0; slice < used; slice++)
            for (int h = 1; h < COPIES; h++) count[0][slice] += count[h][slice];
        uint32_t bucket = used - 1;
        int64_t above = 0;
        while (above + count[0][bucket] < r) above += count[0][bucket--];
        int64_t kept = 0;
        i = 0;
#ifdef __AVX512F__
        /* By whole vectors, compressed into place: x + kept + 16 <= x + i + 16 holds only entries
         * already read. */
        const __m512i vlo = _mm512_set1_epi32((int)lo), vshift = _mm512_set1_epi32(shift),
                      vbucket = _mm512_set1_epi32((int)bucket);
        for (; i + 16 <= n; i += 16) {
            const __m512i u = _mm512_loadu_si512((const void *)(x + i));
            const __mmask16 in = _mm512_cmpeq_epi32_mask(_mm512_srlv_epi32(_mm512_sub_epi32(u, vlo), vshift), vbucket);
            _mm512_storeu_si512((void *)(x + kept), _mm512_maskz_compress_epi32(in, u));
            kept += __builtin_popcount(in);
        }
#endif
        for (; i < n; i++) {
            const float v = x[i];
            x[kept] = v;
            kept += ((float_bits(v) - lo) >> shift) == bucket;
        }
        n = kept;
        r -= above;
        const uint32_t base = lo + (bucket << shift), top = base + ((1u << shift) - 1);
        hi = top < hi ? top : hi;
        lo = base;
    }
    float out;
    memcpy(&out, &lo, sizeof out);
    return out;
}

/* word (the entries' marks) with the first *ties of eq added, lowest first (*ties counts down). */
static inline uint64_t with_ties(uint64_t word, uint64_t eq, int64_t *ties) {
    for (; eq && *ties > 0; eq &= eq - 1, (*ties)--) word |= eq & -eq;
    return word;
}

/* Exact top-k of |a + b| (b may be NULL: |a|) into out_idx[0..k) in ascending index order, with
 * p_at = a[I] + b[I] (steps 2-3 on the leader): the threshold t is the rank-th largest magnitude at
 * the sample positions (NaN counted as 0); one read-only pass collects the candidates |a + b| >= t
 * (index, a + b) and checks that every b (a when b is NULL) is finite (*finite_out); the k largest
 * are picked among the candidates, ties at the k-th magnitude going to the lowest indices. I is then
 * the cut (*kth_out, *ties_out): the entries with |a + b| > kth, and the first ties (in index order)
 * of those with |a + b| == kth (ties = -1: all of them, I being |a + b| >= kth, the usual case),
 * which hsc_filter_scatter_cut finds again. Returns k; -1 when t is not positive (before the pass)
 * or fewer than k reach it (the caller falls back to a full top-k); -2 when more than cap do (retry
 * with more room). NaN entries are never selected. cand_idx and cand_p hold cap + 16 entries
 * (whole-vector stores), scratch max(cap, s); n < 2^31 (the candidates' indices are int32). out_idx
 * is int64 if wide, else int32 (as the indices are broadcast: no conversion after). */
int64_t hsc_select(const float *restrict a, const float *restrict b, int64_t n, int64_t k,
                   const int64_t *sample, int64_t s, int64_t rank, int32_t *restrict cand_idx,
                   float *restrict cand_p, int64_t cap, float *restrict scratch,
                   void *restrict out_idx, int wide, float *restrict p_at, int *finite_out,
                   float *kth_out, int64_t *ties_out) {
    for (int64_t i = 0; i < s; i++) {
        if (i + AHEAD < s) {
            __builtin_prefetch(a + sample[i + AHEAD], 0, 0);
            if (b) __builtin_prefetch(b + sample[i + AHEAD], 0, 0);
        }
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
    const __m512 vt = _mm512_set1_ps(t);
    __m512i widest = _mm512_setzero_si512();  /* the largest |x| bit pattern of the checked entries */
    const __m512i abs_bits = _mm512_set1_epi32(0x7fffffff);
    /* By blocks of SCAN_BLOCK entries: every vector is compared (no branch), then only the vectors
     * with candidates are visited again, from L1, to keep them: one unpredictable loop exit per
     * block instead of a branch per vector that candidates make hard to predict. */
    for (; i + SCAN_BLOCK <= n; i += SCAN_BLOCK) {
        __mmask16 hits[SCAN_BLOCK / 16];
        uint32_t any = 0;
        for (int v = 0; v < SCAN_BLOCK / 16; v++) {
            const __m512 va = _mm512_loadu_ps(a + i + 16 * v);
            const __m512 vb = b ? _mm512_loadu_ps(b + i + 16 * v) : _mm512_setzero_ps();
            widest = _mm512_max_epu32(widest, _mm512_and_si512(_mm512_castps_si512(b ? vb : va), abs_bits));
            hits[v] = _mm512_cmp_ps_mask(magnitude(va, vb), vt, _CMP_GE_OQ);
            any |= (uint32_t)(hits[v] != 0) << v;
        }
        for (; any; any &= any - 1) {
            const int v = __builtin_ctz(any);
            if (c <= cap) keep_candidates(a, b, i + 16 * v, hits[v], c, cand_idx, cand_p);
            c += __builtin_popcount(hits[v]);
        }
    }
    for (; i + 16 <= n; i += 16) {
        const __m512 va = _mm512_loadu_ps(a + i);
        const __m512 vb = b ? _mm512_loadu_ps(b + i) : _mm512_setzero_ps();
        widest = _mm512_max_epu32(widest, _mm512_and_si512(_mm512_castps_si512(b ? vb : va), abs_bits));
        const __mmask16 hit = _mm512_cmp_ps_mask(magnitude(va, vb), vt, _CMP_GE_OQ);
        if (hit && c <= cap) keep_candidates(a, b, i, hit, c, cand_idx, cand_p);
        c += __builtin_popcount(hit);
    }
    finite &= _mm512_reduce_max_epu32(widest) <= 0x7f7fffffu;  /* FLT_MAX's pattern */
#elif defined(__AVX2__)
    /* The same blocks with 8-entry vectors (CPUs without AVX-512); a vector's candidates are kept one
     * by one (they are few). */
    const __m256 vt = _mm256_set1_ps(t);
    const __m256i abs_bits = _mm256_set1_epi32(0x7fffffff);
    __m256i widest = _mm256_setzero_si256();
    for (; i + SCAN_BLOCK <= n; i += SCAN_BLOCK) {
        uint8_t hits[SCAN_BLOCK / 8];
        uint64_t any = 0;
        for (int v = 0; v < SCAN_BLOCK / 8; v++) {
            const __m256 va = _mm256_loadu_ps(a + i + 8 * v);
            const __m256 vb = b ? _mm256_loadu_ps(b + i + 8 * v) : _mm256_setzero_ps();
            widest = _mm256_max_epu32(widest, _mm256_and_si256(_mm256_castps_si256(b ? vb : va), abs_bits));
            const __m256 mag = _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(_mm256_add_ps(va, vb)), abs_bits));
            hits[v] = (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(mag, vt, _CMP_GE_OQ));
            any |= (uint64_t)(hits[v] != 0) << v;
        }
        for (; any; any &= any - 1) {
            const int v = __builtin_ctzll(any);
            for (unsigned hit = hits[v]; hit; hit &= hit - 1) {
                const int64_t e = i + 8 * v + __builtin_ctz(hit);
                if (c < cap) {
                    cand_idx[c] = (int32_t)e;
                    cand_p[c] = b ? a[e] + b[e] : a[e];
                }
                c++;
            }
        }
    }
    uint32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, widest);
    for (int v = 0; v < 8; v++) finite &= lanes[v] <= 0x7f7fffffu;  /* FLT_MAX's pattern */
#endif
    for (; i < n; i++) {
        float ai = a[i], bi = b ? b[i] : 0.0f, mag = fabsf(b ? ai + bi : ai);
        finite &= fabsf(checked[i]) <= FLT_MAX;
        if (mag >= t) {
            if (c < cap) { cand_idx[c] = (int32_t)i; cand_p[c] = b ? ai + bi : ai; }
            c++;
        }
    }
    *finite_out = finite;
    if (c < k) return -1;
    if (c > cap) return -2;
    for (int64_t q = 0; q < c; q++) scratch[q] = fabsf(cand_p[q]);
    const float kth = kth_largest(scratch, c, k);
    int64_t above = 0, equal = 0;
    for (int64_t q = 0; q < c; q++) {
        above += fabsf(cand_p[q]) > kth;
        equal += fabsf(cand_p[q]) == kth;
    }
    int64_t ties = k - above, o = 0, q = 0;
    *kth_out = kth;
    *ties_out = ties == equal ? -1 : ties;
#ifdef __AVX512F__
    /* By whole vectors: the lanes above kth, and those equal to it while ties last (lowest first;
     * such lanes are rare), compressed into place. */
    const __m512 vkth = _mm512_set1_ps(kth);
    for (; q + 16 <= c; q += 16) {
        const __m512 vp = _mm512_loadu_ps(cand_p + q);
        const __m512 mag = _mm512_abs_ps(vp);
        const __mmask16 take = (__mmask16)with_ties(_mm512_cmp_ps_mask(mag, vkth, _CMP_GT_OQ),
                                                     _mm512_cmp_ps_mask(mag, vkth, _CMP_EQ_OQ), &ties);
        const int got = __builtin_popcount(take);
        const __mmask16 fill = (__mmask16)((1u << got) - 1);
        const __m512i kept = _mm512_maskz_compress_epi32(take, _mm512_loadu_si512(cand_idx + q));
        _mm512_mask_storeu_ps(p_at + o, fill, _mm512_maskz_compress_ps(take, vp));
        if (wide) {
            int64_t *out = (int64_t *)out_idx + o;
            _mm512_mask_storeu_epi64(out, (__mmask8)fill, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(kept)));
            _mm512_mask_storeu_epi64(out + 8, (__mmask8)(fill >> 8),
                                     _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(kept, 1)));
        } else {
            _mm512_mask_storeu_epi32((int32_t *)out_idx + o, fill, kept);
        }
        o += got;
    }
#endif
    for (; q < c && o < k; q++) {  /* branch-free: o advances past the chosen ones */
        const float mag = fabsf(cand_p[q]);
        const int tie = mag == kth && ties > 0;
        ties -= tie;
        if (wide)
            ((int64_t *)out_idx)[o] = cand_idx[q];
        else
            ((int32_t *)out_idx)[o] = cand_idx[q];
        p_at[o] = cand_p[q];
        o += (mag > kth) | tie;
    }
    return o;
}

/* Step 3 on a non-leader: m_at = m[I], p_at = m[I] + g[I] (idx in any order; ascending is fastest),
 * and whether every g is finite (one read-only pass over g; with check 0 no pass, and 1 is returned).
 * The pass goes by blocks of TAKE_BLOCK entries: the block's g is checked (whole vectors, no branch), then
 * the block's indices are taken from it while it is in L1, their m lines having been requested one
 * block ahead. Returns 1 or 0; -1 (before writing anything) if an index is out of [0, n). */
int hsc_take(const float *restrict m, const float *restrict g, int64_t n, const int64_t *restrict idx,
             int64_t k, float *restrict m_at, float *restrict p_at, int check) {
    int ascending = 1;
    for (int64_t j = 0; j < k; j++) {
        if (idx[j] < 0 || idx[j] >= n) return -1;
        if (j > 0 && idx[j] <= idx[j - 1]) ascending = 0;
    }
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
    int64_t j = 0, ahead = 0;
    int finite = 1;
    for (int64_t lo = 0; lo < n; lo += TAKE_BLOCK) {
        const int64_t hi = lo + TAKE_BLOCK < n ? lo + TAKE_BLOCK : n;
        if (ascending)  /* the next block's m[I] lines */
            for (; ahead < k && idx[ahead] < hi + TAKE_BLOCK; ahead++) __builtin_prefetch(m + idx[ahead], 0, 0);
        int64_t i = lo;
#ifdef __AVX512F__
        __mmask16 bad = 0;
        for (; i + 16 <= hi; i += 16) bad |= nonfinite_lanes(_mm512_loadu_ps(g + i));
        finite &= bad == 0;
#endif
        for (; i < hi; i++) finite &= fabsf(g[i]) <= FLT_MAX;
        if (ascending) {
            for (; j < k && idx[j] < hi; j++) {
                const float mj = m[idx[j]];
                m_at[j] = mj;
                p_at[j] = mj + g[idx[j]];
            }
        }
    }
    return finite;
}

/* I (ascending, in [0, n); int64 indices if wide, else int32, as they are broadcast) as n bits: bit
 * i % 16 of bits[i / 16] is set iff i is in I, so that the passes below go by whole 16-entry vectors
 * with no branch or loop per index. Returns 0; -1 if an index is out of [0, n), -2 if the indices are
 * not strictly ascending (bits then hold no set). */
static inline __attribute__((always_inline)) int mark(const void *restrict idx, int wide, int64_t k, int64_t n,
                                                      uint16_t *restrict bits) {
    memset(bits, 0, (size_t)((n + 15) / 16) * sizeof *bits);
    int64_t previous = -1;
    for (int64_t j = 0; j < k; j++) {
        const int64_t i = wide ? ((const int64_t *)idx)[j] : ((const int32_t *)idx)[j];
        if (i <= previous || i >= n) return i < 0 || i >= n ? -1 : -2;
        previous = i;
        bits[i >> 4] |= (uint16_t)(1u << (i & 15));
    }
    return 0;
}

int hsc_mark(const void *restrict idx, int wide, int64_t k, int64_t n, uint16_t *restrict bits) {
    return wide ? mark(idx, 1, k, n, bits) : mark(idx, 0, k, n, bits);  /* a loop for each width */
}

/* The next 64 bits of I's bitmap (bits of entries i .. i + 63, i a multiple of 64). The passes
 * below go by such words: most are 0 at ratios below 1/64, and a word of zeros takes four plain
 * vectors, with no per-vector chain through the mask's population count. */
static uint64_t marks64(const uint16_t *bits, int64_t i) {
    uint64_t w;
    memcpy(&w, bits + (i >> 4), sizeof w);
    return w;
}

/* Whether entry i is in I (bits from hsc_mark). */
static int marked_at(const uint16_t *bits, int64_t i) { return (bits[i >> 4] >> (i & 15)) & 1; }

/* The 64 entries of a word of the bitmap into line: zeros by a loop the compiler vectorizes, then the
 * next values (from *j on) at the word's marks. */
static inline void scatter_word(float *restrict line, uint64_t word, const float *restrict values, int64_t *j) {
    for (int e = 0; e < 64; e++) line[e] = 0.0f;
    for (; word; word &= word - 1) line[__builtin_ctzll(word)] = values[(*j)++];
}

#ifdef __AVX512F__
/* The 16 entries from bit q of a bitmap word: zeros, and the next values (from *j on) at the marks. */
static inline __m512 marked_values(uint64_t word, int q, const float *values, int64_t *j) {
    const __mmask16 at = (__mmask16)(word >> q);
    const int c = __builtin_popcount(at);
    const __m512 v = _mm512_maskz_expand_ps(at, _mm512_maskz_loadu_ps((__mmask16)((1u << c) - 1), values + *j));
    *j += c;
    return v;
}
#endif

/* Steps 3-4 on a non-leader in one pass that writes the new memory over g, for a caller that adopts
 * g's buffer as the memory if the reduction is finite (and otherwise keeps m, which is only read):
 *   p_at = m[I] + g[I] (in index order), whether every g is finite (returned, 1 or 0),
 *   g = m + beta g off I (fmaf) and keep m at I (keep = 1 - beta: p - v = 0 for fp32 values).
 * One read of m and g and one write of g, in place: the floor's traffic. bits from hsc_mark. (m[I]
 * is not taken: the memory at I is written here, and no later step needs it.) */
int hsc_take_advancing(const float *restrict m, float *restrict g, int64_t n, float beta, float keep,
                       const uint16_t *restrict bits, float *restrict p_at) {
    int64_t i = 0, j = 0;
    int finite = 1;
#ifdef __AVX512F__
    const __m512 vbeta = _mm512_set1_ps(beta), vkeep = _mm512_set1_ps(keep);
    __mmask16 bad = 0;
    for (; i + 64 <= n; i += 64) {
        const uint64_t word = marks64(bits, i);
        for (int q = 0; q < 64; q += 16) {
            const __m512 vg = _mm512_loadu_ps(g + i + q), vm = _mm512_loadu_ps(m + i + q);
            bad |= nonfinite_lanes(vg);
            __m512 t = _mm512_fmadd_ps(vbeta, vg, vm);
            if (word) {
                const __mmask16 at = (__mmask16)(word >> q);
                const int c = __builtin_popcount(at);
                t = _mm512_mask_mul_ps(t, at, vkeep, vm);
                _mm512_mask_storeu_ps(p_at + j, (__mmask16)((1u << c) - 1),
                                      _mm512_maskz_compress_ps(at, _mm512_add_ps(vm, vg)));
                j += c;
            }
            _mm512_storeu_ps(g + i + q, t);
        }
    }
    finite = bad == 0;
#endif
    /* Without AVX-512, by words: the marked entries are read first, then the word's 64 entries go
     * through a loop the compiler vectorizes, then the marked ones are written. */
    for (; i + 64 <= n; i += 64) {
        const uint64_t word = marks64(bits, i);
        float kept[64];
        int c = 0, bad_lanes = 0;
        for (uint64_t w = word; w; w &= w - 1, c++) {
            const int64_t e = i + __builtin_ctzll(w);
            p_at[j++] = m[e] + g[e];
            kept[c] = keep * m[e];
        }
        for (int64_t e = i; e < i + 64; e++) {
            bad_lanes |= !(fabsf(g[e]) <= FLT_MAX);
            g[e] = fmaf(beta, g[e], m[e]);
        }
        finite &= !bad_lanes;
        c = 0;
        for (uint64_t w = word; w; w &= w - 1) g[i + __builtin_ctzll(w)] = kept[c++];
    }
    for (; i < n; i++) {
        const float mi = m[i], gi = g[i];
        finite &= fabsf(gi) <= FLT_MAX;
        if (marked_at(bits, i)) {
            p_at[j++] = mi + gi;
            g[i] = keep * mi;
        } else {
            g[i] = fmaf(beta, gi, mi);
        }
    }
    return finite;
}

/* Step 5 into out, which is not read: zeros, and values[j] at the j-th index of I (bits from
 * hsc_mark). From STREAM_MIN entries on, whole 64-byte lines go by non-temporal stores (AVX-512 and
 * AVX2 builds, when out is 64-byte aligned, as torch allocates): a buffer larger than the caches is
 * not worth a read for ownership before it is overwritten, while one that fits is faster written
 * through them. */
enum { STREAM_MIN = 1 << 22 /* 16 MB of fp32: half the last-level cache of the machines timed */ };

void hsc_scatter_marked(float *restrict out, int64_t n, const uint16_t *restrict bits, const float *restrict values) {
    int64_t i = 0, j = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
    const int stream = ((uintptr_t)out & 63) == 0 && n >= STREAM_MIN;  /* a word's entries: 256 bytes */
#endif
#ifdef __AVX512F__
    for (; i + 64 <= n; i += 64) {
        const uint64_t word = marks64(bits, i);
        for (int q = 0; q < 64; q += 16) {
            const __m512 v = word ? marked_values(word, q, values, &j) : _mm512_setzero_ps();
            if (stream)
                _mm512_stream_ps(out + i + q, v);
            else
                _mm512_storeu_ps(out + i + q, v);
        }
    }
    if (stream) _mm_sfence();
#elif defined(__AVX2__)
    if (stream) {
        const __m256 zero = _mm256_setzero_ps();
        for (; i + 64 <= n; i += 64) {
            const uint64_t word = marks64(bits, i);
            if (!word) {
                for (int q = 0; q < 64; q += 8) _mm256_stream_ps(out + i + q, zero);
                continue;
            }
            float line[64] __attribute__((aligned(32)));
            scatter_word(line, word, values, &j);
            for (int q = 0; q < 64; q += 8) _mm256_stream_ps(out + i + q, _mm256_load_ps(line + q));
        }
        _mm_sfence();
    }
#endif
    for (; i + 64 <= n; i += 64) scatter_word(out + i, marks64(bits, i), values, &j);  /* the rest */
    for (; i < n; i++) out[i] = marked_at(bits, i) ? values[j++] : 0.0f;
}

/* 1 if every x[i] is finite, else 0: one read-only pass, no branch per vector. */
int hsc_all_finite(const float *restrict x, int64_t n) {
    int64_t i = 0;
    int finite = 1;
#ifdef __AVX512F__
    __mmask16 bad = 0;
    for (; i + 16 <= n; i += 16) bad |= nonfinite_lanes(_mm512_loadu_ps(x + i));
    finite = bad == 0;
#endif
    for (; i < n; i++) finite &= fabsf(x[i]) <= FLT_MAX;
    return finite;
}

/* Steps 4-5 in place over whole 64-entry words of I; bits NULL: I is hsc_select's cut (kth, ties;
 * ties -1: every entry at kth), found again from |m + g|, which compress left unchanged (see
 * hsc_filter_scatter_cut). Returns the number of values used, never more than k. */
static inline __attribute__((always_inline)) int64_t filter_scatter(
        float *restrict m, float *restrict g, int64_t n, float beta, float keep, int update,
        const uint16_t *restrict bits, float kth, int64_t ties, int64_t k, const float *restrict values) {
    int64_t i = 0, j = 0;
#ifdef __AVX512F__
    const __m512 vbeta = _mm512_set1_ps(beta), vkeep = _mm512_set1_ps(keep), vkth = _mm512_set1_ps(kth);
    for (; i + 64 <= n; i += 64) {
        __m512 vm[4], vg[4];
        uint64_t word = 0, eq = 0;
        for (int q = 0; q < 4; q++) {
            vm[q] = _mm512_loadu_ps(m + i + 16 * q);
            vg[q] = _mm512_loadu_ps(g + i + 16 * q);
            if (!bits) {
                const __m512 mag = magnitude(vm[q], vg[q]);
                if (ties < 0) {  /* one comparison: every entry at kth is in I */
                    word |= (uint64_t)_mm512_cmp_ps_mask(mag, vkth, _CMP_GE_OQ) << (16 * q);
                } else {
                    word |= (uint64_t)_mm512_cmp_ps_mask(mag, vkth, _CMP_GT_OQ) << (16 * q);
                    eq |= (uint64_t)_mm512_cmp_ps_mask(mag, vkth, _CMP_EQ_OQ) << (16 * q);
                }
            }
        }
        if (bits) {
            word = marks64(bits, i);
        } else {
            if (eq) word = with_ties(word, eq, &ties);
            while (__builtin_popcountll(word) > k - j) word &= ~(1ull << (63 - __builtin_clzll(word)));
        }
        for (int q = 0; q < 4; q++) {
            if (update) {
                __m512 t = _mm512_fmadd_ps(vbeta, vg[q], vm[q]);
                if (word) t = _mm512_mask_mul_ps(t, (__mmask16)(word >> (16 * q)), vkeep, vm[q]);
                _mm512_storeu_ps(m + i + 16 * q, t);
            }
            _mm512_storeu_ps(g + i + 16 * q, word ? marked_values(word, 16 * q, values, &j) : _mm512_setzero_ps());
        }
    }
#endif
    /* Without AVX-512 (always with bits: see hsc_filter_scatter_cut), by words: the marked entries'
     * memory is read first, then the word's 64 entries go through loops the compiler vectorizes, then
     * the marked ones are written. */
    for (; i + 64 <= n; i += 64) {
        const uint64_t word = marks64(bits, i);
        float kept[64];
        int c = 0;
        for (uint64_t w = word; w; w &= w - 1) kept[c++] = keep * m[i + __builtin_ctzll(w)];
        if (update) {
            for (int64_t e = i; e < i + 64; e++) m[e] = fmaf(beta, g[e], m[e]);
            c = 0;
            for (uint64_t w = word; w; w &= w - 1) m[i + __builtin_ctzll(w)] = kept[c++];
        }
        scatter_word(g + i, word, values, &j);
    }
    for (; i < n; i++) {
        int at;
        if (bits) {
            at = marked_at(bits, i);
        } else {
            const float mag = fabsf(m[i] + g[i]);
            const int tie = mag == kth && ties != 0;  /* ties < 0: every one */
            at = j < k && (mag > kth || tie);
            ties -= at && tie && ties > 0;
        }
        if (update) m[i] = at ? keep * m[i] : fmaf(beta, g[i], m[i]);
        g[i] = at ? values[j++] : 0.0f;
    }
    return j;
}

/* Steps 4-5 in place, in one pass, once the reduced values are known (idx: I ascending, int64 if
 * wide, else int32; bits: room for hsc_mark's bitmap of n entries, which this fills): if every value
 * is finite,
 *   off I: m = m + beta g (fmaf), at I: m = keep m (keep = 1 - beta: m[I] is still the m[I] that
 *   compress took, and p - v = 0 for fp32 values);
 * then in every case g = 0 off I and g[I[j]] = values[j]. I goes through the pass as the bitmap
 * (whole vectors, no loop or branch per index). Returns 1 if the memory was updated, 0 if a value was
 * not finite (m untouched); as hsc_mark, before writing m or g, -1 if an index is out of [0, n) and
 * -2 if the indices are not strictly ascending. */
int hsc_filter_scatter(float *restrict m, float *restrict g, int64_t n, float beta, float keep,
                       const void *restrict idx, int wide, int64_t k, const float *restrict values,
                       uint16_t *restrict bits) {
    const int marked = hsc_mark(idx, wide, k, n, bits);
    if (marked < 0) return marked;
    const int update = hsc_all_finite(values, k);
    filter_scatter(m, g, n, beta, keep, update, bits, 0.0f, 0, k, values);
    return update;
}

#ifdef __AVX512F__
/* hsc_filter_scatter on the leader, with I as its selection gave it: the cut (kth, ties) of
 * hsc_select, found again from m + g, which must be the m and g that hsc_select read: no bitmap to
 * fill, and no index read. Returns 1 or 0 as hsc_filter_scatter does; -3 if the cut did not give k
 * entries (m or g changed since the selection: g then holds the values at the first entries found).
 * With AVX-512 only, where finding the cut takes one comparison per vector: elsewhere (8-entry
 * vectors, plain C) marking the indices was measured faster, and the caller does that instead. */
int hsc_filter_scatter_cut(float *restrict m, float *restrict g, int64_t n, float beta, float keep, float kth,
                           int64_t ties, int64_t k, const float *restrict values) {
    const int update = hsc_all_finite(values, k);
    return filter_scatter(m, g, n, beta, keep, update, NULL, kth, ties, k, values) == k ? update : -3;
}
#endif

/* Step 5 after hsc_take_advancing, whose g holds the new memory: if every value is finite, the
 * values over zeros into the old memory's buffer (which becomes the gradient) and 1 is returned;
 * else into g (the memory is kept), returning 0. bits from hsc_mark. */
int hsc_scatter_if_finite(float *restrict memory, float *restrict g, int64_t n, const uint16_t *restrict bits,
                          const float *restrict values, int64_t k) {
    const int finite = hsc_all_finite(values, k);
    hsc_scatter_marked(finite ? memory : g, n, bits, values);
    return finite;
}

/* m = m + beta g (fmaf) and g = 0 in one pass, reading m and g and writing both (16 bytes per entry):
 * the least traffic of any compress + decompress under Horovod's contract, which updates the memory
 * and hands back a dense gradient. Not used by the compressor: benchmarks/kernels.py measures its
 * passes against this and against m.add_(g) (12 bytes per entry, the memory update alone). */
void hsc_fused_pass(float *restrict m, float *restrict g, int64_t n, float beta) {
    for (int64_t i = 0; i < n; i++) {
        m[i] = fmaf(beta, g[i], m[i]);
        g[i] = 0.0f;
    }
}
