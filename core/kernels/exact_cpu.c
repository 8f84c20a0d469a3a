/* Row-exact CPU kernels for the engine's exact mode (core/kernels/exact_cpu.py loads this file).
 *
 * Every result here is fixed by C's semantics alone: the file is compiled with -ffp-contract=off and without
 * -ffast-math, so the compiler may vectorise but may not reorder, fuse or approximate a floating-point operation;
 * every fused multiply-add is an explicit fmaf (one rounding, whether the CPU has FMA or libm emulates it); exp is
 * our own polynomial, not libm's. A row's output therefore depends only on that row's inputs, in the order given,
 * never on how many rows share the call, where they sit in memory or which vector width the CPU has. This is what
 * makes a token's logits the same whether it is decoded alone or verified inside a chain or a tree.
 *
 * Lane sums: a sum over n terms is accumulated in 16 lanes by the term's index mod 16 (term i goes to lane i % 16,
 * terms in increasing i), then the lanes are added pairwise in a fixed tree. Zero terms pad n up to a multiple of 16.
 */
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ---- attention ------------------------------------------------------------------------------------------------
 * GCC vector extensions: element-wise IEEE operations on 16 lanes, lowered to whatever vector width the CPU has;
 * the result of each lane is the same on all of them. Products and sums stay separate (no fused multiply-add). */
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef float vf_unaligned __attribute__((vector_size(LANES * sizeof(float)), aligned(sizeof(float))));

/* c in every lane, as 0 + c (a -0 becomes +0). On AVX2, GCC built (vf){0} + c lane by lane through memory, which
 * made it the costliest line of the attention kernel: there it is one broadcast into both halves. */
#if !defined(__AVX512F__) && defined(__AVX__)
union halves {
    vf v;
    __m256 h[2];
};
static inline vf splat(float c) {
    union halves r;
    r.h[0] = r.h[1] = _mm256_set1_ps(0.0f + c);
    return r.v;
}
#else
static inline vf splat(float c) { return (vf){0} + c; }
#endif

/* a * b + c with one rounding in every lane: the same bits from the AVX-512 instruction, two AVX2 ones or libm's
 * fmaf (IEEE 754 fixes the fused result). */
static inline vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    /* two 8-lane halves (AVX2): GCC left the per-lane loop below as 16 scalar fmaf in the attention kernel, which
     * made it the slowest part of an exact prefill */
    union halves x = {a}, y = {b}, z = {c}, r;
    r.h[0] = _mm256_fmadd_ps(x.h[0], y.h[0], z.h[0]);
    r.h[1] = _mm256_fmadd_ps(x.h[1], y.h[1], z.h[1]);
    return r.v;
#else
    vf r;
    for (int l = 0; l < LANES; l++) r[l] = fmaf(a[l], b[l], c[l]);
    return r;
#endif
}
static inline vf vselect(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

static inline float vtotal(vf v) { /* lanes added pairwise: l + l+8, then l + l+4, l + l+2, l + l+1 */
    v = v + __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v = v + __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v = v + __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v = v + __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return v[0];
}

/* exp on 16 lanes, Cephes' polynomial; inputs clamped to [-87, 88]. */
static inline vf vexp(vf x) {
    x = vselect(x < splat(-87.0f), splat(-87.0f), x);
    x = vselect(x > splat(88.0f), splat(88.0f), x);
    const vf magic = splat(12582912.0f); /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    vf n = (x * splat(1.44269504088896341f) + magic) - magic;
    vf r = x - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    vf y = (p * (r * r) + r) + splat(1.0f);
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return y * (vf)bits;
}

/* 16 values from x (bf16 or fp32) starting at i, zero past n. */
static inline vf load16(const void *x, int is_bf16, long i, long n) {
    vf v = {0};
    if (i + LANES <= n) { /* the common case, written so that it vectorises */
        if (!is_bf16) return *(const vf_unaligned *)((const float *)x + i);
        const uint16_t *h = (const uint16_t *)x + i;
        vi bits;
        for (int l = 0; l < LANES; l++) bits[l] = (int32_t)((uint32_t)h[l] << 16);
        return (vf)bits;
    }
    for (int l = 0; l < LANES && i + l < n; l++)
        v[l] = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[i + l]) : ((const float *)x)[i + l];
    return v;
}

/* x [rows, dim] (bf16 or fp32) -> out [rows, dim] fp32: x * (1 / sqrt(mean(x^2) + eps)), as RMSNorm before its
 * cast and weight; x^2 summed in lanes i % 16 (products fused into the sum), then the lanes pairwise. */
void exact_rms_scale(const void *x, int is_bf16, long rows, int dim, float eps, float *out) {
    for (long r = 0; r < rows; r++) {
        vf acc = {0};
        for (int i = 0; i < dim; i += LANES) {
            const vf v = load16(x, is_bf16, r * dim + i, r * dim + dim);
            acc = vfma(v, v, acc);
        }
        const float inv = 1.0f / sqrtf(vtotal(acc) / (float)dim + eps);
        for (int i = 0; i < dim; i += LANES) {
            const vf v = load16(x, is_bf16, r * dim + i, r * dim + dim) * inv;
            if (i + LANES <= dim) *(vf_unaligned *)(out + r * dim + i) = v;
            else for (int l = 0; i + l < dim; l++) out[r * dim + i + l] = v[l];
        }
    }
}

/* x [n] (bf16 or fp32) -> out [n] fp32: x / (1 + exp(-x)), SiLU. */
void exact_silu(const void *x, int is_bf16, long n, float *out) {
    for (long i = 0; i < n; i += LANES) {
        const vf v = load16(x, is_bf16, i, n);
        const vf y = v / (splat(1.0f) + vexp(-v));
        if (i + LANES <= n) *(vf_unaligned *)(out + i) = y;
        else for (int l = 0; i + l < n; l++) out[i + l] = y[l];
    }
}

/* x [n] (bf16 or fp32) -> out [n] fp32: 1 / (1 + exp(-x)), the sigmoid. */
void exact_sigmoid(const void *x, int is_bf16, long n, float *out) {
    for (long i = 0; i < n; i += LANES) {
        const vf y = splat(1.0f) / (splat(1.0f) + vexp(-load16(x, is_bf16, i, n)));
        if (i + LANES <= n) *(vf_unaligned *)(out + i) = y;
        else for (int l = 0; i + l < n; l++) out[i + l] = y[l];
    }
}

/* The router of a sparse mixture-of-experts MLP, row by row. x [rows, E] router logits (bf16 or fp32) ->
 *   p_i = exp(x_i - max x) / total (exp by vexp; the total summed in lanes i % 16, then pairwise),
 *   experts [rows, k]: the k largest p in decreasing order (equal p: the lower index first),
 *   weights [rows, k]: their p, or with norm each divided by (p_0 + p_1 + ... + p_{k-1}), added in that order.
 * scratch: at least E + 16 floats. */
void exact_route(const void *x, int is_bf16, long rows, int E, int k, int norm, float *weights, int64_t *experts,
                 float *scratch) {
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (long r = 0; r < rows; r++) {
        const long base = r * E;
        float m = -INFINITY;
        for (int i = 0; i < E; i++) {
            const float v = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[base + i]) : ((const float *)x)[base + i];
            if (v > m) m = v;
        }
        vf acc = {0};
        for (int i = 0; i < E; i += LANES) {
            const vf e = vselect(lane + i < E, vexp(load16(x, is_bf16, base + i, base + E) - splat(m)), splat(0.0f));
            *(vf_unaligned *)(scratch + i) = e;
            acc = acc + e;
        }
        const float total = vtotal(acc);
        for (int i = 0; i < E; i++) scratch[i] = scratch[i] / total;
        float sum = 0.0f;
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int i = 0; i < E; i++) {
                int taken = 0;
                for (int t = 0; t < j; t++) taken |= experts[r * k + t] == i;
                if (!taken && (best < 0 || scratch[i] > scratch[best])) best = i;
            }
            experts[r * k + j] = best;
            weights[r * k + j] = scratch[best];
            sum = sum + scratch[best];
        }
        if (norm)
            for (int j = 0; j < k; j++) weights[r * k + j] = weights[r * k + j] / sum;
    }
}

/* Attention for the new tokens of one cache row, over an fp32 cache.
 * q      [T, H, D], contiguous (after RoPE)
 * kt     the row's keys, transposed: (kv head h, d, slot s) at [h * kt_head + d * kt_dim + s]
 * v      the row's values: (kv head h, slot s, d) at [h * v_head + s * D + d]
 * keys   token t attends to slots 0 .. prefix[t]-1, then extra[offsets[t] .. offsets[t+1]-1], in that order: its
 *        path, oldest first. Decoding the path token by token hands each token the same list.
 * out    [T, H, D]
 * Query head g of kv head h is h * (H / KV) + g (grouped-query attention).
 *
 * Per query, with key i of its list at slot s_i (every a * b + c below is one fused multiply-add):
 *   score_i = ((A0 + A1) + (A2 + A3)) * scale, A_r = q[d] * k[d] + A_r over d = r mod 4 in increasing order
 *   m = max score;  p_i = exp(score_i - m);  out[d] = (p_i * v_i[d] + ..., i increasing) / (sum of p in lanes i % 16)
 * Scores are computed 16 keys at a time, one key per lane. Work is split in units of (kv head, group of tokens); the
 * tokens of a unit share each loaded key tile, which changes no result. */
#define GROUP 8
#define HEADS 4 /* query heads scored together (a kv head's group is done in blocks of this many) */

typedef struct {
    const float *q, *kt, *v;
    long kt_head, kt_dim, v_head;
    int T, H, KV, D;
    const int32_t *prefix, *offsets, *extra;
    float scale;
    float *out;
} attention_job;

/* Scores of up to HEADS queries (q[j], D each; unused ones are zero) against the 16 keys whose transposed columns
 * start at kt (column d at kt + d * stride). */
static inline __attribute__((always_inline)) void scores16_n(const float *const q[HEADS], const float *kt,
                                                             long stride, int D, float scale, vf out[HEADS],
                                                             const int NQ) {
    vf a0[HEADS], a1[HEADS], a2[HEADS], a3[HEADS];
    for (int j = 0; j < NQ; j++) a0[j] = a1[j] = a2[j] = a3[j] = splat(0.0f);
    int d = 0;
    for (; d + 4 <= D; d += 4) {
        const vf k0 = *(const vf_unaligned *)(kt + d * stride), k1 = *(const vf_unaligned *)(kt + (d + 1) * stride);
        const vf k2 = *(const vf_unaligned *)(kt + (d + 2) * stride), k3 = *(const vf_unaligned *)(kt + (d + 3) * stride);
        for (int j = 0; j < NQ; j++) {
            a0[j] = vfma(splat(q[j][d]), k0, a0[j]);
            a1[j] = vfma(splat(q[j][d + 1]), k1, a1[j]);
            a2[j] = vfma(splat(q[j][d + 2]), k2, a2[j]);
            a3[j] = vfma(splat(q[j][d + 3]), k3, a3[j]);
        }
    }
    for (int j = 0; j < NQ; j++) { /* D not a multiple of 4: the tail goes to A0, A1, A2 in turn */
        if (d < D) a0[j] = vfma(splat(q[j][d]), *(const vf_unaligned *)(kt + d * stride), a0[j]);
        if (d + 1 < D) a1[j] = vfma(splat(q[j][d + 1]), *(const vf_unaligned *)(kt + (d + 1) * stride), a1[j]);
        if (d + 2 < D) a2[j] = vfma(splat(q[j][d + 2]), *(const vf_unaligned *)(kt + (d + 2) * stride), a2[j]);
    }
    for (int j = 0; j < NQ; j++) out[j] = ((a0[j] + a1[j]) + (a2[j] + a3[j])) * scale;
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* scores16_n on AVX2 (16 vector registers: 4 partial sums of 16 lanes for 3 or 4 queries would live in memory): 8 keys
 * at a time, up to 3 queries, each lane still A_r = q[d] * k[d] + A_r over d = r mod 4 in increasing order, then
 * ((A0 + A1) + (A2 + A3)) * scale: the same bits. */
#define ATTENTION_AVX2 1
static inline __attribute__((always_inline)) void scores8_n(const float *const *q, const float *kt, long stride, int D,
                                                            float scale, float *out[], const int NQ) {
    __m256 a0[3], a1[3], a2[3], a3[3];
    for (int j = 0; j < NQ; j++) a0[j] = a1[j] = a2[j] = a3[j] = _mm256_setzero_ps();
    int d = 0;
    for (; d + 4 <= D; d += 4) {
        const __m256 k0 = _mm256_loadu_ps(kt + d * stride);
        for (int j = 0; j < NQ; j++) a0[j] = _mm256_fmadd_ps(_mm256_set1_ps(q[j][d]), k0, a0[j]);
        const __m256 k1 = _mm256_loadu_ps(kt + (d + 1) * stride);
        for (int j = 0; j < NQ; j++) a1[j] = _mm256_fmadd_ps(_mm256_set1_ps(q[j][d + 1]), k1, a1[j]);
        const __m256 k2 = _mm256_loadu_ps(kt + (d + 2) * stride);
        for (int j = 0; j < NQ; j++) a2[j] = _mm256_fmadd_ps(_mm256_set1_ps(q[j][d + 2]), k2, a2[j]);
        const __m256 k3 = _mm256_loadu_ps(kt + (d + 3) * stride);
        for (int j = 0; j < NQ; j++) a3[j] = _mm256_fmadd_ps(_mm256_set1_ps(q[j][d + 3]), k3, a3[j]);
    }
    for (int j = 0; j < NQ; j++) { /* the tail, as scores16_n takes it */
        if (d < D) a0[j] = _mm256_fmadd_ps(_mm256_set1_ps(q[j][d]), _mm256_loadu_ps(kt + d * stride), a0[j]);
        if (d + 1 < D)
            a1[j] = _mm256_fmadd_ps(_mm256_set1_ps(q[j][d + 1]), _mm256_loadu_ps(kt + (d + 1) * stride), a1[j]);
        if (d + 2 < D)
            a2[j] = _mm256_fmadd_ps(_mm256_set1_ps(q[j][d + 2]), _mm256_loadu_ps(kt + (d + 2) * stride), a2[j]);
    }
    for (int j = 0; j < NQ; j++)
        _mm256_storeu_ps(out[j], _mm256_mul_ps(_mm256_add_ps(_mm256_add_ps(a0[j], a1[j]), _mm256_add_ps(a2[j], a3[j])),
                                               _mm256_set1_ps(scale)));
}
#endif

/* The same for nq (1..HEADS) queries: each count compiled on its own, so no lane of work is wasted. */
static void scores16(const float *const q[HEADS], const float *kt, long stride, int D, float scale, vf out[HEADS],
                     int nq) {
#ifdef ATTENTION_AVX2
    for (int half = 0; half < 2; half++)
        for (int j0 = 0; j0 < nq; j0 += 3) {
            float *dst[3];
            for (int j = 0; j < 3; j++) dst[j] = (float *)&out[j0 + j < HEADS ? j0 + j : 0] + 8 * half;
            switch (nq - j0 < 3 ? nq - j0 : 3) {
            case 1: scores8_n(q + j0, kt + 8 * half, stride, D, scale, dst, 1); break;
            case 2: scores8_n(q + j0, kt + 8 * half, stride, D, scale, dst, 2); break;
            default: scores8_n(q + j0, kt + 8 * half, stride, D, scale, dst, 3); break;
            }
        }
#else
    switch (nq) {
    case 1: scores16_n(q, kt, stride, D, scale, out, 1); break;
    case 2: scores16_n(q, kt, stride, D, scale, out, 2); break;
    case 3: scores16_n(q, kt, stride, D, scale, out, 3); break;
    default: scores16_n(q, kt, stride, D, scale, out, HEADS); break;
    }
#endif
}

/* out[c] = p[i] * row_i[c] + out[c] for rows i in [lo, hi) in order, rows at v + slot * D: the partial sums live in
 * `out` between calls, so a query's sum over its keys can be taken in blocks (still in key order). */
#ifdef ATTENTION_AVX2
/* On AVX2: 64 features at a time in 8 registers (then 32, 8, 1), each output the same fused multiply-adds in the same
 * order as below (the weights p are never -0, so broadcasting p[i] is splat(p[i])). */
static inline __attribute__((always_inline)) void accumulate_width(const float *p, const float *v, long D, int lo,
                                                                   int hi, const int32_t *slots, float *out,
                                                                   const int W) {
    __m256 a[8];
    for (int j = 0; j < W; j++) a[j] = _mm256_loadu_ps(out + 8 * j);
    for (int i = lo; i < hi; i++) {
        const float *row = v + (slots ? slots[i] : i) * D;
        const __m256 w = _mm256_set1_ps(p[i]);
        for (int j = 0; j < W; j++) a[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * j), a[j]);
    }
    for (int j = 0; j < W; j++) _mm256_storeu_ps(out + 8 * j, a[j]);
}

static inline void accumulate_values(const float *p, const float *v, long D, int lo, int hi, const int32_t *slots,
                                     float *out) {
    long c0 = 0;
    for (; c0 + 64 <= D; c0 += 64) accumulate_width(p, v + c0, D, lo, hi, slots, out + c0, 8);
    for (; c0 + 32 <= D; c0 += 32) accumulate_width(p, v + c0, D, lo, hi, slots, out + c0, 4);
    for (; c0 + 8 <= D; c0 += 8) accumulate_width(p, v + c0, D, lo, hi, slots, out + c0, 1);
    for (; c0 < D; c0++) {
        float a = out[c0];
        for (int i = lo; i < hi; i++) a = fmaf(p[i], v[(slots ? slots[i] : i) * D + c0], a);
        out[c0] = a;
    }
}
#else
static inline void accumulate_values(const float *p, const float *v, long D, int lo, int hi, const int32_t *slots,
                                     float *out) {
    int c0 = 0;
    for (; c0 + 4 * LANES <= D; c0 += 4 * LANES) {
        vf a0 = *(vf_unaligned *)(out + c0), a1 = *(vf_unaligned *)(out + c0 + LANES);
        vf a2 = *(vf_unaligned *)(out + c0 + 2 * LANES), a3 = *(vf_unaligned *)(out + c0 + 3 * LANES);
        for (int i = lo; i < hi; i++) {
            const float *row = v + (slots ? slots[i] : i) * D + c0;
            const vf w = splat(p[i]);
            a0 = vfma(w, *(const vf_unaligned *)row, a0);
            a1 = vfma(w, *(const vf_unaligned *)(row + LANES), a1);
            a2 = vfma(w, *(const vf_unaligned *)(row + 2 * LANES), a2);
            a3 = vfma(w, *(const vf_unaligned *)(row + 3 * LANES), a3);
        }
        *(vf_unaligned *)(out + c0) = a0;
        *(vf_unaligned *)(out + c0 + LANES) = a1;
        *(vf_unaligned *)(out + c0 + 2 * LANES) = a2;
        *(vf_unaligned *)(out + c0 + 3 * LANES) = a3;
    }
    for (; c0 + LANES <= D; c0 += LANES) {
        vf a0 = *(vf_unaligned *)(out + c0);
        for (int i = lo; i < hi; i++)
            a0 = vfma(splat(p[i]), *(const vf_unaligned *)(v + (slots ? slots[i] : i) * D + c0), a0);
        *(vf_unaligned *)(out + c0) = a0;
    }
    for (; c0 < D; c0++) {
        float a = out[c0];
        for (int i = lo; i < hi; i++) a = fmaf(p[i], v[(slots ? slots[i] : i) * D + c0], a);
        out[c0] = a;
    }
}
#endif

/* s[0 .. 16 nv) (64-byte aligned) -> exp(s_i - max s), 0 where s_i = -inf; returns their total in lanes i % 16. */
#ifdef ATTENTION_AVX2
/* On AVX2: two 8-lane halves (lanes 0-7 and 8-15 of each 16), the same operations lane by lane as vexp, vselect and
 * vtotal below (GCC compiled their 16-lane selects and conversions piece by piece through memory here). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_blendv_ps(x, _mm256_set1_ps(-87.0f), _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ));
    x = _mm256_blendv_ps(x, _mm256_set1_ps(88.0f), _mm256_cmp_ps(x, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), magic), magic);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

static inline float softmax_weights(float *s, int nv) {
    __m256 m[2] = {_mm256_load_ps(s), _mm256_load_ps(s + 8)};
    for (int c = 1; c < nv; c++)
        for (int h = 0; h < 2; h++) {
            const __m256 v = _mm256_load_ps(s + c * LANES + 8 * h);
            m[h] = _mm256_blendv_ps(m[h], v, _mm256_cmp_ps(v, m[h], _CMP_GT_OQ));
        }
    float lanes[LANES];
    _mm256_storeu_ps(lanes, m[0]);
    _mm256_storeu_ps(lanes + 8, m[1]);
    float mx = lanes[0];
    for (int l = 1; l < LANES; l++) mx = lanes[l] > mx ? lanes[l] : mx;
    const __m256 top = _mm256_set1_ps(mx), none = _mm256_set1_ps(-INFINITY), zero = _mm256_setzero_ps();
    __m256 total[2] = {zero, zero};
    for (int c = 0; c < nv; c++)
        for (int h = 0; h < 2; h++) {
            const __m256 v = _mm256_load_ps(s + c * LANES + 8 * h);
            const __m256 e = _mm256_blendv_ps(exp8(_mm256_sub_ps(v, top)), zero, _mm256_cmp_ps(v, none, _CMP_EQ_OQ));
            _mm256_store_ps(s + c * LANES + 8 * h, e);
            total[h] = _mm256_add_ps(total[h], e);
        }
    /* vtotal: lane l + lane l+8, then l + l+4, l + l+2, l + l+1 */
    __m256 v = _mm256_add_ps(total[0], total[1]);
    v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 1));
    v = _mm256_add_ps(v, _mm256_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
    v = _mm256_add_ps(v, _mm256_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm256_cvtss_f32(v);
}
#else
static inline float softmax_weights(float *s, int nv) {
    vf *sv = (vf *)s;
    vf m = sv[0];
    for (int c = 1; c < nv; c++) m = vselect(sv[c] > m, sv[c], m);
    float mx = m[0];
    for (int l = 1; l < LANES; l++) mx = m[l] > mx ? m[l] : mx;
    vf total = {0};
    for (int c = 0; c < nv; c++) {
        sv[c] = vselect(sv[c] == splat(-INFINITY), splat(0.0f), vexp(sv[c] - mx));
        total = total + sv[c];
    }
    return vtotal(total);
}
#endif

typedef struct {
    float *scores; /* [GROUP * G][Np] */
    float *tile;   /* [D][LANES]: gathered key columns */
    float *totals; /* [GROUP * G] */
    int Np;
} scratch;

#define KEY_BLOCK 64 /* keys whose values stay in L1 while every query of a unit takes them */

static void attention_unit(const attention_job *job, int unit, scratch *sc) {
    const int D = job->D, G = job->H / job->KV, Np = sc->Np;
    const int groups = (job->T + GROUP - 1) / GROUP;
    const int h = unit / groups, t0 = unit % groups * GROUP;
    const int t1 = t0 + GROUP < job->T ? t0 + GROUP : job->T;
    const float *kt = job->kt + (long)h * job->kt_head, *v = job->v + (long)h * job->v_head;
    int shared = 0; /* the longest prefix in the unit */
    for (int t = t0; t < t1; t++) shared = job->prefix[t] > shared ? job->prefix[t] : shared;
    /* scores over the prefixes, tile by tile, each tile taken by every query of the unit while it is in L1 (slots
     * past a token's prefix are computed and overwritten below) */
    for (int i = 0; i < shared; i += LANES)
        for (int t = t0; t < t1; t++) {
            if (i >= job->prefix[t]) continue;
            for (int g0 = 0; g0 < G; g0 += HEADS) {
                const float *q[HEADS];
                const int nq = G - g0 < HEADS ? G - g0 : HEADS;
                for (int j = 0; j < nq; j++) q[j] = job->q + ((long)t * job->H + h * G + g0 + j) * D;
                vf out[HEADS];
                scores16(q, kt + i, job->kt_dim, D, job->scale, out, nq);
                for (int j = 0; j < nq; j++)
                    *(vf_unaligned *)(sc->scores + (long)((t - t0) * G + g0 + j) * Np + i) = out[j];
            }
        }
    for (int t = t0; t < t1; t++) {
        const int prefix = job->prefix[t], n_extra = job->offsets[t + 1] - job->offsets[t];
        const int n = prefix + n_extra, nv = (n + LANES - 1) / LANES;
        const int32_t *extra = job->extra + job->offsets[t];
        /* the other keys: their columns gathered into a tile, 16 at a time, scored the same way */
        for (int e0 = 0; e0 < n_extra; e0 += LANES) {
            const int count = n_extra - e0 < LANES ? n_extra - e0 : LANES;
            for (int d = 0; d < D; d++)
                for (int l = 0; l < LANES; l++)
                    sc->tile[d * LANES + l] = l < count ? kt[(long)d * job->kt_dim + extra[e0 + l]] : 0.0f;
            for (int g0 = 0; g0 < G; g0 += HEADS) {
                const float *q[HEADS];
                const int nq = G - g0 < HEADS ? G - g0 : HEADS;
                for (int j = 0; j < nq; j++) q[j] = job->q + ((long)t * job->H + h * G + g0 + j) * D;
                vf out[HEADS];
                scores16(q, sc->tile, LANES, D, job->scale, out, nq);
                for (int j = 0; j < nq; j++)
                    for (int l = 0; l < count; l++)
                        sc->scores[(long)((t - t0) * G + g0 + j) * Np + prefix + e0 + l] = out[j][l];
            }
        }
        /* softmax weights, unnormalised, and their total */
        for (int g = 0; g < G; g++) {
            float *s = sc->scores + (long)((t - t0) * G + g) * Np;
            for (int i = n; i < nv * LANES; i++) s[i] = -INFINITY;
            sc->totals[(t - t0) * G + g] = softmax_weights(s, nv);
            float *o = job->out + ((long)t * job->H + h * G + g) * D;
            for (int d = 0; d < D; d++) o[d] = 0.0f;
        }
    }
    /* weighted values: the prefixes block by block (each block's values shared by the unit's queries), then each
     * token's other keys, then the division */
    for (int lo = 0; lo < shared; lo += KEY_BLOCK)
        for (int t = t0; t < t1; t++) {
            const int hi = lo + KEY_BLOCK < job->prefix[t] ? lo + KEY_BLOCK : job->prefix[t];
            for (int g = 0; g < G && lo < hi; g++)
                accumulate_values(sc->scores + (long)((t - t0) * G + g) * Np, v, D, lo, hi, NULL,
                                  job->out + ((long)t * job->H + h * G + g) * D);
        }
    for (int t = t0; t < t1; t++) {
        const int prefix = job->prefix[t], n_extra = job->offsets[t + 1] - job->offsets[t];
        for (int g = 0; g < G; g++) {
            float *o = job->out + ((long)t * job->H + h * G + g) * D;
            const float *s = sc->scores + (long)((t - t0) * G + g) * Np;
            accumulate_values(s + prefix, v, D, 0, n_extra, job->extra + job->offsets[t], o);
            const float total = sc->totals[(t - t0) * G + g];
            for (int d = 0; d < D; d++) o[d] = o[d] / total;
        }
    }
}

/* A slice of the units of several cache rows (unit u is unit u % per_row of row u / per_row): each row is its own
 * job, so a row's results are those it gets alone. */
typedef struct {
    const attention_job *rows;
    int per_row;
    long first, last;
} units_job;

static void *attention_units(void *arg) {
    const units_job *work = arg;
    const attention_job *first = work->rows;
    const int G = first->H / first->KV;
    int longest = 0;
    for (long u = work->first; u < work->last; u++) {
        const attention_job *job = work->rows + u / work->per_row;
        const int t0 = (int)(u % work->per_row % ((job->T + GROUP - 1) / GROUP)) * GROUP;
        for (int t = t0; t < t0 + GROUP && t < job->T; t++) {
            const int n = job->prefix[t] + job->offsets[t + 1] - job->offsets[t];
            longest = n > longest ? n : longest;
        }
    }
    scratch sc;
    sc.Np = (longest + 2 * LANES) / LANES * LANES; /* room for a full 16-wide store at any prefix tile */
    sc.scores = aligned_alloc(64, sizeof(float) * (size_t)GROUP * G * sc.Np);
    sc.tile = aligned_alloc(64, sizeof(float) * (size_t)(first->D + 1) * LANES);
    sc.totals = aligned_alloc(64, sizeof(float) * (size_t)(GROUP * G + LANES));
    for (long u = work->first; u < work->last; u++)
        attention_unit(work->rows + u / work->per_row, (int)(u % work->per_row), &sc);
    free(sc.scores);
    free(sc.tile);
    free(sc.totals);
    return NULL;
}

/* Attention for B cache rows at once, T new tokens each: row b's queries at q + b * q_row, its keys and values at
 * kt + b * kt_row and v + b * v_row, its tokens' key lists at prefix + b * T and offsets + b * T (into the shared
 * `extra`), its output at out + b * q_row. The units of every row are split over up to `threads` threads; a unit is
 * computed whole by one thread with the code a one-row call runs, so neither the split nor the other rows change a
 * result. */
void exact_attention_rows(int B, const float *q, long q_row, const float *kt, long kt_row, const float *v, long v_row,
                          long kt_head, long kt_dim, long v_head, int T, int H, int KV, int D, const int32_t *prefix,
                          const int32_t *offsets, const int32_t *extra, float scale, float *out, int threads) {
    const int per_row = KV * ((T + GROUP - 1) / GROUP);
    const long units = (long)B * per_row;
    attention_job *rows = malloc(sizeof(attention_job) * (size_t)B);
    for (int b = 0; b < B; b++)
        rows[b] = (attention_job){q + b * q_row, kt + b * kt_row, v + b * v_row, kt_head, kt_dim, v_head, T, H, KV, D,
                                  prefix + (long)b * T, offsets + (long)b * T, extra, scale, out + b * q_row};
    if (threads > units) threads = (int)units;
    if (threads < 1) threads = 1;
    units_job jobs[threads];
    pthread_t ids[threads];
    for (int i = 0; i < threads; i++) jobs[i] = (units_job){rows, per_row, units * i / threads, units * (i + 1) / threads};
    for (int i = 1; i < threads; i++) pthread_create(&ids[i], NULL, attention_units, &jobs[i]);
    attention_units(&jobs[0]);
    for (int i = 1; i < threads; i++) pthread_join(ids[i], NULL);
    free(rows);
}

/* One cache row: exact_attention_rows with B = 1. */
void exact_attention(const float *q, const float *kt, const float *v, long kt_head, long kt_dim, long v_head, int T,
                     int H, int KV, int D, const int32_t *prefix, const int32_t *offsets, const int32_t *extra,
                     float scale, float *out, int threads) {
    exact_attention_rows(1, q, 0, kt, 0, v, 0, kt_head, kt_dim, v_head, T, H, KV, D, prefix, offsets, extra, scale,
                         out, threads);
}

/* ---- fp32 linear -------------------------------------------------------------------------------------------------
 * out[m][n] = (x[m][0] * w[n][0] + ... + x[m][K-1] * w[n][K-1]) + bias[n]: one fused multiply-add per k, in increasing
 * k, for every output alike, so a row's outputs never depend on how many rows share the call (MKL's fp32 GEMM keeps a
 * row's bits only inside full 4-row tiles). wt is the weight transposed tile by tile, [Np / 16][K][16] with Np = N
 * rounded up to 16 and zero columns after N: a tile's 16 columns are contiguous over k (a row-major [K][Np] layout put
 * a block's k rows Np floats apart, which for Np = 1536 mapped them onto two L1 sets). Rows are taken 4 at a time
 * (6 on AVX2, then the rest together, then 1) against 64 columns (or fewer at the end); k runs in blocks of KB so
 * that a block of the weight stays in L1 while every row takes it, the partial sums kept in `out` between blocks (an
 * fp32 store and load: the same value). */
#define KB 96

static inline __attribute__((always_inline)) void linear_block(const float *x, long K, const float *wt, long Np,
                                                               long n0, long k0, long k1, int cols,
                                                               float *const out[4], const int MB) {
    vf acc[4][4];
    for (int m = 0; m < MB; m++)
        for (int c = 0; c < cols; c++)
            acc[m][c] = k0 == 0 ? splat(0.0f) : *(const vf_unaligned *)(out[m] + n0 + c * LANES);
    for (long k = k0; k < k1; k++) {
        vf wv[4];
        for (int c = 0; c < cols; c++) wv[c] = *(const vf_unaligned *)(wt + ((n0 / LANES + c) * K + k) * LANES);
        for (int m = 0; m < MB; m++) {
            const vf xv = splat(x[m * K + k]);
            for (int c = 0; c < cols; c++) acc[m][c] = vfma(xv, wv[c], acc[m][c]);
        }
    }
    for (int m = 0; m < MB; m++)
        for (int c = 0; c < cols; c++) *(vf_unaligned *)(out[m] + n0 + c * LANES) = acc[m][c];
}

#if !defined(__AVX512F__) && defined(__FMA__)
/* The same block on AVX2 (16 vector registers: the 16-lane tiles above would live in memory): 16 columns at a time
 * as two 8-lane halves, each output still one fused multiply-add per k in increasing k, so the bits are the same. */
#define LINEAR_AVX2 1
#define AVX2_ROWS 6 /* rows taken together: 12 of the 16 vector registers hold partial sums */
static inline __attribute__((always_inline)) void linear_block_avx2(const float *x, long K, const float *wt, long Np,
                                                                    long n0, long k0, long k1, int cols,
                                                                    float *const out[AVX2_ROWS], const int MB) {
    if (MB == 1) {
        /* One row: all (up to) 4 column tiles in one k loop, so 8 independent accumulator chains hide the FMA's
         * latency (two chains, one tile at a time, left the row latency-bound at ~1/4 of the FMA units). Each
         * output still starts from the same value and takes one FMA per k in increasing k: the same bits. */
        __m256 acc[4][2];
        for (int c = 0; c < cols; c++)
            for (int h = 0; h < 2; h++)
                acc[c][h] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out[0] + n0 + c * LANES + 8 * h);
        const float *tile = wt + n0 * K; /* column tile c's row k at tile + (c * K + k) * 16 */
        if (cols == 4) {
            for (long k = k0; k < k1; k++) {
                const __m256 xv = _mm256_set1_ps(x[k]);
                for (int c = 0; c < 4; c++) {
                    const float *w = tile + (c * K + k) * LANES;
                    acc[c][0] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w), acc[c][0]);
                    acc[c][1] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 8), acc[c][1]);
                }
            }
        } else {
            for (long k = k0; k < k1; k++) {
                const __m256 xv = _mm256_set1_ps(x[k]);
                for (int c = 0; c < cols; c++) {
                    const float *w = tile + (c * K + k) * LANES;
                    acc[c][0] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w), acc[c][0]);
                    acc[c][1] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 8), acc[c][1]);
                }
            }
        }
        for (int c = 0; c < cols; c++)
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(out[0] + n0 + c * LANES + 8 * h, acc[c][h]);
        return;
    }
    for (int c = 0; c < cols; c++) {
        const long n = n0 + c * LANES;
        __m256 acc[AVX2_ROWS][2];
        for (int m = 0; m < MB; m++)
            for (int h = 0; h < 2; h++)
                acc[m][h] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out[m] + n + 8 * h);
        const float *tile = wt + n * K;
        for (long k = k0; k < k1; k++) {
            const __m256 w0 = _mm256_loadu_ps(tile + k * LANES), w1 = _mm256_loadu_ps(tile + k * LANES + 8);
            for (int m = 0; m < MB; m++) {
                const __m256 xv = _mm256_set1_ps(x[m * K + k]);
                acc[m][0] = _mm256_fmadd_ps(xv, w0, acc[m][0]);
                acc[m][1] = _mm256_fmadd_ps(xv, w1, acc[m][1]);
            }
        }
        for (int m = 0; m < MB; m++)
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(out[m] + n + 8 * h, acc[m][h]);
    }
}
#endif

typedef struct {
    const float *x, *wt, *bias;
    long M, K, N, Np;
    float *out; /* [M][Np]: padded rows, so that every 16-wide store stays inside */
    long first, last; /* column blocks of 64 (the last may be narrower) */
} linear_job;

static void *linear_columns(void *arg) {
    const linear_job *job = arg;
    const long K = job->K, Np = job->Np;
    for (long b = job->first; b < job->last; b++) {
        const long n0 = b * 4 * LANES;
        const int cols = (int)((Np - n0) / LANES < 4 ? (Np - n0) / LANES : 4);
        for (long k0 = 0; k0 < K; k0 += KB) {
            const long k1 = k0 + KB < K ? k0 + KB : K;
            long m = 0;
#ifdef LINEAR_AVX2
            while (m + 1 < job->M) { /* 6 rows at a time, then the 2 to 5 left over together */
                const int rows = job->M - m < AVX2_ROWS ? (int)(job->M - m) : AVX2_ROWS;
                float *out[AVX2_ROWS];
                for (int r = 0; r < AVX2_ROWS; r++) out[r] = job->out + (m + (r < rows ? r : 0)) * Np;
                const float *xm = job->x + m * K;
                switch (rows) {
                case 2: linear_block_avx2(xm, K, job->wt, Np, n0, k0, k1, cols, out, 2); break;
                case 3: linear_block_avx2(xm, K, job->wt, Np, n0, k0, k1, cols, out, 3); break;
                case 4: linear_block_avx2(xm, K, job->wt, Np, n0, k0, k1, cols, out, 4); break;
                case 5: linear_block_avx2(xm, K, job->wt, Np, n0, k0, k1, cols, out, 5); break;
                default: linear_block_avx2(xm, K, job->wt, Np, n0, k0, k1, cols, out, AVX2_ROWS); break;
                }
                m += rows;
            }
#else
            for (; m + 4 <= job->M; m += 4) {
                float *out[4] = {job->out + m * Np, job->out + (m + 1) * Np, job->out + (m + 2) * Np,
                                 job->out + (m + 3) * Np};
                if (cols == 4) linear_block(job->x + m * K, K, job->wt, Np, n0, k0, k1, 4, out, 4);
                else linear_block(job->x + m * K, K, job->wt, Np, n0, k0, k1, cols, out, 4);
            }
#endif
            for (; m < job->M; m++) {
#ifdef LINEAR_AVX2
                float *out[AVX2_ROWS] = {job->out + m * Np};
                linear_block_avx2(job->x + m * K, K, job->wt, Np, n0, k0, k1, cols, out, 1);
#else
                float *out[4] = {job->out + m * Np, NULL, NULL, NULL};
                if (cols == 4) linear_block(job->x + m * K, K, job->wt, Np, n0, k0, k1, 4, out, 1);
                else linear_block(job->x + m * K, K, job->wt, Np, n0, k0, k1, cols, out, 1);
#endif
            }
        }
        if (job->bias)
            for (long m = 0; m < job->M; m++)
                for (long n = n0; n < n0 + cols * LANES && n < job->N; n++)
                    job->out[m * Np + n] = job->out[m * Np + n] + job->bias[n];
    }
    return NULL;
}

/* out is [M][Np]; the caller keeps its first N columns. */
void exact_linear_f32(const float *x, long M, long K, const float *wt, long N, long Np, const float *bias, float *out,
                      int threads) {
    const long blocks = (Np + 4 * LANES - 1) / (4 * LANES);
    if (threads > blocks) threads = (int)blocks;
    if (threads < 1) threads = 1;
    linear_job jobs[threads];
    pthread_t ids[threads];
    for (int i = 0; i < threads; i++)
        jobs[i] = (linear_job){x, wt, bias, M, K, N, Np, out, blocks * i / threads, blocks * (i + 1) / threads};
    for (int i = 1; i < threads; i++) pthread_create(&ids[i], NULL, linear_columns, &jobs[i]);
    linear_columns(&jobs[0]);
    for (int i = 1; i < threads; i++) pthread_join(ids[i], NULL);
}
