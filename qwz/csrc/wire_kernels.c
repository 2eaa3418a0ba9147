/* One-pass CPU kernels of qwz's wire format: encode an fp32 source into a wire row's scales
 * and int8 codes, decode wire rows into bf16 or fp32 destinations.
 *
 * They compute [Note: quantization math] (qwz/quant.py) exactly as the eager torch kernels
 * do, operation for operation in fp32, so they write the same bytes (tested, and checked by
 * the kernel probe before first use). Plain C that gcc vectorizes; no intrinsics, so the
 * same file builds for AVX-512, AVX2 or any other target (-march=native picks the widest).
 *
 * Each group is read once from memory: its absmax, then its codes while it is still in L1.
 * The torch kernels take two passes over the source instead (inductor splits the reduction
 * from the pointwise loop that consumes it).
 *
 * Threads: `threads` > 1 splits the groups into that many contiguous ranges, one thread
 * each; every group is computed the same way whichever thread runs it.
 */
#include <float.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define INT8_MAX_CODE 127
#define MIN_GROUPS_PER_THREAD 2048
#define BLOCK 16 /* groups whose scales are computed together, in one vector */

/* max |x| over n elements as fp32 bits: for non-NaN values integer order is float order,
 * and every NaN's bits exceed +inf's, so the integer max is the absmax, or a NaN when the
 * group holds one (which the scale formula turns into the canonical NaN). */
static inline float absmax_of(const float *restrict x, int64_t n) {
    uint32_t most = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, x + i, sizeof bits);
        bits &= 0x7fffffffu;
        most = bits > most ? bits : most;
    }
    float absmax;
    memcpy(&absmax, &most, sizeof absmax);
    return absmax;
}

/* quant.scale_from_absmax on BLOCK groups, and each code multiplier: branch-free, so gcc
 * computes the BLOCK scales in one vector. absmax / 127 rounded; at least FLT_MIN (a NaN
 * compares false and stays NaN); one ulp smaller (bits - 1, positive finite) where
 * 127 * scale overflows for a finite absmax; the canonical NaN 0x7fc00000 for any NaN; 0
 * for a zero group. The multiplier is 1 / scale, or 0 for a zero scale. */
static inline void scales_of_block(const float *restrict absmax, float *restrict scales,
                                   float *restrict inverse) {
    for (int i = 0; i < BLOCK; i++) {
        float scale = absmax[i] / (float)INT8_MAX_CODE;
        scale = scale < FLT_MIN ? FLT_MIN : scale;
        uint32_t bits;
        memcpy(&bits, &scale, sizeof bits);
        bits -= (uint32_t)((scale * (float)INT8_MAX_CODE > FLT_MAX) & (absmax[i] <= FLT_MAX));
        bits = scale != scale ? 0x7fc00000u : bits;
        bits = absmax[i] == 0.0f ? 0u : bits;
        memcpy(&scale, &bits, sizeof scale);
        scales[i] = scale;
        inverse[i] = scale == 0.0f ? 0.0f : 1.0f / scale;
    }
}

/* Codes of n elements. A non-finite scale (the group holds a NaN or an Inf) gives all-zero
 * codes, as the torch kernel's NaN-to-zero does; a finite scale means finite elements, so
 * x * inverse is finite and the clamp needs no NaN case. */
static inline void codes_of(const float *restrict x, int64_t n, float scale, float inverse,
                            int8_t *restrict codes) {
    if (!(scale <= FLT_MAX)) {
        memset(codes, 0, (size_t)n);
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        /* Half to even, as torch.round; |x * inverse| < 2**31, so the int conversion is
         * exact, and clamping the int is clamping the float. */
        int32_t code = (int32_t)__builtin_rintf(x[i] * inverse);
        code = code < INT8_MAX_CODE ? code : INT8_MAX_CODE;
        code = code > -INT8_MAX_CODE ? code : -INT8_MAX_CODE;
        codes[i] = (int8_t)code;
    }
}

/* BLOCK whole groups of group_size elements; inlined with a constant group size, gcc
 * unrolls the loops over a group. */
static inline __attribute__((always_inline)) void encode_block(
    const float *restrict x, int64_t group_size, float *restrict scales,
    int8_t *restrict codes) {
    float absmax[BLOCK], inverse[BLOCK];
    for (int i = 0; i < BLOCK; i++) absmax[i] = absmax_of(x + i * group_size, group_size);
    scales_of_block(absmax, scales, inverse);
    for (int i = 0; i < BLOCK; i++)
        codes_of(x + i * group_size, group_size, scales[i], inverse[i], codes + i * group_size);
}

/* Up to BLOCK groups that may run past the source's end: the zero padding changes neither
 * a group's absmax nor its codes, and the codes past the end are zero. */
static void encode_partial_block(const float *x, int64_t numel, int64_t first, int count,
                                 int64_t group_size, float *scales_out, int8_t *codes) {
    float absmax[BLOCK] = {0}, scales[BLOCK], inverse[BLOCK];
    int64_t length[BLOCK];
    for (int i = 0; i < count; i++) {
        int64_t start = (first + i) * group_size, left = numel - start;
        length[i] = left < 0 ? 0 : (left > group_size ? group_size : left);
        absmax[i] = absmax_of(x + start, length[i]);
    }
    scales_of_block(absmax, scales, inverse);
    for (int i = 0; i < count; i++) {
        int64_t start = (first + i) * group_size;
        scales_out[first + i] = scales[i];
        codes_of(x + start, length[i], scales[i], inverse[i], codes + start);
        memset(codes + start + length[i], 0, (size_t)(group_size - length[i]));
    }
}

typedef struct {
    const float *x;
    int64_t numel, group_size, first, last;
    float *scales;
    int8_t *codes;
} encode_job;

static void *encode_range(void *arg) {
    const encode_job *job = arg;
    const int64_t group_size = job->group_size;
    int64_t g = job->first;
    for (; g + BLOCK <= job->last && (g + BLOCK) * group_size <= job->numel; g += BLOCK) {
        const float *x = job->x + g * group_size;
        if (group_size == 64) /* the default: a constant, so both loops unroll */
            encode_block(x, 64, job->scales + g, job->codes + g * 64);
        else
            encode_block(x, group_size, job->scales + g, job->codes + g * group_size);
    }
    for (; g < job->last; g += BLOCK) {
        int count = job->last - g < BLOCK ? (int)(job->last - g) : BLOCK;
        encode_partial_block(job->x, job->numel, g, count, group_size, job->scales, job->codes);
    }
    return NULL;
}

typedef void *(*range_fn)(void *);

/* Run `fn` over jobs[0..threads): jobs 1.. on new threads, job 0 here. Returns 0, or -1 if
 * a thread could not start (its range then runs here: the result is the same). */
static int run_jobs(range_fn fn, void *jobs, size_t job_size, int threads) {
    pthread_t ids[64];
    int started[64] = {0};
    int failed = 0;
    for (int t = 1; t < threads; t++) {
        started[t] = pthread_create(&ids[t], NULL, fn, (char *)jobs + t * job_size) == 0;
        if (!started[t]) {
            fn((char *)jobs + t * job_size);
            failed = -1;
        }
    }
    fn(jobs);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(ids[t], NULL);
    return failed;
}

static int clamp_threads(int threads, int64_t groups) {
    int64_t most = groups / MIN_GROUPS_PER_THREAD;
    if (threads > most) threads = (int)most;
    if (threads > 64) threads = 64;
    return threads < 1 ? 1 : threads;
}

/* Quantize x[0..numel) into num_groups groups of group_size: scales (num_groups,) fp32 and
 * codes (num_groups * group_size,) int8; numel <= num_groups * group_size, the rest of the
 * last groups zero. */
int qwz_encode_f32(const float *x, int64_t numel, int64_t num_groups, int64_t group_size,
                   float *scales, int8_t *codes, int threads) {
    encode_job jobs[64];
    threads = clamp_threads(threads, num_groups);
    for (int t = 0; t < threads; t++) {
        jobs[t] = (encode_job){x, numel, group_size, num_groups * t / threads,
                               num_groups * (t + 1) / threads, scales, codes};
    }
    return run_jobs(encode_range, jobs, sizeof jobs[0], threads);
}

/* fp32 to bf16 as torch rounds it: to nearest, ties to even; NaN to 0x7fc0. */
static inline uint16_t bf16_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    uint16_t rounded = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    return value != value ? (uint16_t)0x7fc0 : rounded;
}

typedef struct {
    const float *scales;
    int64_t scale_stride;
    const int8_t *codes;
    int64_t code_stride;
    void *out;
    int64_t out_stride, numel, group_size, first, last, num_groups;
    int bf16;
} decode_job;

/* Groups [first, last) of the flattened (rows x num_groups) grid. */
static void *decode_range(void *arg) {
    const decode_job *job = arg;
    const int64_t group_size = job->group_size;
    for (int64_t flat = job->first; flat < job->last; flat++) {
        int64_t row = flat / job->num_groups, g = flat % job->num_groups;
        int64_t start = g * group_size;
        int64_t length = job->numel - start;
        length = length > group_size ? group_size : length;
        if (length <= 0) continue;
        const float scale = job->scales[row * job->scale_stride + g];
        const int8_t *codes = job->codes + row * job->code_stride + start;
        if (job->bf16) {
            uint16_t *out = (uint16_t *)job->out + row * job->out_stride + start;
            for (int64_t i = 0; i < length; i++) out[i] = bf16_bits((float)codes[i] * scale);
        } else {
            float *out = (float *)job->out + row * job->out_stride + start;
            for (int64_t i = 0; i < length; i++) out[i] = (float)codes[i] * scale;
        }
    }
    return NULL;
}

/* Decode `rows` wire rows into out (rows, numel) bf16 (bf16 != 0) or fp32: row r's scales
 * at scales + r * scale_stride, its codes at codes + r * code_stride, its output at
 * out + r * out_stride elements; numel <= num_groups * group_size. */
int qwz_decode(const float *scales, int64_t scale_stride, const int8_t *codes,
               int64_t code_stride, void *out, int64_t out_stride, int bf16, int64_t rows,
               int64_t num_groups, int64_t group_size, int64_t numel, int threads) {
    decode_job jobs[64];
    int64_t total = rows * num_groups;
    threads = clamp_threads(threads, total);
    for (int t = 0; t < threads; t++) {
        jobs[t] = (decode_job){scales, scale_stride, codes, code_stride, out, out_stride, numel,
                               group_size, total * t / threads, total * (t + 1) / threads,
                               num_groups, bf16};
    }
    return run_jobs(decode_range, jobs, sizeof jobs[0], threads);
}
