#include "crc32.h"

#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* ---------------------------------------------------------------------------------------------
 * CRC-32 exactly as zlib's crc32() computes it (the IEEE polynomial, reflected, inverted before
 * and after), faster on CPUs with carry-less multiply: the pool's checksums stay the same
 * values, and zlib.crc32 stays the fallback.
 *
 * Bits are reflected: in a 16-byte little-endian load, bit j is the coefficient of x^(127-j) of
 * that chunk of the message polynomial. Folding: a chunk A = A_hi x^64 + A_lo that D bits of
 * message follow is replaced by a polynomial of degree < 128 congruent to A x^D mod P:
 * A_hi (x^(63+D) mod P) x + A_lo (x^(D-1) mod P) x. The extra x is what PCLMULQDQ of two
 * reflected 64-bit values adds (their product lands one bit short of the reflected 128-bit
 * position); each constant is x^e mod P, bit-reflected into the top half of a 64-bit lane.
 * What is left at the end, 16 bytes congruent to everything folded, and the last < 16 bytes go
 * through the byte table.
 * ------------------------------------------------------------------------------------------- */
#define CRC32_POLY_NORMAL 0x04C11DB7u   /* P without its x^32 term, bit k = coefficient of x^k */
#define CRC32_POLY_REFLECTED 0xEDB88320u

static uint32_t crc_table[256];
/* [0]: for A_hi (low lane), [1]: for A_lo (high lane); D = 2048, 512, 128 bits */
static uint64_t fold_2048[2], fold_512[2], fold_128[2];

/* How long buffers are folded, slowest first; crc_best is what the CPU has, crc_path what is used. */
enum crc_path { CRC_BYTES = 0, CRC_PCLMUL = 1, CRC_VPCLMUL = 2 };
static const char *const crc_path_names[] = {"bytes", "pclmul", "vpclmul"};
static enum crc_path crc_best = CRC_BYTES, crc_path = CRC_BYTES;

static uint32_t reflect32(uint32_t v)
{
    uint32_t r = 0;
    for (int i = 0; i < 32; i++)
        r |= ((v >> i) & 1u) << (31 - i);
    return r;
}

/* x^e mod P, bit-reflected into bits 32..63 (the lane layout PCLMULQDQ multiplies). */
static uint64_t x_pow_mod_reflected(int e)
{
    uint32_t v = 1; /* x^0 */
    for (int i = 0; i < e; i++)
        v = (v << 1) ^ ((v & 0x80000000u) ? CRC32_POLY_NORMAL : 0);
    return (uint64_t)reflect32(v) << 32;
}

static void crc32_tables(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ CRC32_POLY_REFLECTED : c >> 1;
        crc_table[i] = c;
    }
    fold_2048[0] = x_pow_mod_reflected(63 + 2048), fold_2048[1] = x_pow_mod_reflected(2048 - 1);
    fold_512[0] = x_pow_mod_reflected(63 + 512), fold_512[1] = x_pow_mod_reflected(512 - 1);
    fold_128[0] = x_pow_mod_reflected(63 + 128), fold_128[1] = x_pow_mod_reflected(128 - 1);
}

/* The CRC register (not inverted) after `n` more bytes. */
static uint32_t crc32_bytes(uint32_t reg, const unsigned char *p, size_t n)
{
    while (n--)
        reg = crc_table[(reg ^ *p++) & 0xFF] ^ (reg >> 8);
    return reg;
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("pclmul,sse4.1")))
static inline __m128i crc_fold(__m128i a, __m128i k, __m128i next)
{
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(a, k, 0x00), _mm_clmulepi64_si128(a, k, 0x11)), next);
}

/* Four lanes x0..x3 hold the 64 bytes before p, folded; n more bytes follow at p. Inlined, so that
 * the AVX-512 path runs it VEX-encoded and ends with VZEROUPPER (legacy SSE code after dirty upper
 * halves of the vector registers is slowed: docs/benchmarks.md). */
__attribute__((target("pclmul,sse4.1"), always_inline))
static inline uint32_t crc32_lanes(__m128i x0, __m128i x1, __m128i x2, __m128i x3, const unsigned char *p, size_t n)
{
    const __m128i k512 = _mm_set_epi64x((long long)fold_512[1], (long long)fold_512[0]);
    const __m128i k128 = _mm_set_epi64x((long long)fold_128[1], (long long)fold_128[0]);
    for (; n >= 64; p += 64, n -= 64) { /* four lanes, each 512 bits on */
        x0 = crc_fold(x0, k512, _mm_loadu_si128((const __m128i *)p));
        x1 = crc_fold(x1, k512, _mm_loadu_si128((const __m128i *)(p + 16)));
        x2 = crc_fold(x2, k512, _mm_loadu_si128((const __m128i *)(p + 32)));
        x3 = crc_fold(x3, k512, _mm_loadu_si128((const __m128i *)(p + 48)));
    }
    x1 = crc_fold(x0, k128, x1); /* the lanes into one, 128 bits at a time */
    x2 = crc_fold(x1, k128, x2);
    x3 = crc_fold(x2, k128, x3);
    for (; n >= 16; p += 16, n -= 16)
        x3 = crc_fold(x3, k128, _mm_loadu_si128((const __m128i *)p));
    unsigned char last[16];
    _mm_storeu_si128((__m128i *)last, x3);
    return crc32_bytes(crc32_bytes(0, last, 16), p, n);
}

/* n >= 64. The register so far enters as the first 32 message bits (XORed in), as in the byte loop. */
__attribute__((target("pclmul,sse4.1")))
static uint32_t crc32_folded(uint32_t reg, const unsigned char *p, size_t n)
{
    __m128i x0 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128((int)reg));
    return crc32_lanes(x0, _mm_loadu_si128((const __m128i *)(p + 16)), _mm_loadu_si128((const __m128i *)(p + 32)),
                       _mm_loadu_si128((const __m128i *)(p + 48)), p + 64, n - 64);
}

#define CRC_AVX512 "avx512f,vpclmulqdq,pclmul,sse4.1"

/* crc_fold on the four 128-bit lanes of a 512-bit register at once */
__attribute__((target(CRC_AVX512)))
static inline __m512i crc_fold4(__m512i a, __m512i k, __m512i next)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a, k, 0x00), _mm512_clmulepi64_epi128(a, k, 0x11),
                                     next, 0x96); /* a ^ b ^ next */
}

/* n >= 256: sixteen lanes in four 512-bit registers, 256 bytes a step (each lane 2048 bits on);
 * then the registers fold into one, 512 bits at a time, whose four lanes go on in crc32_lanes. */
__attribute__((target(CRC_AVX512)))
static uint32_t crc32_folded_avx512(uint32_t reg, const unsigned char *p, size_t n)
{
    const __m512i k2048 = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)fold_2048[1], (long long)fold_2048[0]));
    const __m512i k512 = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)fold_512[1], (long long)fold_512[0]));
    __m512i z0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)reg)));
    __m512i z1 = _mm512_loadu_si512(p + 64), z2 = _mm512_loadu_si512(p + 128), z3 = _mm512_loadu_si512(p + 192);
    for (p += 256, n -= 256; n >= 256; p += 256, n -= 256) {
        z0 = crc_fold4(z0, k2048, _mm512_loadu_si512(p));
        z1 = crc_fold4(z1, k2048, _mm512_loadu_si512(p + 64));
        z2 = crc_fold4(z2, k2048, _mm512_loadu_si512(p + 128));
        z3 = crc_fold4(z3, k2048, _mm512_loadu_si512(p + 192));
    }
    z3 = crc_fold4(crc_fold4(crc_fold4(z0, k512, z1), k512, z2), k512, z3);
    return crc32_lanes(_mm512_extracti32x4_epi32(z3, 0), _mm512_extracti32x4_epi32(z3, 1),
                       _mm512_extracti32x4_epi32(z3, 2), _mm512_extracti32x4_epi32(z3, 3), p, n);
}
#endif

uint32_t crc32_update(uint32_t crc, const unsigned char *p, size_t n)
{
    uint32_t reg = ~crc;
#if defined(__x86_64__) && defined(__GNUC__)
    if (crc_path == CRC_VPCLMUL && n >= 256)
        return ~crc32_folded_avx512(reg, p, n);
    if (crc_path != CRC_BYTES && n >= 64)
        return ~crc32_folded(reg, p, n);
#endif
    return ~crc32_bytes(reg, p, n);
}

void crc32_init(void)
{
    crc32_tables();
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1"))
        crc_best = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") ? CRC_VPCLMUL : CRC_PCLMUL;
    crc_path = crc_best;
#endif
}

const char *crc32_path(const char *name, const char **best)
{
    *best = crc_path_names[crc_best];
    if (name != NULL) {
        int found = -1;
        for (int i = 0; i <= (int)crc_best; i++)
            if (strcmp(name, crc_path_names[i]) == 0)
                found = i;
        if (found < 0)
            return NULL;
        crc_path = (enum crc_path)found;
    }
    return crc_path_names[crc_path];
}
