/* One-pass statistics of dense CPU tensors (elements in one gap-free range, any order): sum of squares, sum, min and max in a single read.
 *
 * Eager torch has no fused CPU kernel for these four reductions, so the Python engine makes four passes
 * (a dot, a sum, an amin, an amax). This module makes one, with explicit SIMD (AVX2 on x86-64 when the CPU
 * has it, NEON on aarch64) and no fast-math, so that the compiler cannot assume values are finite.
 *
 * NaN: the min/max instructions skip a NaN operand, but the sum and the sum of squares propagate it; an
 * Inf shows in min, max or the sums. The caller therefore treats a row as suspect when any of its four
 * values is not finite and recomputes it with the masked (NaN/Inf counting) path.
 *
 * Accuracy: float32 lanes accumulate blocks of BLOCK elements (at most BLOCK / 32 additions per lane);
 * block results are added in double.
 *
 * Python API (internal; trainermon/fused.py validates every argument before calling):
 *     stats(ptrs, numels, codes, out_addr) -> None
 * ptrs, numels, codes: equal-length lists of ints (data pointer, element count, dtype code);
 * out_addr: address of a contiguous float32 [len(ptrs), 7] buffer; columns 0-3 receive
 * (sumsq, sum, min, max), columns 4-6 zero. The GIL is released while it computes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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
enum { ROW = 7, BLOCK = 4096 };

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

/* Scalar tail, same semantics as the vector min/max: a NaN operand leaves the running value unchanged. */
static void tail_f32(const float *x, int64_t n, Acc *a) {
    float s = 0.0f, q = 0.0f, mn = a->min, mx = a->max;
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        s += v;
        q += v * v;
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
    }
    a->sum += s;
    a->sumsq += q;
    a->min = mn;
    a->max = mx;
}

#if TM_X86
__attribute__((target("avx2,fma"))) static float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One block of at most BLOCK float32 values. */
__attribute__((target("avx2,fma"))) static void block_f32_avx2(const float *x, int64_t n, Acc *a) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, q0 = s0, q1 = s0;
    __m256 mn0 = _mm256_set1_ps(INFINITY), mn1 = mn0;
    __m256 mx0 = _mm256_set1_ps(-INFINITY), mx1 = mx0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 u = _mm256_loadu_ps(x + i), v = _mm256_loadu_ps(x + i + 8);
        s0 = _mm256_add_ps(s0, u);
        s1 = _mm256_add_ps(s1, v);
        q0 = _mm256_fmadd_ps(u, u, q0);
        q1 = _mm256_fmadd_ps(v, v, q1);
        mn0 = _mm256_min_ps(u, mn0); /* returns the second operand when the first is NaN */
        mn1 = _mm256_min_ps(v, mn1);
        mx0 = _mm256_max_ps(u, mx0);
        mx1 = _mm256_max_ps(v, mx1);
    }
    a->sum += hsum8(_mm256_add_ps(s0, s1));
    a->sumsq += hsum8(_mm256_add_ps(q0, q1));
    float lo[8], hi[8];
    _mm256_storeu_ps(lo, _mm256_min_ps(mn0, mn1));
    _mm256_storeu_ps(hi, _mm256_max_ps(mx0, mx1));
    for (int j = 0; j < 8; j++) {
        a->min = lo[j] < a->min ? lo[j] : a->min;
        a->max = hi[j] > a->max ? hi[j] : a->max;
    }
    tail_f32(x + i, n - i, a);
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
    float32x4_t s0 = vdupq_n_f32(0.0f), s1 = s0, q0 = s0, q1 = s0;
    float32x4_t mn0 = vdupq_n_f32(INFINITY), mn1 = mn0;
    float32x4_t mx0 = vdupq_n_f32(-INFINITY), mx1 = mx0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
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
    a->sum += vaddvq_f32(vaddq_f32(s0, s1));
    a->sumsq += vaddvq_f32(vaddq_f32(q0, q1));
    float lo = vminnmvq_f32(vminnmq_f32(mn0, mn1)), hi = vmaxnmvq_f32(vmaxnmq_f32(mx0, mx1));
    a->min = lo < a->min ? lo : a->min;
    a->max = hi > a->max ? hi : a->max;
    tail_f32(x + i, n - i, a);
}
#endif

typedef void (*BlockFn)(const float *, int64_t, Acc *);
static BlockFn block_f32 = NULL; /* NULL: no SIMD path on this CPU; the module reports SIMD = "none" */
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

static void tensor_stats(const void *data, int64_t n, int code, float *row) {
    Acc a;
    acc_init(&a);
    float buf[BLOCK];
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t len = n - start < BLOCK ? n - start : BLOCK;
        if (code == CODE_F32) {
            block_f32((const float *)data + start, len, &a);
        } else {
            const uint16_t *src = (const uint16_t *)data + start;
            if (code == CODE_BF16)
                bf16_to_f32(src, len, buf);
            else
                f16_to_f32(src, len, buf);
            block_f32(buf, len, &a);
        }
    }
    row[0] = (float)a.sumsq;
    row[1] = (float)a.sum;
    row[2] = a.min;
    row[3] = a.max;
    row[4] = row[5] = row[6] = 0.0f;
}

/* A NaN reaches the sums (the min/max instructions skip it); an Inf reaches all four. */
static int row_finite(const float *row) {
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
        if (code < CODE_F32 || code > CODE_F16 || (code == CODE_F16 && !have_f16) || v[n + i] < 0) {
            PyMem_Free(v);
            PyErr_Format(PyExc_ValueError, "stats: unsupported code or size at %zd", i);
            return NULL;
        }
    }
    float *out = (float *)(uintptr_t)out_addr;
    Py_ssize_t not_finite = 0;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < n; i++) {
        tensor_stats((const void *)(uintptr_t)v[i], v[n + i], (int)v[2 * n + i], out + i * ROW);
        not_finite += !row_finite(out + i * ROW);
    }
    Py_END_ALLOW_THREADS;
    PyMem_Free(v);
    return PyLong_FromSsize_t(not_finite);
}

static PyMethodDef methods[] = {
    {"stats", stats, METH_VARARGS,
     "One-pass (sumsq, sum, min, max) rows of contiguous CPU tensors; returns how many rows are not all "
     "finite."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "trainermon._fused", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__fused(void) {
#if TM_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        block_f32 = block_f32_avx2;
        simd_name = "avx2";
        have_f16 = __builtin_cpu_supports("f16c") != 0;
    }
#elif TM_NEON
    block_f32 = block_f32_neon;
    simd_name = "neon";
    have_f16 = 1;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddStringConstant(m, "SIMD", simd_name) < 0 || PyModule_AddIntConstant(m, "HAVE_F16", have_f16) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
