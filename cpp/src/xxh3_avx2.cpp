// XXH3-64 over a list of pieces, compiled with AVX2 (see CMakeLists.txt); checksums.cpp picks it at
// run time when the CPU has AVX2. The hash value is the same as the SSE2 build's.
#include <cstdint>

#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include <xxhash.h>

namespace tutti::detail {

uint64_t xxh3_pieces_avx2(const uint64_t* addr, const int64_t* len, int64_t begin, int64_t end) {
  XXH3_state_t st;
  XXH3_64bits_reset(&st);
  for (int64_t i = begin; i < end; ++i)
    XXH3_64bits_update(&st, reinterpret_cast<const void*>(addr[i]), static_cast<size_t>(len[i]));
  return XXH3_64bits_digest(&st);
}

}  // namespace tutti::detail
