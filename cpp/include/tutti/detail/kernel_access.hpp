// Memory the kernel reads or writes for an io_uring operation (the buffers, the wake counter of a
// read stream) is touched by no instrumented instruction, so neither sanitizer sees it: a read
// landing in a dead stack frame or a freed buffer, or a checksum racing the read it sums, would go
// unreported. In a sanitizer build (TUTTI_SANITIZE, CMakeLists.txt) these hooks make the kernel's
// accesses visible; in a normal build they compile to nothing. (The POSIX engine needs none: both
// sanitizers intercept preadv/pwritev and check their iovecs.)
#pragma once

#include <sys/uio.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#elif defined(__SANITIZE_THREAD__) && defined(__clang__)  // GCC has them as built-ins
extern "C" void __tsan_read_range(void* addr, unsigned long size);
extern "C" void __tsan_write_range(void* addr, unsigned long size);
#endif

namespace tutti::detail {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kKernelAccessChecked = true;
#else
constexpr bool kKernelAccessChecked = false;
#endif

// The kernel is about to access, or has just accessed, [p, p + n) for this thread's operation
// (writes: it stores there, a read). AddressSanitizer: a report (and abort) unless the whole range
// is addressable memory. ThreadSanitizer: an access by this thread at this point, so whatever the
// other threads do to the range must be ordered with the submission or the completion.
// Not inlined in a sanitizer build: a report's first frame is then the caller's line.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
__attribute__((noinline))
#endif
inline void kernel_access(const void* p, size_t n, bool writes) {
  if (n == 0) return;
#if defined(__SANITIZE_ADDRESS__)
  if (void* bad = __asan_region_is_poisoned(const_cast<void*>(p), n))
    __asan_report_error(__builtin_return_address(0), __builtin_frame_address(0),
                        __builtin_frame_address(0), bad, writes ? 1 : 0, n);
#elif defined(__SANITIZE_THREAD__)
  if (writes)
    __tsan_write_range(const_cast<void*>(p), static_cast<long>(n));
  else
    __tsan_read_range(const_cast<void*>(p), static_cast<long>(n));
#else
  (void)p;
  (void)writes;
#endif
}

// An operation through the iovecs [iov, iov + count) (which the kernel reads too) moving its
// first n bytes, as kernel_access for each piece. Nothing at all in a normal build.
inline void kernel_moves(const iovec* iov, uint32_t count, int64_t n, bool writes) {
  if constexpr (!kKernelAccessChecked) return;
  kernel_access(iov, count * sizeof(iovec), false);
  for (uint32_t k = 0; k < count && n > 0; ++k) {
    const size_t len = std::min(iov[k].iov_len, static_cast<size_t>(n));
    kernel_access(iov[k].iov_base, len, writes);
    n -= static_cast<int64_t>(len);
  }
}

}  // namespace tutti::detail
