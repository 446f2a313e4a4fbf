/* The CPU engine's fused kernels: RMSNorm, per-head norm + rotary, and paged decode attention. Each is one call where PyTorch runs several ops (or a gather and an SDPA).
 *
 * Tensors are float32 or bfloat16 (`bf16` flag; bf16 is stored as uint16). Rows are loaded into
 * float32 buffers, computed on, and stored back; every step that rounds to the tensor dtype in
 * HF's code rounds here too (`round_row`), so norms and rotary equal PyTorch's bit for bit in
 * bfloat16 (float32 sums may differ in order). The softmax's exp is a polynomial the compiler
 * vectorises (`fast_exp`, about 2 ulp).
 *
 * Built at first use by verst/engine/kernels/cpu.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes; parallel loops use the OpenMP runtime torch loaded. In bfloat16 every product
 * of two stored values is exact in float32, so fused multiply-adds round as PyTorch does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Parallel loops use this many threads: PyTorch's intra-op count, set from Python (OpenMP's own
 * default is per calling thread and would be the machine's core count on the engine's thread). */
static int threads = 1;

void set_threads(int n) { threads = n > 0 ? n : 1; }

#define MAX_ROW 16384 /* the longest row a kernel buffers on the stack (hidden, MLP width) */
#define MAX_HEAD 1024 /* the largest head dim (norm_rope buffers five rows of it) */

typedef union {
    uint32_t u;
    float f;
} bits;

static inline float bf16_to_f32(uint16_t x) {
    bits b;
    b.u = (uint32_t)x << 16;
    return b.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN kept quiet */
    bits b;
    b.f = f;
    uint32_t rounded = (b.u + 0x7fffu + ((b.u >> 16) & 1u)) >> 16;
    uint32_t nan = (b.u >> 16) | 0x40u;
    return (uint16_t)((b.u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

static void load_row(const void *src, int bf16, float *restrict dst, long n) {
    if (bf16) {
        const uint16_t *restrict s = src;
        for (long i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        const float *restrict s = src;
        for (long i = 0; i < n; i++) dst[i] = s[i];
    }
}

static void store_row(const float *restrict src, int bf16, void *dst, long n) {
    if (bf16) {
        uint16_t *restrict d = dst;
        for (long i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else {
        float *restrict d = dst;
        for (long i = 0; i < n; i++) d[i] = src[i];
    }
}

static void round_row(float *restrict x, int bf16, long n) { /* to the dtype and back */
    if (bf16)
        for (long i = 0; i < n; i++) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
}

static inline const void *at(const void *base, int bf16, long index) {
    return (const char *)base + index * (bf16 ? 2 : 4);
}

/* exp(x) = 2^n * e^r, n = round(x / ln 2), |r| <= ln 2 / 2, e^r by a degree-6 polynomial. */
static inline float fast_exp(float x) {
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.7f ? 88.7f : x;
    float n = (x * 1.44269504f + 12582912.f) - 12582912.f; /* round to nearest */
    float r = x - n * 0.693145752f - n * 1.42860677e-6f;
    float p = 1.f / 720;
    p = p * r + 1.f / 120;
    p = p * r + 1.f / 24;
    p = p * r + 1.f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    bits scale;
    scale.u = (uint32_t)(((int32_t)n + 127) << 23);
    return p * scale.f;
}

/* HF's RMSNorm in place on a float row: float32 statistics, normalise, round, times the weight,
 * round (the caller's store rounds the last time). */
static void rms_norm_row(float *restrict x, const float *restrict w, int bf16, long n, float eps) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (long i = 0; i < n; i++) sum += x[i] * x[i];
    float inv = 1.f / sqrtf(sum / (float)n + eps);
    for (long i = 0; i < n; i++) x[i] *= inv;
    round_row(x, bf16, n);
    for (long i = 0; i < n; i++) x[i] *= w[i];
}

/* RMSNorm of R rows of n (row strides in elements). */
void rms_norm(const void *x, long x_stride, const void *w, void *out, long out_stride, long R,
              long n, float eps, int bf16) {
    float weight[MAX_ROW];
    load_row(w, bf16, weight, n);
#pragma omp parallel for num_threads(threads) if (R * n >= 8192)
    for (long r = 0; r < R; r++) {
        float row[MAX_ROW];
        load_row(at(x, bf16, r * x_stride), bf16, row, n);
        rms_norm_row(row, weight, bf16, n, eps);
        store_row(row, bf16, (char *)out + r * out_stride * (bf16 ? 2 : 4), n);
    }
}

/* HF's residual add and the next RMSNorm in one pass: sum = x + residual (rounded), out =
 * RMSNorm(sum); R rows of n, x and residual rows strided, sum and out contiguous. */
void add_rms_norm(const void *x, long x_stride, const void *residual, long residual_stride,
                  const void *w, void *sum, void *out, long R, long n, float eps, int bf16) {
    float weight[MAX_ROW];
    load_row(w, bf16, weight, n);
#pragma omp parallel for num_threads(threads) if (R * n >= 8192)
    for (long r = 0; r < R; r++) {
        float row[MAX_ROW], other[MAX_ROW];
        load_row(at(x, bf16, r * x_stride), bf16, row, n);
        load_row(at(residual, bf16, r * residual_stride), bf16, other, n);
        for (long i = 0; i < n; i++) row[i] += other[i];
        store_row(row, bf16, (char *)sum + r * n * (bf16 ? 2 : 4), n);
        round_row(row, bf16, n);
        rms_norm_row(row, weight, bf16, n, eps);
        store_row(row, bf16, (char *)out + r * n * (bf16 ? 2 : 4), n);
    }
}

/* R rows of H heads of D (heads dense in a row, row stride in elements): a per-head RMSNorm
 * when w is given, then HF's rotary x * cos + rotate_half(x) * sin, each product and the sum
 * rounded. cos / sin [R, D]; out [R, H, D] contiguous. */
void norm_rope(const void *x, long x_stride, const void *w, float eps, const void *cos,
               const void *sin, void *out, long R, long H, long D, int bf16) {
    float weight[MAX_HEAD];
    if (w) load_row(w, bf16, weight, D);
    long half = D / 2;
#pragma omp parallel for num_threads(threads) if (R * H * D >= 8192)
    for (long r = 0; r < R; r++) {
        float c[MAX_HEAD], s[MAX_HEAD], head[MAX_HEAD], a[MAX_HEAD], b[MAX_HEAD];
        load_row(at(cos, bf16, r * D), bf16, c, D);
        load_row(at(sin, bf16, r * D), bf16, s, D);
        for (long h = 0; h < H; h++) {
            load_row(at(x, bf16, r * x_stride + h * D), bf16, head, D);
            if (w) {
                rms_norm_row(head, weight, bf16, D, eps);
                round_row(head, bf16, D);
            }
            for (long i = 0; i < D; i++) a[i] = head[i] * c[i];
            for (long i = 0; i < half; i++) b[i] = -head[i + half] * s[i];
            for (long i = half; i < D; i++) b[i] = head[i - half] * s[i];
            round_row(a, bf16, D);
            round_row(b, bf16, D);
            for (long i = 0; i < D; i++) a[i] += b[i];
            store_row(a, bf16, (char *)out + (r * H + h) * D * (bf16 ? 2 : 4), D);
        }
    }
}

/* Eight floats as one vector (GCC / Clang vector extensions: AVX on x86, NEON on Arm). */
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline v8f load8(const void *p, int bf16) {
    v8f f;
    if (bf16) {
        v8h h;
        memcpy(&h, p, sizeof h);
        v8u u = __builtin_convertvector(h, v8u) << 16;
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, p, sizeof f);
    }
    return f;
}

static inline float sum8(v8f x) {
    return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}

#define KEYS 8 /* keys scored together: independent accumulators keep the FMA units busy */

/* One query token a row over its pages. q, out [B, Hq, D]; k, v pools [pages, page, Hkv, D];
 * table [B, P] (row stride table_stride); seq_lens [B]; D a multiple of 8. A task is a row and
 * a range of its KV heads (all of them once there are rows enough to share out, so each key's
 * heads are read as one contiguous run): the query heads score the keys KEYS at a time,
 * softmax, then sum the values. */
void paged_decode(const void *q, const void *k, const void *v, const int64_t *table,
                  long table_stride, const int64_t *seq_lens, void *out, long B, long Hq, long Hkv,
                  long D, long page, float scale, int bf16) {
    long G = Hq / Hkv, chunks = D / 8, width = bf16 ? 2 : 4;
    long splits = B >= 8 ? 1 : Hkv; /* few rows: one task per KV head instead */
    long heads_per_task = Hkv / splits;
#pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (long task = 0; task < B * splits; task++) {
        long b = task / splits, first = task % splits * heads_per_task, S = seq_lens[b];
        long H = heads_per_task * G; /* query heads of this task */
        const int64_t *pages = table + b * table_stride;
        float *scores = malloc(sizeof(float) * (size_t)(H * S));
        v8f *query = aligned_alloc(sizeof(v8f), sizeof(v8f) * (size_t)(H * chunks));
        v8f *acc = aligned_alloc(sizeof(v8f), sizeof(v8f) * (size_t)(H * chunks));
        for (long c = 0; c < H * chunks; c++) {
            query[c] = load8(at(q, bf16, (b * Hq + first * G) * D + c * 8), bf16);
            acc[c] = (v8f){0};
        }
        long key_stride = Hkv * D * width; /* bytes from one key of a page to the next */
        for (long start = 0; start < S; start += page) {
            long n = S - start < page ? S - start : page; /* keys on this page */
            const char *base = at(k, bf16, (pages[start / page] * page * Hkv + first) * D);
            for (long j0 = 0; j0 < n; j0 += KEYS) {
                const char *keys[KEYS]; /* past the page's last key: score key j0 again, unused */
                for (long j = 0; j < KEYS; j++) keys[j] = base + (j0 + j < n ? j0 + j : j0) * key_stride;
                /* each key chunk is converted once and scored against a pair of the query
                 * heads that share its KV head */
                for (long h = 0; h < H; h += 2) {
                    long offset = h / G * D * width, pair = G % 2 == 0; /* h, h+1: one KV head */
                    v8f dots[2][KEYS] = {{{0}}};
                    for (long c = 0; c < chunks; c++) {
                        v8f q0 = query[h * chunks + c], q1 = pair ? query[(h + 1) * chunks + c] : q0;
                        for (long j = 0; j < KEYS; j++) {
                            v8f kc = load8(keys[j] + offset + c * 8 * width, bf16);
                            dots[0][j] += q0 * kc;
                            dots[1][j] += q1 * kc;
                        }
                    }
                    for (long j = 0; j < KEYS && j0 + j < n; j++) {
                        scores[h * S + start + j0 + j] = sum8(dots[0][j]) * scale;
                        if (pair) scores[(h + 1) * S + start + j0 + j] = sum8(dots[1][j]) * scale;
                    }
                    if (!pair) h -= 1; /* odd group sizes: one head at a time */
                }
            }
        }
        for (long h = 0; h < H; h++) {
            float *sc = scores + h * S, top = -INFINITY, sum = 0.f;
            for (long s = 0; s < S; s++) top = sc[s] > top ? sc[s] : top;
            for (long s = 0; s < S; s++) sc[s] = fast_exp(sc[s] - top);
#pragma omp simd reduction(+ : sum)
            for (long s = 0; s < S; s++) sum += sc[s];
            for (long s = 0; s < S; s++) sc[s] /= sum;
        }
        for (long start = 0; start < S; start += page) {
            long n = S - start < page ? S - start : page;
            const char *base = at(v, bf16, (pages[start / page] * page * Hkv + first) * D);
            for (long j = 0; j < n; j++) {
                const char *row = base + j * key_stride;
                for (long kvh = 0; kvh < heads_per_task; kvh++) {
                    const char *head = row + kvh * D * width;
                    float *p = scores + kvh * G * S + start + j; /* p[g * S]: query head g */
                    v8f *a = acc + kvh * G * chunks;
                    for (long c = 0; c < chunks; c++) {
                        v8f vc = load8(head + c * 8 * width, bf16); /* converted once per KV head */
                        for (long g = 0; g < G; g++) a[g * chunks + c] += p[g * S] * vc;
                    }
                }
            }
        }
        store_row((const float *)acc, bf16, (char *)out + (b * Hq + first * G) * D * width, H * D);
        free(scores);
        free(query);
        free(acc);
    }
}
