/*
 * Q4_K's and Q5_K's eight 6-bit scales and eight 6-bit mins, packed in 12 bytes of each super-block: what
 * kquant_linear.c (float activations), int8_dot_kquants.c (8-bit) and int16_dot*.c (16-bit) all unpack.
 */
#ifndef PAGEDSERVE_KQUANT_SCALES_H
#define PAGEDSERVE_KQUANT_SCALES_H

#include <stdint.h>
#include <string.h>

/* The 12 bytes as three words: the low 6 bits of words 0 (scales 0-3) and 1 (mins 0-3); word 2 the low nibbles
 * of scales 4-7 and (high nibbles) mins 4-7, whose top 2 bits are bits 6-7 of words 0 and 1. Out: four words of
 * four bytes each, scales 0-3, scales 4-7, mins 0-3, mins 4-7. */
static inline void unpack_scale_words(const uint8_t *packed_bytes, uint32_t words[4]) {
    uint32_t packed[3];
    memcpy(packed, packed_bytes, sizeof packed);
    const uint32_t six = 0x3F3F3F3Fu, nibble = 0x0F0F0F0Fu, two = 0x03030303u;
    words[0] = packed[0] & six;
    words[1] = (packed[2] & nibble) | ((packed[0] >> 6) & two) << 4;
    words[2] = packed[1] & six;
    words[3] = ((packed[2] >> 4) & nibble) | ((packed[1] >> 6) & two) << 4;
}

/* The same as eight scale bytes and eight min bytes. */
static inline void unpack_scales(const uint8_t *packed_bytes, uint8_t scales[8], uint8_t mins[8]) {
    uint32_t words[4];
    unpack_scale_words(packed_bytes, words);
    memcpy(scales, words, 8);
    memcpy(mins, words + 2, 8);
}

#endif
