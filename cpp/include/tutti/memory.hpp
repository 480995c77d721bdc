// Byte helpers that run with the GIL released: checksums, batched copies, aligned buffers.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tutti {

// out[g] = XXH3-64 over the pieces group_start[g] .. group_start[g+1]-1, in order.
void checksum_groups(const uint64_t* addr, const int64_t* len, const int64_t* group_start,
                     size_t ngroups, uint64_t* out, unsigned threads);

// memcpy(dst[i], src[i], len[i]) for every i, on up to `threads` threads (one per 2 MiB).
void memcpy_batch(const uint64_t* dst, const uint64_t* src, const int64_t* len, size_t n,
                  unsigned threads);

// Page-aligned anonymous memory (mmap), suitable for O_DIRECT and registration.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t nbytes);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }

 private:
  void* data_ = nullptr;
  size_t nbytes_;
};

}  // namespace tutti
