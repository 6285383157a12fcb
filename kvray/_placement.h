/* Placement digests, shared by the C copy pool and the planner's loops (kvray/placement.py has
 * the definition and why): a range is worth F(end) - F(start) mod 2**64, F SplitMix64's
 * finalizer of the address mixed with the region's salt. */
#ifndef KVRAY_PLACEMENT_H
#define KVRAY_PLACEMENT_H

#include <stdint.h>

static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static inline uint64_t range_worth(uint64_t salt, uint64_t start, uint64_t n) {
    return mix64(salt ^ (start + n)) - mix64(salt ^ start);
}

#endif
