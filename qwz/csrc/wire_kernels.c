/* One-pass CPU kernels of qwz's wire format: encode an fp32 source into a wire row's scales
 * and int8 codes, decode wire rows into bf16 or fp32 destinations.
 *
 * They compute [Note: quantization math] (qwz/quant.py) exactly as the eager torch kernels
 * do, operation for operation in fp32, so they write the same bytes (tested, and checked by
 * the kernel probe before first use). Plain C that gcc vectorizes; no intrinsics, so the
 * same file builds for AVX-512, AVX2 or any other target (-march=native picks the widest).
 *
 * Each group is read once from memory: its absmax, then its codes while it is still in L1
 * (in L2 for groups of more than 8192 elements, which do not fit a 32 KiB L1 alone).
 * The torch kernels take two passes over the source instead (inductor splits the reduction
 * from the pointwise loop that consumes it).
 *
 * Threads: `threads` > 1 splits the work over an OpenMP team, from the same OpenMP runtime
 * as torch's intra-op pool (qwz.native checks that before passing more than 1), so the
 * kernels run on torch's workers instead of contending with them. Each group is encoded and
 * each row's group decoded by one thread alone, so the bytes do not depend on `threads`
 * (one exception, shared with torch's own OpenMP kernels: flush-to-zero is a per-thread
 * setting, so under torch.set_flush_denormal(True) a group of subnormal values only may get
 * scale 0 on the calling thread and FLT_MIN on a worker; every rank decodes the bytes the
 * owner sent, so replicas still agree).
 * Built without OpenMP the pragmas are ignored and every call runs on one thread.
 */
#include <float.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define INT8_MAX_CODE 127
#define BLOCK 16 /* groups whose scales are computed together, in one vector */
/* Fewer elements run on one thread: a team's fork and join cost microseconds (torch's own
 * parallel_for grain is 32768). */
#define PARALLEL_MIN_ELEMENTS 65536
/* Largest group size whose BLOCK groups (fp32) take half of a 32 KiB L1 data cache. */
#define L1_GROUP 256

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
        /* Half to even in the default rounding mode, as torch.round; |x * inverse| < 2**31,
         * so the int conversion is exact, and clamping the int is clamping the float. */
        int32_t code = (int32_t)__builtin_rintf(x[i] * inverse);
        code = code < INT8_MAX_CODE ? code : INT8_MAX_CODE;
        code = code > -INT8_MAX_CODE ? code : -INT8_MAX_CODE;
        codes[i] = (int8_t)code;
    }
}

/* BLOCK whole groups of group_size elements; inlined with a constant group size, gcc
 * unrolls the loops over a group. Where BLOCK groups fit in L1 (group_size <= L1_GROUP), the
 * absmaxes of all of them first, their scales in one vector, then their codes; larger
 * groups one at a time (a group's absmax, its scale, its codes), so each is still in L1 when
 * its codes are written; its scale takes a lane of the same vector code, so the bytes are
 * the same either way. */
static inline __attribute__((always_inline)) void encode_block(
    const float *restrict x, int64_t group_size, float *restrict scales,
    int8_t *restrict codes) {
    float absmax[BLOCK] = {0}, scale[BLOCK], inverse[BLOCK];
    if (group_size <= L1_GROUP) {
        for (int i = 0; i < BLOCK; i++) absmax[i] = absmax_of(x + i * group_size, group_size);
        scales_of_block(absmax, scales, inverse);
        for (int i = 0; i < BLOCK; i++)
            codes_of(x + i * group_size, group_size, scales[i], inverse[i],
                     codes + i * group_size);
        return;
    }
    for (int i = 0; i < BLOCK; i++) {
        absmax[0] = absmax_of(x + i * group_size, group_size);
        scales_of_block(absmax, scale, inverse);
        scales[i] = scale[0];
        codes_of(x + i * group_size, group_size, scale[0], inverse[0], codes + i * group_size);
    }
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
        absmax[i] = length[i] ? absmax_of(x + start, length[i]) : 0.0f;
    }
    scales_of_block(absmax, scales, inverse);
    for (int i = 0; i < count; i++) {
        int64_t start = (first + i) * group_size;
        scales_out[first + i] = scales[i];
        if (length[i]) codes_of(x + start, length[i], scales[i], inverse[i], codes + start);
        memset(codes + start + length[i], 0, (size_t)(group_size - length[i]));
    }
}

/* Quantize x[0..numel) into num_groups groups of group_size: scales (num_groups,) fp32 and
 * codes (num_groups * group_size,) int8; numel <= num_groups * group_size, the rest of the
 * last groups zero. Whole blocks of BLOCK groups are shared among `threads` threads. */
void qwz_encode_f32(const float *x, int64_t numel, int64_t num_groups, int64_t group_size,
                    float *scales, int8_t *codes, int threads) {
    if (group_size <= 0 || num_groups <= 0) return; /* nothing to write (qwz.native refuses it) */
    int64_t blocks = numel / (BLOCK * group_size);
    blocks = blocks < num_groups / BLOCK ? blocks : num_groups / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (threads > 1 && blocks * BLOCK * group_size >= PARALLEL_MIN_ELEMENTS)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t g = b * BLOCK;
        if (group_size == 64) /* the default: a constant, so both loops unroll */
            encode_block(x + g * 64, 64, scales + g, codes + g * 64);
        else
            encode_block(x + g * group_size, group_size, scales + g, codes + g * group_size);
    }
    for (int64_t g = blocks * BLOCK; g < num_groups; g += BLOCK) {
        int count = num_groups - g < BLOCK ? (int)(num_groups - g) : BLOCK;
        encode_partial_block(x, numel, g, count, group_size, scales, codes);
    }
}

/* fp32 to bf16 as torch rounds it: to nearest, ties to even; NaN to 0x7fc0. */
static inline uint16_t bf16_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    uint16_t rounded = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    return value != value ? (uint16_t)0x7fc0 : rounded;
}

/* Decode one group of `length` codes into bf16 (bf16 != 0) or fp32 at `to`. */
static inline void decode_group(const int8_t *restrict in, int64_t length, float scale,
                                void *restrict to, int bf16) {
    if (bf16) {
        uint16_t *restrict out = (uint16_t *)to;
        for (int64_t i = 0; i < length; i++) out[i] = bf16_bits((float)in[i] * scale);
    } else {
        float *restrict out = (float *)to;
        for (int64_t i = 0; i < length; i++) out[i] = (float)in[i] * scale;
    }
}

/* Decode `rows` wire rows into out (rows, numel) bf16 (bf16 != 0) or fp32: row r's scales
 * at scales + r * scale_stride, its codes at codes + r * code_stride, its output at
 * out + r * out_stride elements; numel <= num_groups * group_size. The (row, group) pairs
 * are shared among `threads` threads. */
void qwz_decode(const float *scales, int64_t scale_stride, const int8_t *codes,
                int64_t code_stride, void *out, int64_t out_stride, int bf16, int64_t rows,
                int64_t num_groups, int64_t group_size, int64_t numel, int threads) {
    if (group_size <= 0 || num_groups <= 0) return; /* nothing to read (qwz.native refuses it) */
    const int64_t used = (numel + group_size - 1) / group_size; /* groups holding output */
    const int64_t groups = used < num_groups ? used : num_groups;
    const size_t element = bf16 ? sizeof(uint16_t) : sizeof(float);
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (threads > 1 && rows * numel >= PARALLEL_MIN_ELEMENTS)
    for (int64_t index = 0; index < rows * groups; index++) {
        const int64_t row = index / groups, g = index % groups;
        const int64_t start = g * group_size, left = numel - start;
        decode_group(codes + row * code_stride + start, left < group_size ? left : group_size,
                     scales[row * scale_stride + g],
                     (char *)out + (size_t)(row * out_stride + start) * element, bf16);
    }
}

/* The team size a parallel region started now on the calling thread would get
 * (omp_get_max_threads), or 0 when built without OpenMP. qwz.native sets torch's thread
 * count and reads this back: equal only where this library uses torch's OpenMP runtime. */
int qwz_openmp_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 0;
#endif
}
