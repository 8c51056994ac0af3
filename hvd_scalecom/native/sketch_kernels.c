/* The count sketch of Sketched SGD (Ivkin et al., NeurIPS 2019) over fp32 vectors: the passes of
 * CountSketch in hvd_scalecom/torch/sketch.py, whose module docstring defines the hashes (the torch
 * version of each pass is there too).
 *
 * hsc_sketch:        S(v) of each row of a batch of vectors: row j of a table adds s_j(x) v[x] into
 *                    column h_j(x), each cell's terms in increasing x, as index_add_ adds them.
 * hsc_estimate:      the median over rows of s_j(x) S[j, h_j(x)] for every x, as torch.median picks
 *                    it (the lower middle value for an even row count, ties by row).
 * hsc_sketch_lanes:  the coordinates hashed at once (16 with AVX-512, else 1), for the tests.
 *
 * The hashes are integer arithmetic, so every build computes the same ones as torch: g_j(x) =
 * (a_j x + b_j) mod p with p = 2^31 - 1 (the high limb x_1 is 0: both passes take at most 2^30
 * coordinates), m_j(x) = mix32(g_j(x)), h_j(x) = (m_j(x) c) >> 32, s_j(x) = -1 where m_j(x) is odd.
 * Along consecutive coordinates g_j(x + 1) = (g_j(x) + a_j) mod p: one addition and one
 * conditional subtraction per coordinate, no 64-bit product. The values are products by +-1.0f
 * (exact) and sums in torch's order: compiled by hvd_scalecom/native/__init__.py with
 * -ffp-contract=off, every rounding is the one written here.
 */
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* Coordinates hashed per block (their buckets and signs stay in L1); rows hsc_estimate takes. */
enum { HASH_BLOCK = 512, ESTIMATE_MAX_ROWS = 16 };

#define PRIME 0x7FFFFFFFu          /* p = 2^31 - 1 */
#define MIX_MULTIPLIER 0x7FEB352Du
#define MAX_COORDINATES (1LL << 30) /* x < 2^30: the low limb is x itself */

/* (a x + b) mod p for a, b < p and x < 2^30: 2^31 = 1 (mod p), so folding the bits above 31 onto
 * the low ones keeps the residue; two folds bring a x + b < 2^62 to at most p. */
static inline uint32_t carter_wegman(uint64_t a, uint64_t b, uint64_t x) {
    uint64_t g = a * x + b;
    g = (g & PRIME) + (g >> 31);  /* < 2^31 + 2^31 */
    g = (g & PRIME) + (g >> 31);  /* <= p */
    return (uint32_t)(g == PRIME ? 0 : g);
}

/* The xorshift-multiply bijection of [0, 2^32) (sketch.py's mix32_). */
static inline uint32_t mix32(uint32_t h) {
    h ^= h >> 16;
    h *= MIX_MULTIPLIER;
    return h ^ (h >> 15);
}

/* Buckets h_j(x) and signs s_j(x) (+-1.0f) of the n coordinates x0..x0+n of the row with seeds a, b. */
static void hash_block(uint64_t a, uint64_t b, int64_t x0, int n, uint64_t columns, uint32_t *bucket,
                       float *sign) {
    int i = 0;
#ifdef __AVX512F__
    if (n >= 16) {
        uint32_t first[16];
        for (int l = 0; l < 16; l++) first[l] = carter_wegman(a, b, (uint64_t)(x0 + l));
        __m512i g = _mm512_loadu_si512(first);
        const __m512i step = _mm512_set1_epi32((int)carter_wegman(a, 0, 16)), p = _mm512_set1_epi32((int)PRIME);
        const __m512i mult = _mm512_set1_epi32((int)MIX_MULTIPLIER), cols = _mm512_set1_epi64((int64_t)columns);
        const __m512 plus = _mm512_set1_ps(1.0f), minus = _mm512_set1_ps(-1.0f);
        for (; i + 16 <= n; i += 16) {
            __m512i m = _mm512_xor_si512(g, _mm512_srli_epi32(g, 16));
            m = _mm512_mullo_epi32(m, mult);
            m = _mm512_xor_si512(m, _mm512_srli_epi32(m, 15));
            /* (m c) >> 32 by 32 x 32 -> 64-bit products: the even lanes' high halves shifted down
             * into place, the odd lanes' high halves already in theirs. */
            const __m512i even = _mm512_srli_epi64(_mm512_mul_epu32(m, cols), 32);
            const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(m, 32), cols);
            _mm512_storeu_si512(bucket + i, _mm512_mask_blend_epi32(0xAAAA, even, odd));
            _mm512_storeu_ps(sign + i, _mm512_mask_blend_ps(_mm512_test_epi32_mask(m, _mm512_set1_epi32(1)),
                                                            plus, minus));
            /* g + 16 a mod p: the sum is below 2^32; when it is below p, s - p wraps above it. */
            const __m512i s = _mm512_add_epi32(g, step);
            g = _mm512_min_epu32(s, _mm512_sub_epi32(s, p));
        }
    }
#endif
    uint32_t g = carter_wegman(a, b, (uint64_t)(x0 + i));
    for (; i < n; i++) {
        const uint32_t m = mix32(g);
        bucket[i] = (uint32_t)(((uint64_t)m * columns) >> 32);
        sign[i] = (m & 1) ? -1.0f : 1.0f;
        g += (uint32_t)a;  /* < 2p < 2^32 */
        g = g >= PRIME ? g - PRIME : g;
    }
}

int hsc_sketch_lanes(void) {
#ifdef __AVX512F__
    return 16;
#else
    return 1;
#endif
}

/* table[b] (rows x columns, zeros on entry) += S(v[b]) for each of the batch rows of v (numel
 * entries each); seeds holds (a_j, a'_j, b_j) per row. A cell's terms s_j(x) v[x] are added in
 * increasing x, from +0.0f (torch's index_add_ over the chunks of CountSketch._chunks). One table
 * row at a time, over all coordinates: a row (c floats) stays in L2 where the whole table may not,
 * for one more read of v per row. Returns 0; 1 (nothing written) beyond 2^30 coordinates. */
int hsc_sketch(const float *restrict v, int64_t batch, int64_t numel, const int64_t *restrict seeds,
               int64_t rows, int64_t columns, float *restrict table) {
    if (numel > MAX_COORDINATES || columns < 1) return 1;
    uint32_t bucket[HASH_BLOCK];
    float sign[HASH_BLOCK];
    for (int64_t j = 0; j < rows; j++) {
        for (int64_t x0 = 0; x0 < numel; x0 += HASH_BLOCK) {
            const int n = (int)(numel - x0 < HASH_BLOCK ? numel - x0 : HASH_BLOCK);
            hash_block((uint64_t)seeds[3 * j], (uint64_t)seeds[3 * j + 2], x0, n, (uint64_t)columns, bucket, sign);
            for (int64_t b = 0; b < batch; b++) {
                float *restrict cells = table + (b * rows + j) * columns;
                const float *restrict vb = v + b * numel + x0;
                for (int i = 0; i < n; i++) cells[bucket[i]] += vb[i] * sign[i];
            }
        }
    }
    return 0;
}

/* The lower median of x[0], x[stride], ..., x[(rows - 1) stride] as torch.median takes it: the
 * first NaN if there is one, else the element of rank (rows - 1) / 2 when they are ordered by value,
 * then by position (so which of +0.0 and -0.0 comes out is torch's). */
static float lower_median(const float *x, int64_t stride, int64_t rows) {
    for (int64_t j = 0; j < rows; j++)
        if (x[j * stride] != x[j * stride]) return x[j * stride];
    const int64_t k = (rows - 1) / 2;
    for (int64_t i = 0; i < rows; i++) {
        const float xi = x[i * stride];
        int64_t rank = 0;
        for (int64_t j = 0; j < rows; j++) {
            const float xj = x[j * stride];
            rank += xj < xi || (xj == xi && j < i);
        }
        if (rank == k) return xi;
    }
    return x[0];  /* not reached: the ranks are 0..rows-1 */
}

/* out[i] for the n coordinates of a block, from vals[j * HASH_BLOCK + i] = s_j(x) S[j, h_j(x)].
 * Inlined with a constant row count where hsc_estimate has one: the rows' vectors stay in registers. */
static inline __attribute__((always_inline)) void median_block(const float *vals, int64_t rows, int n, float *out) {
    int i = 0;
#ifdef __AVX512F__
    const int k = (int)((rows - 1) / 2);
    const __m512i one = _mm512_set1_epi32(1), vk = _mm512_set1_epi32(k);
    for (; i + 16 <= n; i += 16) {
        __m512 x[ESTIMATE_MAX_ROWS];
        __m512i rank[ESTIMATE_MAX_ROWS];
        __mmask16 nan = 0;
        for (int64_t j = 0; j < rows; j++) {
            x[j] = _mm512_loadu_ps(vals + j * HASH_BLOCK + i);
            rank[j] = _mm512_setzero_si512();
            nan |= _mm512_cmp_ps_mask(x[j], x[j], _CMP_UNORD_Q);
        }
        if (nan) {  /* rare: torch's NaN rule, lane by lane */
            for (int l = 0; l < 16; l++) out[i + l] = lower_median(vals + i + l, HASH_BLOCK, rows);
            continue;
        }
        /* Rank of each row in the (value, row) order: x_j1 comes before x_j2 (j1 < j2) iff x_j1 <= x_j2. */
        for (int64_t j1 = 0; j1 < rows; j1++)
            for (int64_t j2 = j1 + 1; j2 < rows; j2++) {
                const __mmask16 before = _mm512_cmp_ps_mask(x[j1], x[j2], _CMP_LE_OQ);
                rank[j2] = _mm512_mask_add_epi32(rank[j2], before, rank[j2], one);
                rank[j1] = _mm512_mask_add_epi32(rank[j1], (__mmask16)~before, rank[j1], one);
            }
        __m512 median = x[0];
        for (int64_t j = 0; j < rows; j++)
            median = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(rank[j], vk), median, x[j]);
        _mm512_storeu_ps(out + i, median);
    }
#endif
    for (; i < n; i++) out[i] = lower_median(vals + i, HASH_BLOCK, rows);
}

/* out[b][x] = the median over rows j of s_j(x) table[b][j][h_j(x)] for the batch tables (rows x
 * columns each) and numel coordinates: torch's per_row.median(dim=1).values, NaN included. Returns
 * 0; 1 (nothing written) for more than ESTIMATE_MAX_ROWS rows or 2^30 coordinates. */
int hsc_estimate(const float *restrict table, int64_t batch, int64_t numel, const int64_t *restrict seeds,
                 int64_t rows, int64_t columns, float *restrict out) {
    if (numel > MAX_COORDINATES || columns < 1 || rows < 1 || rows > ESTIMATE_MAX_ROWS) return 1;
    uint32_t bucket[HASH_BLOCK];
    float sign[HASH_BLOCK];
    float vals[ESTIMATE_MAX_ROWS * HASH_BLOCK];
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t x0 = 0; x0 < numel; x0 += HASH_BLOCK) {
            const int n = (int)(numel - x0 < HASH_BLOCK ? numel - x0 : HASH_BLOCK);
            for (int64_t j = 0; j < rows; j++) {
                const float *restrict cells = table + (b * rows + j) * columns;
                float *restrict row = vals + j * HASH_BLOCK;
                hash_block((uint64_t)seeds[3 * j], (uint64_t)seeds[3 * j + 2], x0, n, (uint64_t)columns, bucket,
                           sign);
                int i = 0;
#ifdef __AVX512F__
                for (; i + 16 <= n; i += 16) {
                    const __m512 at = _mm512_i32gather_ps(_mm512_loadu_si512(bucket + i), cells, 4);
                    _mm512_storeu_ps(row + i, _mm512_mul_ps(at, _mm512_loadu_ps(sign + i)));
                }
#endif
                for (; i < n; i++) row[i] = cells[bucket[i]] * sign[i];
            }
            float *o = out + b * numel + x0;
            switch (rows) {
                case 1: median_block(vals, 1, n, o); break;
                case 2: median_block(vals, 2, n, o); break;
                case 3: median_block(vals, 3, n, o); break;
                case 4: median_block(vals, 4, n, o); break;
                case 5: median_block(vals, 5, n, o); break;
                case 6: median_block(vals, 6, n, o); break;
                case 7: median_block(vals, 7, n, o); break;
                default: median_block(vals, rows, n, o);
            }
        }
    }
    return 0;
}
