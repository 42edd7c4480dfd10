/* CRC-32 exactly as zlib's crc32() computes it, folded with carry-less multiply where the CPU has it. */
#ifndef CXLTRAIN_CRC32_H
#define CXLTRAIN_CRC32_H

#include <stddef.h>
#include <stdint.h>

/* Build the tables and pick the widest fold the CPU has (once, at module load). */
void crc32_init(void);
/* zlib.crc32 of n bytes at p, continuing crc. */
uint32_t crc32_update(uint32_t crc, const unsigned char *p, size_t n);
/* The fold in use ("bytes", "pclmul", "vpclmul"), after switching to `name` (NULL: no switch);
 * NULL when the CPU lacks `name` (then *best says the widest it has). */
const char *crc32_path(const char *name, const char **best);

#endif
