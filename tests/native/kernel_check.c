/* Checks the native kernel (trainermon/stats/_fused.c, built with -DTM_STANDALONE) against long-double
 * references, without Python: so that the SIMD path of another architecture (NEON on aarch64) can be
 * checked under an emulator. Prints one line per failure and "kernel_check: N cases passed (simd)".
 * Exit status 0 only when every case meets the kernel's documented bound.
 *
 * Bound (see _fused.c): |sumsq error| <= 16 * 2^-24 * sumsq, |sum error| <= 16 * 2^-24 * sum|x|, min and
 * max exact, for float32, bf16 and fp16 (widened exactly).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void tm_tensor_stats(const void *data, int64_t n, int code, double *row);
const char *tm_init(void);

static uint64_t state = 88172645463325252ull;
static double uniform(void) { /* xorshift64*, in [0, 1) */
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    return (double)((state * 2685821657736338717ull) >> 11) / 9007199254740992.0;
}

static uint16_t to_bf16(float v) { /* truncate: the value checked is the bf16 value itself */
    uint32_t w;
    memcpy(&w, &v, 4);
    return (uint16_t)(w >> 16);
}

static float from_bf16(uint16_t h) {
    uint32_t w = (uint32_t)h << 16;
    float v;
    memcpy(&v, &w, 4);
    return v;
}

static int failures = 0, cases = 0;

static void check(const char *what, const float *x, const void *data, int64_t n, int code) {
    long double q = 0, s = 0, a = 0;
    float mn = INFINITY, mx = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        q += (long double)x[i] * x[i];
        s += x[i];
        a += fabsl((long double)x[i]);
        mn = x[i] < mn ? x[i] : mn;
        mx = x[i] > mx ? x[i] : mx;
    }
    double row[7];
    tm_tensor_stats(data, n, code, row);
    const long double bound = 16.0L / 16777216.0L;
    cases++;
    if (fabsl(row[0] - q) > bound * q || fabsl(row[1] - s) > bound * a || row[2] != mn || row[3] != mx) {
        failures++;
        printf("FAIL %s n=%lld code=%d: sumsq %.17g vs %.17Lg, sum %.17g vs %.17Lg, min %g vs %g, max %g vs %g\n",
               what, (long long)n, code, row[0], q, row[1], s, row[2], mn, row[3], mx);
    }
}

int main(void) {
    const char *simd = tm_init();
    if (strcmp(simd, "none") == 0) {
        printf("kernel_check: no SIMD kernel on this CPU\n");
        return 2;
    }
    const int64_t sizes[] = {1, 7, 15, 16, 17, 255, 256, 257, 4095, 4096, 4097, 8207, 100003};
    const int64_t max_n = 100003;
    float *x = malloc(sizeof(float) * max_n);
    uint16_t *h = malloc(sizeof(uint16_t) * max_n);
    float *hx = malloc(sizeof(float) * max_n);
    /* kind: 0 offset >> spread, 1 all equal, 2 near float32 overflow, 3 near underflow, 4 alternating signs */
    const char *kinds[] = {"offset", "equal", "overflow", "underflow", "alternating"};
    for (unsigned si = 0; si < sizeof sizes / sizeof *sizes; si++) {
        int64_t n = sizes[si];
        for (int kind = 0; kind < 5; kind++) {
            for (int64_t i = 0; i < n; i++) {
                double u = uniform();
                switch (kind) {
                case 0: x[i] = (float)(1000.0 + 0.01 * (u - 0.5)); break;
                case 1: x[i] = 0.1f; break;
                case 2: x[i] = (float)(3.0e38 * (0.5 + 0.5 * u)); break;
                case 3: x[i] = (float)(1.0e-38 * (1.0 + u)); break;
                default: x[i] = (i % 2 ? -1.25f : 1.25f) * (float)(1.0 + 1e-3 * u); break;
                }
            }
            check(kinds[kind], x, x, n, 0);
            for (int64_t i = 0; i < n; i++) {
                h[i] = to_bf16(x[i]);
                hx[i] = from_bf16(h[i]);
            }
            check(kinds[kind], hx, h, n, 1);
        }
    }
    printf("kernel_check: %d cases, %d failed (%s)\n", cases, failures, simd);
    free(x);
    free(h);
    free(hx);
    return failures ? 1 : 0;
}
