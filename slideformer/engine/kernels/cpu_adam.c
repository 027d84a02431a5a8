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

/* Elements are processed in pairs through 32-bit words of w and rem (little-endian: element
   2k in the low half), so every load and store is full width; narrowing 16-bit stores made the
   loop twice as slow on the reference Xeon. An unaligned first or odd last element goes alone. */
void adamw_bf16_rem(uint16_t *w, uint16_t *rem, const float *g, float *m, float *v, int64_t n,
                    float lr, float b1, float b2, float omb1, float omb2, float eps, float wd,
                    float bc1, float bc2, float gscale, int threads) {
    const float step = lr / bc1, bc2s = sqrtf(bc2), decay = 1.0f - lr * wd;
    int64_t s = 0;
    if (n > 0 && ((uintptr_t)w & 3u)) {
        uint32_t u = adam1(((uint32_t)w[0] << 16) | rem[0], g[0] * gscale, m, v, b1, b2, omb1,
                           omb2, step, bc2s, eps, decay);
        w[0] = (uint16_t)(u >> 16);
        rem[0] = (uint16_t)u;
        s = 1;
    }
    const int64_t pairs = (n - s) / 2;
    uint32_t *W = (uint32_t *)(w + s), *R = (uint32_t *)(rem + s);
    const float *G = g + s;
    float *M = m + s, *V = v + s;
    #pragma omp parallel for simd schedule(static) num_threads(threads)
    for (int64_t k = 0; k < pairs; k++) {
        uint32_t w2 = W[k], r2 = R[k];
        uint32_t ue = adam1((w2 << 16) | (r2 & 0xFFFFu), G[2 * k] * gscale, &M[2 * k], &V[2 * k],
                            b1, b2, omb1, omb2, step, bc2s, eps, decay);
        uint32_t uo = adam1((w2 & 0xFFFF0000u) | (r2 >> 16), G[2 * k + 1] * gscale, &M[2 * k + 1],
                            &V[2 * k + 1], b1, b2, omb1, omb2, step, bc2s, eps, decay);
        W[k] = (ue >> 16) | (uo & 0xFFFF0000u);
        R[k] = (ue & 0xFFFFu) | (uo << 16);
    }
    if ((n - s) & 1) {
        int64_t i = n - 1;
        uint32_t u = adam1(((uint32_t)w[i] << 16) | rem[i], g[i] * gscale, &m[i], &v[i], b1, b2,
                           omb1, omb2, step, bc2s, eps, decay);
        w[i] = (uint16_t)(u >> 16);
        rem[i] = (uint16_t)u;
    }
}

/* The same update with bf16 moments: m and v are 16-bit arrays read and written in pairs too. */
static inline uint32_t adam1h(uint32_t u, float g, uint16_t *m, uint16_t *v, float b1, float b2,
                              float omb1, float omb2, float step, float bc2s, float eps,
                              float decay) {
    float mi = from_bf16((uint32_t)*m << 16), vi = from_bf16((uint32_t)*v << 16);
    u = adam1(u, g, &mi, &vi, b1, b2, omb1, omb2, step, bc2s, eps, decay);
    *m = (uint16_t)to_bf16(mi);
    *v = (uint16_t)to_bf16(vi);
    return u;
}

void adamw_bf16_rem_bf16m(uint16_t *w, uint16_t *rem, const float *g, uint16_t *m, uint16_t *v,
                          int64_t n, float lr, float b1, float b2, float omb1, float omb2,
                          float eps, float wd, float bc1, float bc2, float gscale, int threads) {
    const float step = lr / bc1, bc2s = sqrtf(bc2), decay = 1.0f - lr * wd;
    int64_t s = 0;
    if (n > 0 && ((uintptr_t)w & 3u)) {
        uint32_t u = adam1h(((uint32_t)w[0] << 16) | rem[0], g[0] * gscale, m, v, b1, b2, omb1,
                            omb2, step, bc2s, eps, decay);
        w[0] = (uint16_t)(u >> 16);
        rem[0] = (uint16_t)u;
        s = 1;
    }
    const int64_t pairs = (n - s) / 2;
    uint32_t *W = (uint32_t *)(w + s), *R = (uint32_t *)(rem + s);
    uint32_t *M = (uint32_t *)(m + s), *V = (uint32_t *)(v + s);
    const float *G = g + s;
    #pragma omp parallel for simd schedule(static) num_threads(threads)
    for (int64_t k = 0; k < pairs; k++) {
        uint32_t w2 = W[k], r2 = R[k], m2 = M[k], v2 = V[k];
        float me = from_bf16(m2 << 16), mo = from_bf16(m2 & 0xFFFF0000u);
        float ve = from_bf16(v2 << 16), vo = from_bf16(v2 & 0xFFFF0000u);
        uint32_t ue = adam1((w2 << 16) | (r2 & 0xFFFFu), G[2 * k] * gscale, &me, &ve,
                            b1, b2, omb1, omb2, step, bc2s, eps, decay);
        uint32_t uo = adam1((w2 & 0xFFFF0000u) | (r2 >> 16), G[2 * k + 1] * gscale, &mo, &vo,
                            b1, b2, omb1, omb2, step, bc2s, eps, decay);
        W[k] = (ue >> 16) | (uo & 0xFFFF0000u);
        R[k] = (ue & 0xFFFFu) | (uo << 16);
        M[k] = to_bf16(me) | (to_bf16(mo) << 16);
        V[k] = to_bf16(ve) | (to_bf16(vo) << 16);
    }
    if ((n - s) & 1) {
        int64_t i = n - 1;
        uint32_t u = adam1h(((uint32_t)w[i] << 16) | rem[i], g[i] * gscale, &m[i], &v[i], b1, b2,
                            omb1, omb2, step, bc2s, eps, decay);
        w[i] = (uint16_t)(u >> 16);
        rem[i] = (uint16_t)u;
    }
}
