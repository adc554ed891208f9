/* The CPU decode step's small ops, each one pass over its rows: what torch runs as 4-8 eager ops (each paying
 * its dispatch, which the GEMV before it has evicted from the caches) runs here as one call. Compiled on the
 * user's machine by cpu_decode_native.py (-O3 -march=native, sums reassociated so they vectorize, expf without
 * errno; not -ffast-math: NaN and infinity are kept, and the process's float modes are left alone); the torch
 * sequences in cpu_decode_ops_ref.py are the specification, tests/kernels/test_cpu_decode_ops.py holds the two
 * together. Single-threaded: torch's int4 GEMVs between these calls use the threads.
 *
 * Tensors arrive as raw pointers to contiguous rows; bfloat16 is uint16_t, rounded to nearest even as torch
 * rounds (NaN to 0x7FC0). A "planes" output is written that many times side by side along its row: an 8-bit
 * projection packed as two 4-bit planes (quantization/cpu_int4.py) reads each input twice. */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* An element of a row that is float32 (kind 1) or bfloat16 (kind 2). */
static inline float load_any(const void *p, int kind, long i) {
    return kind == 2 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Row t of an output of `n` values: bfloat16 written `planes` times along the row, or float32 (planes 0). */
static inline void store_row(void *out, int planes, long t, long n, long i, float v) {
    if (planes == 0) {
        ((float *)out)[t * n + i] = v;
        return;
    }
    uint16_t b = f32_to_bf16(v);
    uint16_t *row = (uint16_t *)out + t * n * planes;
    for (int p = 0; p < planes; p++) row[p * n + i] = b;
}

/* residual [T, K] = x (add 0) or residual + x (add 1), x float32 or bfloat16 (x_kind);
 * out [T, planes * K] = rms_norm(residual) * weight, in bfloat16 (planes >= 1) or float32 (planes 0). */
void asl_add_rms_norm(const void *x, int x_kind, int add, float *residual, const float *weight, float eps, long T,
                      long K, void *out, int planes) {
    for (long t = 0; t < T; t++) {
        float *r = residual + t * K;
        float ss = 0.0f;
        for (long i = 0; i < K; i++) {
            float v = load_any(x, x_kind, t * K + i);
            if (add) v += r[i];
            r[i] = v;
            ss += v * v;
        }
        float inv = 1.0f / sqrtf(ss / (float)K + eps);
        for (long i = 0; i < K; i++) store_row(out, planes, t, K, i, r[i] * inv * weight[i]);
    }
}

/* qkv [T, (Hq + 2 Hkv) D] (float32 or bfloat16, plus bias [(Hq + 2 Hkv) D] where not NULL): q and k rotated
 * half against half (x1 c - x2 s, x2 c + x1 s) at cos/sin [T, D / 2]; q into q_out [T, Hq, D], k and v into
 * the caches' rows [slots, Hkv, D] at slots[t]. */
void asl_rope_kv_write(const void *qkv, int qkv_kind, const float *bias, long T, long hq, long hkv, long d,
                       const float *cos, const float *sin, const int64_t *slots, float *q_out, float *k_cache,
                       float *v_cache) {
    long half = d / 2, width = (hq + 2 * hkv) * d;
    for (long t = 0; t < T; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        float *k_row = k_cache + slots[t] * hkv * d, *v_row = v_cache + slots[t] * hkv * d;
        for (long h = 0; h < hq + hkv; h++) {
            long base = h * d;
            float *dst = h < hq ? q_out + (t * hq + h) * d : k_row + (h - hq) * d;
            for (long i = 0; i < half; i++) {
                float x1 = load_any(qkv, qkv_kind, t * width + base + i);
                float x2 = load_any(qkv, qkv_kind, t * width + base + half + i);
                if (bias) {
                    x1 += bias[base + i];
                    x2 += bias[base + half + i];
                }
                dst[i] = x1 * c[i] - x2 * s[i];
                dst[half + i] = x2 * c[i] + x1 * s[i];
            }
        }
        for (long i = 0; i < hkv * d; i++) {
            long j = (hq + hkv) * d + i;
            v_row[i] = load_any(qkv, qkv_kind, t * width + j) + (bias ? bias[j] : 0.0f);
        }
    }
}

/* Decode attention: each row's one query [Hq, D] against its seq_len keys, read from the paged caches
 * [num_blocks * block_size, Hkv, D] through its block table row (block_tables + t * table_stride, int32); query
 * head h reads kv head h / (Hq / Hkv). out [T, planes * Hq * D] as store_row writes. scratch: the caller's
 * ATTENTION_SCRATCH(group, seq_len, d) floats (group = Hq / Hkv), so nothing here allocates or can fail. */
void asl_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                          long table_stride, long seq_len, long block_size, long T, long hq, long hkv, long d,
                          float scale, void *out, int planes, float *scratch) {
    long group = hq / hkv, width = hq * d;
    float *scores = scratch, *acc = scores + group * seq_len, *maxes = acc + group * d, *sums = maxes + group;
    for (long t = 0; t < T; t++) {
        const int32_t *table = block_tables + t * table_stride;
        for (long kv = 0; kv < hkv; kv++) {
            const float *qg = q + (t * hq + kv * group) * d;
            for (long g = 0; g < group; g++) maxes[g] = -INFINITY;
            for (long j0 = 0; j0 < seq_len; j0 += block_size) {  /* a block's keys lie in consecutive slots */
                const float *key = k_cache + ((long)table[j0 / block_size] * block_size * hkv + kv) * d;
                long end = j0 + block_size < seq_len ? j0 + block_size : seq_len;
                for (long j = j0; j < end; j++, key += hkv * d)
                    for (long g = 0; g < group; g++) {
                        const float *qh = qg + g * d;
                        float dot = 0.0f;
                        for (long i = 0; i < d; i++) dot += qh[i] * key[i];
                        dot *= scale;
                        scores[g * seq_len + j] = dot;
                        if (dot > maxes[g]) maxes[g] = dot;
                    }
            }
            for (long g = 0; g < group; g++) {
                float sum = 0.0f, *row = scores + g * seq_len;
                for (long j = 0; j < seq_len; j++) {
                    row[j] = expf(row[j] - maxes[g]);
                    sum += row[j];
                }
                sums[g] = sum;
            }
            memset(acc, 0, sizeof(float) * group * d);
            for (long j0 = 0; j0 < seq_len; j0 += block_size) {
                const float *value = v_cache + ((long)table[j0 / block_size] * block_size * hkv + kv) * d;
                long end = j0 + block_size < seq_len ? j0 + block_size : seq_len;
                for (long j = j0; j < end; j++, value += hkv * d)
                    for (long g = 0; g < group; g++) {
                        float p = scores[g * seq_len + j];
                        float *a = acc + g * d;
                        for (long i = 0; i < d; i++) a[i] += p * value[i];
                    }
            }
            for (long g = 0; g < group; g++)
                for (long i = 0; i < d; i++)
                    store_row(out, planes, t, width, (kv * group + g) * d + i, acc[g * d + i] / sums[g]);
        }
    }
}

/* gate_up [T, 2 I] (float32 or bfloat16): out [T, planes * I] = silu(gate) * up, as store_row writes. */
void asl_silu_mul(const void *gate_up, int kind, long T, long I, void *out, int planes) {
    for (long t = 0; t < T; t++)
        for (long i = 0; i < I; i++) {
            float g = load_any(gate_up, kind, t * 2 * I + i), u = load_any(gate_up, kind, t * 2 * I + I + i);
            store_row(out, planes, t, I, i, g / (1.0f + expf(-g)) * u);
        }
}

/* The LM head from 8-bit codes, as llama.cpp reads a Q8_0 head: each row of x [T, K] quantized per 32 values
 * (scale amax / 127, codes rounded to nearest) into xq [T, K] and sx [T, K / 32], then for outputs v0 .. v1 - 1
 * out[t, v] = sum over groups g of (w_scale[v, g] * sx[t, g]) * sum_i codes[v, 32 g + i] * xq[t, 32 g + i], the
 * inner sums exact in 32-bit integers. codes [V, K] int8 in [-127, 127] with w_scale [V, K / 32] float32: each
 * weight row is read once for all T rows. Threads split the outputs among themselves (each call its range). */
void asl_quantize_rows_q8(const float *x, long T, long K, int8_t *xq, float *sx) {
    for (long t = 0; t < T; t++)
        for (long g = 0; g < K / 32; g++) {
            const float *v = x + t * K + g * 32;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
            float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
            sx[t * (K / 32) + g] = scale;
            for (int i = 0; i < 32; i++) xq[t * K + g * 32 + i] = (int8_t)lrintf(v[i] * inv);
        }
}

#if defined(__AVX2__)
#include <immintrin.h>
/* sum_i a[i] * b[i] over 32 int8 pairs: |a| (unsigned) against b with a's sign, as 8 partial int32 sums. */
static inline __m256i dot32(const int8_t *a, const int8_t *b) {
    __m256i va = _mm256_loadu_si256((const __m256i *)a), vb = _mm256_loadu_si256((const __m256i *)b);
    __m256i ua = _mm256_sign_epi8(va, va), sb = _mm256_sign_epi8(vb, va);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ua, sb);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(ua, sb), _mm256_set1_epi16(1));  /* pairs <= 2 * 127 * 127 */
#endif
}
#endif

void asl_q8_head(const int8_t *codes, const float *w_scale, const int8_t *xq, const float *sx, long T, long K,
                 long V, float *out, long v0, long v1) {
    long groups = K / 32;
    for (long v = v0; v < v1; v++) {
        const int8_t *row = codes + v * K;
        const float *ws = w_scale + v * groups;
        for (long t = 0; t < T; t++) {
            const int8_t *xr = xq + t * K;
            const float *xs = sx + t * groups;
#if defined(__AVX2__)
            __m256 acc = _mm256_setzero_ps();
            for (long g = 0; g < groups; g++) {
                __m256 dot = _mm256_cvtepi32_ps(dot32(row + g * 32, xr + g * 32));
                acc = _mm256_fmadd_ps(dot, _mm256_set1_ps(ws[g] * xs[g]), acc);
            }
            __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
            half = _mm_add_ps(half, _mm_movehl_ps(half, half));
            half = _mm_add_ss(half, _mm_movehdup_ps(half));
            out[t * V + v] = _mm_cvtss_f32(half);
#else
            float acc = 0.0f;
            for (long g = 0; g < groups; g++) {
                int32_t dot = 0;
                for (int i = 0; i < 32; i++) dot += (int32_t)row[g * 32 + i] * (int32_t)xr[g * 32 + i];
                acc += (float)dot * (ws[g] * xs[g]);
            }
            out[t * V + v] = acc;
#endif
        }
    }
}
