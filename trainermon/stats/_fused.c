/* One-pass statistics of dense CPU tensors (elements in one gap-free range, any order): sum of squares,
 * sum, min and max in a single read.
 *
 * Eager torch has no fused CPU kernel for these four reductions, so the Python engine would make four
 * passes (a dot, a sum, an amin, an amax). This module makes one, with explicit SIMD (AVX2 on x86-64 when
 * the CPU has it, NEON on aarch64) and no fast-math, so that the compiler cannot assume values are finite.
 *
 * Accuracy (the engine's contract; trainermon/stats/engine.py states it for every path):
 * - Every float32 lane accumulates a run of at most RUN = 16 additions (sum) or fused multiply-adds (sum of
 *   squares), starting from zero, then the run is added into double-precision lanes. A run's rounding
 *   error is at most RUN * 2^-24 (9.6e-7) of the sum of the magnitudes of its terms; the double lanes and
 *   the per-block double total add about (n / BLOCK + 64) * 2^-53 more (3e-11 for 1e9 elements). Results
 *   are written as doubles. Hence |error of sumsq| <= 9.6e-7 * sumsq (norm: 4.8e-7 relative) and
 *   |error of sum| <= 9.6e-7 * sum|x| <= 9.6e-7 * n * rms (mean: 9.6e-7 * rms), whatever the data, the
 *   length, the hardware or the order of the elements. bf16 and fp16 values are widened exactly, and
 *   their squares are exact in float32.
 * - Squares of float32 values can overflow (|x| >= 2^62 within a run of 16) or underflow (|x| < 2^-63)
 *   in float32. A block whose largest magnitude is at least 2^62, or nonzero and below 2^-40, is summed
 *   again in double precision, where neither can happen; blocks of ordinary values never are.
 * - NaN: the min/max instructions skip a NaN operand, but the sums propagate it; an Inf shows in min, max
 *   or the sums. The caller treats a row as suspect when any of its four values is not finite and
 *   recomputes it with its masked (NaN/Inf counting) path.
 * - Subnormal inputs count as their values, unless the process enabled flush-to-zero
 *   (torch.set_flush_denormal(True)), which makes every CPU computation, this one included, read them as 0.
 *
 * Python API (internal; trainermon/stats/fused.py validates every argument before calling):
 *     stats(ptrs, numels, codes, out_addr) -> int
 * ptrs, numels, codes: equal-length lists of ints (data pointer, element count, dtype code);
 * out_addr: address of a contiguous float64 [len(ptrs), 7] buffer; columns 0-3 receive
 * (sumsq, sum, min, max), columns 4-6 zero. Returns how many rows are not all finite. The GIL is released
 * while it computes.
 *
 * Built with -DTM_STANDALONE (no Python), the file exposes `tm_tensor_stats` for a C test harness, so that
 * the NEON path can be checked under an emulator (tests/native/).
 */
#ifndef TM_STANDALONE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TM_X86 1
#elif defined(__aarch64__)
#include <arm_neon.h>
#define TM_NEON 1
#endif

enum { CODE_F32 = 0, CODE_BF16 = 1, CODE_F16 = 2 };
enum { ROW = 7, BLOCK = 4096, RUN = 16 };
/* Elements the AVX2 loop asks for ahead of its reads, two cache lines per step. Without it the loop reads
   below torch's speed (1.24x torch's time from memory or a warm last-level cache here). How far ahead
   pays depends on where the data lies (benchmarks/prefetch_sweep.py, session 22's host): from memory (a
   1 GiB tensor, 11 GiB/s) 1.5 KiB ahead matched torch (0.97x) where 8 KiB took 1.18x; from a warm 480
   MiB L3 (64 MiB, 20 GiB/s) 8 KiB gave 0.82x and 1.5 KiB 0.98x. 384 elements is the distance whose worse
   case is best (the first host that measured this, with a small L3, had gained from 8 KiB: 28.0 against
   torch's 26.6 GB/s). A prefetch never faults, and its address is formed as an integer, so reading ahead
   past a tensor's end is harmless. */
#ifndef PREFETCH
#define PREFETCH 384
#endif
#define PREFETCH_AHEAD(x, i)                                                                     \
    do {                                                                                         \
        uintptr_t ahead = (uintptr_t)(x) + (uintptr_t)((i) + PREFETCH) * sizeof(float);          \
        _mm_prefetch((const char *)ahead, _MM_HINT_T0);                                          \
        _mm_prefetch((const char *)(ahead + 64), _MM_HINT_T0);                                   \
    } while (0)

/* Largest magnitude a block may have for its float32 squares to stay finite over a run (16 * 2^124 < 2^128). */
#define BIG 0x1p62f
/* Below this largest magnitude, squares may underflow enough to matter: sum the block in double. */
#define TINY 0x1p-40f

/* One block's results. */
typedef struct {
    double sumsq, sum;
    float min, max;
} Acc;

static void acc_init(Acc *a) {
    a->sumsq = 0.0;
    a->sum = 0.0;
    a->min = INFINITY;
    a->max = -INFINITY;
}

/* Scalar tail (fewer elements than one vector step), straight in double: x * x of a float is exact there.
 * Same min/max semantics as the vector instructions: a NaN operand leaves the running value unchanged. */
static void tail(const float *x, int64_t n, Acc *a) {
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        a->sum += (double)v;
        a->sumsq += (double)v * (double)v;
        a->min = v < a->min ? v : a->min;
        a->max = v > a->max ? v : a->max;
    }
}

#if TM_X86
__attribute__((target("avx2,fma"))) static double hsum4d(__m256d v) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

/* Adds the 8 float32 lanes of v into two double accumulators. */
#define WIDEN_ADD(lo, hi, v)                                                        \
    do {                                                                            \
        lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));         \
        hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));       \
    } while (0)

/* One block of at most BLOCK float32 values: float32 runs of RUN steps, added into double lanes. */
__attribute__((target("avx2,fma"))) static void block_f32_avx2(const float *x, int64_t n, Acc *a) {
    __m256d S0 = _mm256_setzero_pd(), S1 = S0, S2 = S0, S3 = S0, Q0 = S0, Q1 = S0, Q2 = S0, Q3 = S0;
    __m256 mn0 = _mm256_set1_ps(INFINITY), mn1 = mn0;
    __m256 mx0 = _mm256_set1_ps(-INFINITY), mx1 = mx0;
    int64_t i = 0;
    /* Four independent float32 chains per sum: a chain's add waits for the previous add (4 cycles), so
       two chains left the loop short of memory speed. Every lane still adds RUN terms per run. */
    while (i + 32 <= n) {
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, q0 = s0, q1 = s0, q2 = s0, q3 = s0;
        int64_t stop = i + 32 * RUN < n ? i + 32 * RUN : n;
        for (; i + 32 <= stop; i += 32) {
            PREFETCH_AHEAD(x, i);
            __m256 u = _mm256_loadu_ps(x + i), v = _mm256_loadu_ps(x + i + 8);
            __m256 w = _mm256_loadu_ps(x + i + 16), z = _mm256_loadu_ps(x + i + 24);
            s0 = _mm256_add_ps(s0, u);
            s1 = _mm256_add_ps(s1, v);
            s2 = _mm256_add_ps(s2, w);
            s3 = _mm256_add_ps(s3, z);
            q0 = _mm256_fmadd_ps(u, u, q0);
            q1 = _mm256_fmadd_ps(v, v, q1);
            q2 = _mm256_fmadd_ps(w, w, q2);
            q3 = _mm256_fmadd_ps(z, z, q3);
            /* A pair first, then the running value (one dependent step per iteration). min/max return
               their second operand when either is NaN, so a NaN may hide its pair's other value; it also
               makes the sums NaN, and the caller recomputes such a row (see top). */
            mn0 = _mm256_min_ps(_mm256_min_ps(u, v), mn0);
            mn1 = _mm256_min_ps(_mm256_min_ps(w, z), mn1);
            mx0 = _mm256_max_ps(_mm256_max_ps(u, v), mx0);
            mx1 = _mm256_max_ps(_mm256_max_ps(w, z), mx1);
        }
        WIDEN_ADD(S0, S1, s0);
        WIDEN_ADD(S2, S3, s1);
        WIDEN_ADD(S0, S1, s2);
        WIDEN_ADD(S2, S3, s3);
        WIDEN_ADD(Q0, Q1, q0);
        WIDEN_ADD(Q2, Q3, q1);
        WIDEN_ADD(Q0, Q1, q2);
        WIDEN_ADD(Q2, Q3, q3);
    }
    if (i + 16 <= n) { /* one group of 16 left: a run of one step */
        __m256 u = _mm256_loadu_ps(x + i), v = _mm256_loadu_ps(x + i + 8);
        WIDEN_ADD(S0, S1, u);
        WIDEN_ADD(S2, S3, v);
        WIDEN_ADD(Q0, Q1, _mm256_mul_ps(u, u));
        WIDEN_ADD(Q2, Q3, _mm256_mul_ps(v, v));
        mn0 = _mm256_min_ps(u, mn0);
        mn1 = _mm256_min_ps(v, mn1);
        mx0 = _mm256_max_ps(u, mx0);
        mx1 = _mm256_max_ps(v, mx1);
        i += 16;
    }
    a->sum += hsum4d(_mm256_add_pd(_mm256_add_pd(S0, S1), _mm256_add_pd(S2, S3)));
    a->sumsq += hsum4d(_mm256_add_pd(_mm256_add_pd(Q0, Q1), _mm256_add_pd(Q2, Q3)));
    float lo[8], hi[8];
    _mm256_storeu_ps(lo, _mm256_min_ps(mn0, mn1));
    _mm256_storeu_ps(hi, _mm256_max_ps(mx0, mx1));
    for (int j = 0; j < 8; j++) {
        a->min = lo[j] < a->min ? lo[j] : a->min;
        a->max = hi[j] > a->max ? hi[j] : a->max;
    }
    tail(x + i, n - i, a);
}

/* The sums of one block in double precision (blocks of extreme magnitude only). */
__attribute__((target("avx2,fma"))) static void sums_f64_avx2(const float *x, int64_t n, Acc *a) {
    __m256d s0 = _mm256_setzero_pd(), s1 = s0, q0 = s0, q1 = s0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        s0 = _mm256_add_pd(s0, lo);
        s1 = _mm256_add_pd(s1, hi);
        q0 = _mm256_fmadd_pd(lo, lo, q0);
        q1 = _mm256_fmadd_pd(hi, hi, q1);
    }
    a->sum = hsum4d(_mm256_add_pd(s0, s1));
    a->sumsq = hsum4d(_mm256_add_pd(q0, q1));
    for (; i < n; i++) {
        a->sum += (double)x[i];
        a->sumsq += (double)x[i] * (double)x[i];
    }
}

__attribute__((target("avx2,f16c"))) static void f16_to_f32_x86(const uint16_t *x, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
    for (; i < n; i++)
        out[i] = _cvtsh_ss(x[i]);
}
#endif

#if TM_NEON
static void block_f32_neon(const float *x, int64_t n, Acc *a) {
    float64x2_t S0 = vdupq_n_f64(0.0), S1 = S0, S2 = S0, S3 = S0, Q0 = S0, Q1 = S0, Q2 = S0, Q3 = S0;
    float32x4_t mn0 = vdupq_n_f32(INFINITY), mn1 = mn0;
    float32x4_t mx0 = vdupq_n_f32(-INFINITY), mx1 = mx0;
    int64_t i = 0;
    while (i + 8 <= n) {
        float32x4_t s0 = vdupq_n_f32(0.0f), s1 = s0, q0 = s0, q1 = s0;
        int64_t stop = i + 8 * RUN < n ? i + 8 * RUN : n;
        for (; i + 8 <= stop; i += 8) {
            float32x4_t u = vld1q_f32(x + i), v = vld1q_f32(x + i + 4);
            s0 = vaddq_f32(s0, u);
            s1 = vaddq_f32(s1, v);
            q0 = vfmaq_f32(q0, u, u);
            q1 = vfmaq_f32(q1, v, v);
            mn0 = vminnmq_f32(mn0, u); /* minNum: a NaN operand is ignored */
            mn1 = vminnmq_f32(mn1, v);
            mx0 = vmaxnmq_f32(mx0, u);
            mx1 = vmaxnmq_f32(mx1, v);
        }
        S0 = vaddq_f64(S0, vcvt_f64_f32(vget_low_f32(s0)));
        S1 = vaddq_f64(S1, vcvt_high_f64_f32(s0));
        S2 = vaddq_f64(S2, vcvt_f64_f32(vget_low_f32(s1)));
        S3 = vaddq_f64(S3, vcvt_high_f64_f32(s1));
        Q0 = vaddq_f64(Q0, vcvt_f64_f32(vget_low_f32(q0)));
        Q1 = vaddq_f64(Q1, vcvt_high_f64_f32(q0));
        Q2 = vaddq_f64(Q2, vcvt_f64_f32(vget_low_f32(q1)));
        Q3 = vaddq_f64(Q3, vcvt_high_f64_f32(q1));
    }
    a->sum += vaddvq_f64(vaddq_f64(vaddq_f64(S0, S1), vaddq_f64(S2, S3)));
    a->sumsq += vaddvq_f64(vaddq_f64(vaddq_f64(Q0, Q1), vaddq_f64(Q2, Q3)));
    float lo = vminnmvq_f32(vminnmq_f32(mn0, mn1)), hi = vmaxnmvq_f32(vmaxnmq_f32(mx0, mx1));
    a->min = lo < a->min ? lo : a->min;
    a->max = hi > a->max ? hi : a->max;
    tail(x + i, n - i, a);
}

static void sums_f64_neon(const float *x, int64_t n, Acc *a) {
    float64x2_t s0 = vdupq_n_f64(0.0), s1 = s0, q0 = s0, q1 = s0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        float32x4_t v = vld1q_f32(x + i);
        float64x2_t lo = vcvt_f64_f32(vget_low_f32(v)), hi = vcvt_high_f64_f32(v);
        s0 = vaddq_f64(s0, lo);
        s1 = vaddq_f64(s1, hi);
        q0 = vfmaq_f64(q0, lo, lo);
        q1 = vfmaq_f64(q1, hi, hi);
    }
    a->sum = vaddvq_f64(vaddq_f64(s0, s1));
    a->sumsq = vaddvq_f64(vaddq_f64(q0, q1));
    for (; i < n; i++) {
        a->sum += (double)x[i];
        a->sumsq += (double)x[i] * (double)x[i];
    }
}
#endif

typedef void (*BlockFn)(const float *, int64_t, Acc *);
/* NULL: no SIMD path on this CPU; the module reports SIMD = "none" and is never called. */
static BlockFn block_f32 = NULL;
static BlockFn sums_f64 = NULL;
static int have_f16 = 0;
static const char *simd_name = "none";

static void bf16_to_f32(const uint16_t *x, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t w = (uint32_t)x[i] << 16; /* bf16 is the upper half of a float32 */
        memcpy(out + i, &w, sizeof w);
    }
}

static void f16_to_f32(const uint16_t *x, int64_t n, float *out) {
#if TM_X86
    f16_to_f32_x86(x, n, out);
#elif TM_NEON
    const __fp16 *h = (const __fp16 *)x;
    for (int64_t i = 0; i < n; i++)
        out[i] = (float)h[i];
#else
    (void)x, (void)n, (void)out;
#endif
}

/* One block: the fast float32-run pass, redone in double when its magnitudes are extreme (see top). */
static void block(const float *x, int64_t n, Acc *total) {
    Acc b;
    acc_init(&b);
    block_f32(x, n, &b);
    float amax = -b.min > b.max ? -b.min : b.max; /* NaN-free: min/max skipped NaN operands */
    if (amax >= BIG || (amax > 0.0f && amax < TINY))
        sums_f64(x, n, &b);
    total->sumsq += b.sumsq;
    total->sum += b.sum;
    total->min = b.min < total->min ? b.min : total->min;
    total->max = b.max > total->max ? b.max : total->max;
}

void tm_tensor_stats(const void *data, int64_t n, int code, double *row) {
    Acc a;
    acc_init(&a);
    float buf[BLOCK];
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t len = n - start < BLOCK ? n - start : BLOCK;
        if (code == CODE_F32) {
            block((const float *)data + start, len, &a);
        } else {
            const uint16_t *src = (const uint16_t *)data + start;
            if (code == CODE_BF16)
                bf16_to_f32(src, len, buf);
            else
                f16_to_f32(src, len, buf);
            block(buf, len, &a);
        }
    }
    row[0] = a.sumsq;
    row[1] = a.sum;
    row[2] = a.min;
    row[3] = a.max;
    row[4] = row[5] = row[6] = 0.0;
}

/* Chooses the SIMD path for this CPU; returns its name ("none": no kernel). */
const char *tm_init(void) {
#if TM_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        block_f32 = block_f32_avx2;
        sums_f64 = sums_f64_avx2;
        simd_name = "avx2";
        have_f16 = __builtin_cpu_supports("f16c") != 0;
    }
#elif TM_NEON
    block_f32 = block_f32_neon;
    sums_f64 = sums_f64_neon;
    simd_name = "neon";
    have_f16 = 1;
#endif
    return simd_name;
}

#ifndef TM_STANDALONE
/* A NaN reaches the sums (the min/max instructions skip it); an Inf reaches all four. */
static int row_finite(const double *row) {
    return isfinite(row[0]) && isfinite(row[1]) && isfinite(row[2]) && isfinite(row[3]);
}

static int read_int64s(PyObject *seq, Py_ssize_t n, int64_t *out, const char *what) {
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = (int64_t)PyLong_AsLongLong(PyList_GET_ITEM(seq, i));
        if (out[i] == -1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError, "stats: %s[%zd] is not an int", what, i);
            return -1;
        }
    }
    return 0;
}

static PyObject *stats(PyObject *self, PyObject *args) {
    PyObject *ptrs, *numels, *codes;
    unsigned long long out_addr;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!O!K", &PyList_Type, &ptrs, &PyList_Type, &numels, &PyList_Type, &codes,
                          &out_addr))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(ptrs);
    if (PyList_GET_SIZE(numels) != n || PyList_GET_SIZE(codes) != n) {
        PyErr_SetString(PyExc_ValueError, "stats: ptrs, numels and codes must have equal lengths");
        return NULL;
    }
    if (block_f32 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "stats: no SIMD kernel for this CPU");
        return NULL;
    }
    int64_t *v = PyMem_Malloc(sizeof(int64_t) * 3 * (size_t)(n ? n : 1));
    if (v == NULL)
        return PyErr_NoMemory();
    if (read_int64s(ptrs, n, v, "ptrs") || read_int64s(numels, n, v + n, "numels") ||
        read_int64s(codes, n, v + 2 * n, "codes")) {
        PyMem_Free(v);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t code = v[2 * n + i];
        if (code < CODE_F32 || code > CODE_F16 || (code == CODE_F16 && !have_f16) || v[n + i] < 0 || v[i] == 0) {
            PyMem_Free(v);
            PyErr_Format(PyExc_ValueError, "stats: unsupported code, size or address at %zd", i);
            return NULL;
        }
    }
    double *out = (double *)(uintptr_t)out_addr;
    Py_ssize_t not_finite = 0;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < n; i++) {
        tm_tensor_stats((const void *)(uintptr_t)v[i], v[n + i], (int)v[2 * n + i], out + i * ROW);
        not_finite += !row_finite(out + i * ROW);
    }
    Py_END_ALLOW_THREADS;
    PyMem_Free(v);
    return PyLong_FromSsize_t(not_finite);
}

/* `stats` for one tensor, without building lists: what a hook calls for each tensor it reduces. */
#define RELEASE_GIL_NUMEL (1 << 20)
static PyObject *stats_one(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "stats_one: expected (ptr, numel, code, out_addr)");
        return NULL;
    }
    int64_t v[4];
    for (int i = 0; i < 4; i++) {
        v[i] = (int64_t)PyLong_AsLongLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred())
            return NULL;
    }
    if (block_f32 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "stats_one: no SIMD kernel for this CPU");
        return NULL;
    }
    if (v[2] < CODE_F32 || v[2] > CODE_F16 || (v[2] == CODE_F16 && !have_f16) || v[1] < 0 || v[0] == 0 ||
        v[3] == 0) {
        PyErr_SetString(PyExc_ValueError, "stats_one: unsupported code, size or address");
        return NULL;
    }
    double *out = (double *)(uintptr_t)v[3];
    if (v[1] < RELEASE_GIL_NUMEL) {
        /* Microseconds of work: giving the GIL away could let another thread keep it for a whole switch
           interval (5 ms) before this one gets it back. */
        tm_tensor_stats((const void *)(uintptr_t)v[0], v[1], (int)v[2], out);
    } else {
        Py_BEGIN_ALLOW_THREADS;
        tm_tensor_stats((const void *)(uintptr_t)v[0], v[1], (int)v[2], out);
        Py_END_ALLOW_THREADS;
    }
    return PyLong_FromLong(!row_finite(out));
}

static PyMethodDef methods[] = {
    {"stats", stats, METH_VARARGS,
     "One-pass (sumsq, sum, min, max) float64 rows of dense CPU tensors; returns how many rows are not all "
     "finite."},
    {"stats_one", (PyCFunction)(void (*)(void))stats_one, METH_FASTCALL,
     "stats_one(ptr, numel, code, out_addr): `stats` for one tensor; returns 1 when its row is not all "
     "finite."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "trainermon.stats._fused", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__fused(void) {
    tm_init();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddStringConstant(m, "SIMD", simd_name) < 0 || PyModule_AddIntConstant(m, "HAVE_F16", have_f16) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
#endif
