#include <stdint.h>
#include <string.h>
#include <math.h>

/* One element: u holds the halves (w << 16 | rem) of bits(master) + 0x8000; returns the new u.
   omb1 = 1 - b1 and omb2 = 1 - b2 come from the caller in double precision: 1 - 0.999f in
   float is off by 1.3e-5 relative. */
static inline uint32_t adam1(uint32_t u, float g, float *m, float *v, float b1, float b2,
                             float omb1, float omb2, float step, float bc2s, float eps,
                             float decay) {
    uint32_t bits = u - 0x8000u;
    float p;
    memcpy(&p, &bits, 4);
    float mi = b1 * *m + omb1 * g;
    float vi = b2 * *v + omb2 * g * g;
    *m = mi;
    *v = vi;
    p = p * decay - step * mi / (sqrtf(vi) / bc2s + eps);
    memcpy(&bits, &p, 4);
    return bits + 0x8000u;
}

/* fp32 <-> bf16 as PyTorch converts: the high half, rounded to nearest even; NaN -> 0x7FC0. */
static inline float from_bf16(uint32_t hi) {
    float f;
    memcpy(&f, &hi, 4);
    return f;
}

static inline uint32_t to_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u)
        return 0x7FC0u;
    return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
}

/* The moments, read and written through one pair of helpers per storage type, so that one loop
   serves both: fp32 arrays as they are, bf16 arrays widened to fp32 and stored rounded to
   nearest even. get2/set2 move elements 2k and 2k + 1 (a bf16 pair is one 32-bit word). */
static inline float get1_f32(const float *p) { return *p; }
static inline void set1_f32(float *p, float x) { *p = x; }
static inline void get2_f32(const float *p, int64_t k, float *e, float *o) {
    *e = p[2 * k];
    *o = p[2 * k + 1];
}
static inline void set2_f32(float *p, int64_t k, float e, float o) {
    p[2 * k] = e;
    p[2 * k + 1] = o;
}

static inline float get1_bf16(const uint16_t *p) { return from_bf16((uint32_t)*p << 16); }
static inline void set1_bf16(uint16_t *p, float x) { *p = (uint16_t)to_bf16(x); }
static inline void get2_bf16(const uint16_t *p, int64_t k, float *e, float *o) {
    uint32_t x = ((const uint32_t *)p)[k];
    *e = from_bf16(x << 16);
    *o = from_bf16(x & 0xFFFF0000u);
}
static inline void set2_bf16(uint16_t *p, int64_t k, float e, float o) {
    ((uint32_t *)p)[k] = to_bf16(e) | (to_bf16(o) << 16);
}

/* Element i alone, its moments through get1/set1 of storage type MT. */
#define ADAM_ELEMENT(MT, i)                                                                    \
    do {                                                                                       \
        float mi = get1_##MT(&m[i]), vi = get1_##MT(&v[i]);                                    \
        uint32_t u = adam1(((uint32_t)w[i] << 16) | rem[i], g[i] * gscale, &mi, &vi, b1, b2,   \
                           omb1, omb2, step, bc2s, eps, decay);                                \
        ow[i] = (uint16_t)(u >> 16);                                                           \
        orem[i] = (uint16_t)u;                                                                 \
        set1_##MT(&om[i], mi);                                                                 \
        set1_##MT(&ov[i], vi);                                                                 \
    } while (0)

/* The entry point NAME for moments of C type CTYPE, stored as MT (f32 or bf16).
   Elements are processed in pairs through 32-bit words of w and rem (little-endian: element
   2k in the low half), so every load and store is full width; narrowing 16-bit stores made the
   loop twice as slow on the reference Xeon. An unaligned first or odd last element goes alone.
   A macro, so that each storage type gets its own loop with no branch inside it. The gradient
   pair is scaled before the moments are read: the statement order steers which product GCC
   contracts into an FMA (b1 m or (1 - b1) g), hence the last bit of m and v.
   The state is read from w, rem, m, v and written to ow, orem, om, ov: the same arrays for an
   update in place, others for one that keeps the state it started from (a speculative update,
   runtime/grad_ring.py). Each element is read before it is written, so either way is exact;
   the outputs must share the inputs' alignment (both are the same offset into an item). */
#define ADAMW_ENTRY(NAME, CTYPE, MT)                                                           \
void NAME(const uint16_t *w, const uint16_t *rem, const float *g, const CTYPE *m,            \
          const CTYPE *v, uint16_t *ow, uint16_t *orem, CTYPE *om, CTYPE *ov, int64_t n,       \
          float lr, float b1, float b2, float omb1, float omb2, float eps, float wd, float bc1, \
          float bc2, float gscale, int threads) {                                             \
    const float step = lr / bc1, bc2s = sqrtf(bc2), decay = 1.0f - lr * wd;                   \
    int64_t s = 0;                                                                            \
    if (n > 0 && ((uintptr_t)w & 3u)) {                                                       \
        ADAM_ELEMENT(MT, 0);                                                                  \
        s = 1;                                                                                \
    }                                                                                         \
    const int64_t pairs = (n - s) / 2;                                                        \
    const uint32_t *W = (const uint32_t *)(w + s), *R = (const uint32_t *)(rem + s);          \
    uint32_t *OW = (uint32_t *)(ow + s), *OR = (uint32_t *)(orem + s);                        \
    const float *G = g + s;                                                                   \
    const CTYPE *M = m + s, *V = v + s;                                                       \
    CTYPE *OM = om + s, *OV = ov + s;                                                         \
    _Pragma("omp parallel for simd schedule(static) num_threads(threads)")                    \
    for (int64_t k = 0; k < pairs; k++) {                                                     \
        uint32_t w2 = W[k], r2 = R[k];                                                        \
        float ge = G[2 * k] * gscale, go = G[2 * k + 1] * gscale, me, mo, ve, vo;             \
        get2_##MT(M, k, &me, &mo);                                                            \
        get2_##MT(V, k, &ve, &vo);                                                            \
        uint32_t ue = adam1((w2 << 16) | (r2 & 0xFFFFu), ge, &me, &ve,                        \
                            b1, b2, omb1, omb2, step, bc2s, eps, decay);                      \
        uint32_t uo = adam1((w2 & 0xFFFF0000u) | (r2 >> 16), go, &mo, &vo,                    \
                            b1, b2, omb1, omb2, step, bc2s, eps, decay);                      \
        OW[k] = (ue >> 16) | (uo & 0xFFFF0000u);                                              \
        OR[k] = (ue & 0xFFFFu) | (uo << 16);                                                  \
        set2_##MT(OM, k, me, mo);                                                             \
        set2_##MT(OV, k, ve, vo);                                                             \
    }                                                                                         \
    if ((n - s) & 1)                                                                          \
        ADAM_ELEMENT(MT, n - 1);                                                              \
}

ADAMW_ENTRY(adamw_bf16_rem, float, f32)
ADAMW_ENTRY(adamw_bf16_rem_bf16m, uint16_t, bf16)

/* ---- 8-bit block-wise moments (slideformer.engine.runtime.moments8) ---------------------------
   A moment is blocks of QBLOCK values, each QBLOCK one-byte codes then its fp32 scale (the
   block's largest magnitude); a value is table[code] * scale. The tables come from Python
   (moments8.TABLES: m magnitudes, m midpoints, v values, v midpoints: 128, 128, 256, 256;
   moments8.BUCKETS: the first code of each bucket, m then v), so both paths encode against the
   same float32 numbers. */
#define QBLOCK 256
#define QBLOCK_BYTES (QBLOCK + 4)
#define BUCKET_SHIFT 15           /* moments8.BUCKET_SHIFT: sign, exponent, 8 mantissa bits */
#define BUCKET_BASE (103 << 8)    /* moments8.BUCKET_BASE: bits(2^-24) >> BUCKET_SHIFT */
#define BUCKETS 6400              /* moments8.BUCKETS.shape[1]: [2^-24, 2) */

/* The nearest code of y >= 0: the number of midpoints below y (ties down). The bucket of y (the
   top bits of its float) holds at most one midpoint (moments8 checks), and start[bucket]
   counts those below the bucket: one comparison decides. */
static inline uint32_t q8_code(const float *mid, const int32_t *start, float y) {
    uint32_t bits;
    memcpy(&bits, &y, 4);
    int32_t q = (int32_t)(bits >> BUCKET_SHIFT) - BUCKET_BASE;
    q = q < 0 ? 0 : (q >= BUCKETS ? BUCKETS - 1 : q);
    uint32_t c = start[q];
    return c + (mid[c] < y);
}

/* Requantise the k fp32 values x of one block into out (codes, unused codes 0, then scale);
   signed: byte = sign << 7 | magnitude code. (restrict: without it GCC cannot vectorise the
   table lookups, as a store to out might change the tables.) */
static void q8_store(const float *restrict x, int64_t k, const float *restrict mid,
                     const int32_t *restrict start, int is_signed, uint8_t *restrict out) {
    uint32_t top = 0;  /* the largest magnitude's bits: integer order is float order for |x| */
    for (int64_t i = 0; i < k; i++) {
        uint32_t a;
        memcpy(&a, &x[i], 4);
        a &= 0x7FFFFFFFu;
        top = a > top ? a : top;
    }
    float amax;
    memcpy(&amax, &top, 4);
    const float inv = amax > 0.0f ? 1.0f / amax : 0.0f;
    for (int64_t i = 0; i < k; i++) {
        float y = x[i] * inv;
        uint32_t c = q8_code(mid, start, fabsf(y));
        out[i] = (uint8_t)(is_signed && y < 0.0f && c ? c | 128u : c);
    }
    memset(out + k, 0, (size_t)(QBLOCK - k));
    memcpy(out + QBLOCK, &amax, 4);
}

/* AdamW with 8-bit moments, one block per iteration: dequantise the block's m and v, update
   its elements run by run (runs: start, end, decay triples in item order), requantise. The
   master is bf16 w + remainder rem, or with rem = NULL fp32 w (the CPU backend's compute dtype;
   the same arithmetic through u = bits(w) + 0x8000). Blocks are independent, so the threads
   split them; a block reads all its input before writing, so the outputs may be the inputs (in
   place) or other buffers of the same sizes (a speculative update). */
void adamw_q8(const void *w, const uint16_t *rem, const float *g, const uint8_t *m,
              const uint8_t *v, void *ow, uint16_t *orem, uint8_t *om, uint8_t *ov, int64_t n,
              const int64_t *runs, int64_t nruns, const float *tables, const int32_t *buckets,
              float lr, float b1, float b2, float omb1, float omb2, float eps, float wd, float bc1,
              float bc2, float gscale, int threads) {
    const float step = lr / bc1, bc2s = sqrtf(bc2);
    const float *mmag = tables, *mmid = tables + 128, *vval = tables + 256, *vmid = tables + 512;
    const uint16_t *w16 = w;
    const uint32_t *w32 = w;
    uint16_t *ow16 = ow;
    uint32_t *ow32 = ow;
    const int64_t nblocks = (n + QBLOCK - 1) / QBLOCK;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t s = b * QBLOCK, k = n - s < QBLOCK ? n - s : QBLOCK;
        const uint8_t *mb = m + b * QBLOCK_BYTES, *vb = v + b * QBLOCK_BYTES;
        float ms, vs, mf[QBLOCK], vf[QBLOCK];
        memcpy(&ms, mb + QBLOCK, 4);
        memcpy(&vs, vb + QBLOCK, 4);
        for (int64_t i = 0; i < k; i++) {
            float a = mmag[mb[i] & 127u] * ms;
            mf[i] = (mb[i] & 128u) ? -a : a;
            vf[i] = vval[vb[i]] * vs;
        }
        for (int64_t r = 0; r < nruns; r++) {
            const int64_t lo = runs[3 * r] > s ? runs[3 * r] : s;
            const int64_t hi = runs[3 * r + 1] < s + k ? runs[3 * r + 1] : s + k;
            const float decay = runs[3 * r + 2] ? 1.0f - lr * wd : 1.0f;
            if (rem)
                for (int64_t i = lo; i < hi; i++) {
                    uint32_t u = adam1(((uint32_t)w16[i] << 16) | rem[i], g[i] * gscale,
                                       &mf[i - s], &vf[i - s], b1, b2, omb1, omb2, step, bc2s,
                                       eps, decay);
                    ow16[i] = (uint16_t)(u >> 16);
                    orem[i] = (uint16_t)u;
                }
            else
                for (int64_t i = lo; i < hi; i++)
                    ow32[i] = adam1(w32[i] + 0x8000u, g[i] * gscale, &mf[i - s], &vf[i - s], b1,
                                    b2, omb1, omb2, step, bc2s, eps, decay) - 0x8000u;
        }
        q8_store(mf, k, mmid, buckets, 1, om + b * QBLOCK_BYTES);
        q8_store(vf, k, vmid, buckets + BUCKETS, 0, ov + b * QBLOCK_BYTES);
    }
}
