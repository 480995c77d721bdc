// Byte work that must not run in Python: payload checksums (XXH3-64 over a slot's
// pieces), batched memcpy for the aligned bounce path, and page-aligned buffers.
#include "tutti/memory.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "tutti/detail/checksums.hpp"
#include "tutti/error.hpp"

namespace tutti {
namespace {

// The least work one more thread takes. Checksums keep 32 MiB, their value from the start. A
// memcpy splits from 2 MiB: a DRAM-tier copy-up is one layer's staging chunk (8-16 MiB), and on
// one thread it held a load's reads to 10.4 GB/s in the H200 capacity run, below the array's 17.
constexpr uint64_t kChecksumPerThread = 32ull << 20;
constexpr uint64_t kCopyPerThread = 2ull << 20;

// Run fn(begin, end) over [0, n) on up to `threads` threads, splitting by weight, each thread
// given at least min_per_thread of it.
template <class Fn>
void parallel_ranges(size_t n, const std::vector<uint64_t>& weight_prefix, unsigned threads,
                     uint64_t min_per_thread, Fn fn) {
  const uint64_t total = weight_prefix.empty() ? 0 : weight_prefix.back();
  unsigned t = static_cast<unsigned>(std::min<uint64_t>(threads, total / min_per_thread + 1));
  t = std::max(1u, std::min<unsigned>(t, static_cast<unsigned>(n ? n : 1)));
  if (t == 1) {
    fn(0, n);
    return;
  }
  std::vector<size_t> cuts{0};
  for (unsigned k = 1; k < t; ++k) {
    uint64_t target = total * k / t;
    size_t i = std::lower_bound(weight_prefix.begin(), weight_prefix.end(), target) -
               weight_prefix.begin();
    cuts.push_back(std::max(cuts.back(), std::min(i, n)));
  }
  cuts.push_back(n);
  std::vector<std::thread> pool;
  for (unsigned k = 1; k < t; ++k) pool.emplace_back(fn, cuts[k], cuts[k + 1]);
  fn(cuts[0], cuts[1]);
  for (auto& th : pool) th.join();
}

}  // namespace

void checksum_groups(const uint64_t* addr, const int64_t* len, const int64_t* group_start,
                     size_t ngroups, uint64_t* out, unsigned threads) {
  std::vector<uint64_t> prefix(ngroups);
  uint64_t acc = 0;
  for (size_t g = 0; g < ngroups; ++g) {
    for (int64_t i = group_start[g]; i < group_start[g + 1]; ++i) acc += len[i];
    prefix[g] = acc;
  }
  parallel_ranges(ngroups, prefix, threads, kChecksumPerThread, [&](size_t begin, size_t end) {
    for (size_t g = begin; g < end; ++g)
      out[g] = detail::xxh3_pieces(addr, len, group_start[g], group_start[g + 1]);
  });
}

void memcpy_batch(const uint64_t* dst, const uint64_t* src, const int64_t* len, size_t n,
                  unsigned threads) {
  std::vector<uint64_t> prefix(n);
  uint64_t acc = 0;
  for (size_t i = 0; i < n; ++i) prefix[i] = (acc += len[i]);
  parallel_ranges(n, prefix, threads, kCopyPerThread, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i)
      std::memcpy(reinterpret_cast<void*>(dst[i]), reinterpret_cast<const void*>(src[i]), len[i]);
  });
}

AlignedBuffer::AlignedBuffer(size_t nbytes) : nbytes_(nbytes) {
  TUTTI_EXPECT(nbytes > 0, "AlignedBuffer: nbytes must be positive");
  void* p = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) TUTTI_SYS_FAIL(errno, "mmap " + std::to_string(nbytes) + " bytes", "");
  data_ = p;
}

AlignedBuffer::~AlignedBuffer() {
  if (data_) munmap(data_, nbytes_);
}

}  // namespace tutti
