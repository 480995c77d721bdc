// Byte work that must not run in Python: payload checksums (XXH3-64 over a slot's
// pieces), batched memcpy for the aligned bounce path, and page-aligned buffers.
#include "tutti/memory.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "tutti/engine.hpp"
#include "tutti/error.hpp"

namespace tutti {

uint64_t xxh3_pieces_avx2(const uint64_t* addr, const int64_t* len, int64_t begin, int64_t end);

namespace {

uint64_t xxh3_pieces_sse2(const uint64_t* addr, const int64_t* len, int64_t begin, int64_t end) {
  XXH3_state_t st;
  XXH3_64bits_reset(&st);
  for (int64_t i = begin; i < end; ++i)
    XXH3_64bits_update(&st, reinterpret_cast<const void*>(addr[i]), static_cast<size_t>(len[i]));
  return XXH3_64bits_digest(&st);
}

using PiecesFn = uint64_t (*)(const uint64_t*, const int64_t*, int64_t, int64_t);

// XXH3 over pieces [begin, end): the AVX2 build when the CPU has it (same hash value).
const PiecesFn xxh3_pieces = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") ? &xxh3_pieces_avx2 : &xxh3_pieces_sse2;
}();

// Run fn(begin, end) over [0, n) on up to `threads` threads, splitting by weight.
template <class Fn>
void parallel_ranges(size_t n, const std::vector<uint64_t>& weight_prefix, unsigned threads,
                     Fn fn) {
  const uint64_t total = weight_prefix.empty() ? 0 : weight_prefix.back();
  constexpr uint64_t kMinPerThread = 32ull << 20;
  unsigned t = static_cast<unsigned>(std::min<uint64_t>(threads, total / kMinPerThread + 1));
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
  parallel_ranges(ngroups, prefix, threads, [&](size_t begin, size_t end) {
    for (size_t g = begin; g < end; ++g) out[g] = xxh3_pieces(addr, len, group_start[g], group_start[g + 1]);
  });
}

TaskPool::TaskPool(unsigned threads) {
  for (unsigned i = 0; i < std::max(1u, threads); ++i) threads_.emplace_back([this] { loop(); });
}

TaskPool::~TaskPool() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void TaskPool::push(std::function<void()> task) {
  {
    std::lock_guard lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void TaskPool::loop() {
  for (;;) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
    if (tasks_.empty()) return;  // stop_ and drained
    auto task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    task();
  }
}

GroupChecksums::GroupChecksums(const int64_t* group_start, size_t ngroups, size_t nreq,
                               uint64_t* out, TaskPool* pool)
    : pool_(pool),
      start_(group_start),
      out_(out),
      group_of_(nreq, UINT32_MAX),
      remaining_(new std::atomic<int32_t>[ngroups]),
      failed_(new std::atomic<bool>[ngroups]) {
  for (size_t g = 0; g < ngroups; ++g) {
    remaining_[g] = static_cast<int32_t>(group_start[g + 1] - group_start[g]);
    failed_[g] = false;
    out_[g] = 0;
    for (int64_t i = group_start[g]; i < group_start[g + 1]; ++i) group_of_[i] = g;
  }
}

void GroupChecksums::done(const Batch& b, size_t req, bool ok) {
  uint32_t g = group_of_[req];
  if (g == UINT32_MAX) return;
  if (!ok) failed_[g] = true;
  if (remaining_[g].fetch_sub(1) != 1 || failed_[g]) return;
  if (!pool_) {
    compute(b, g);
    return;
  }
  {
    std::lock_guard lock(mu_);
    pending_++;
  }
  if (on_task) on_task(g, +1);
  pool_->push([this, &b, g] {
    compute(b, g);
    if (on_task) on_task(g, -1);
    std::lock_guard lock(mu_);
    if (--pending_ == 0) cv_.notify_all();
  });
}

void GroupChecksums::compute(const Batch& b, uint32_t g) {
  out_[g] = xxh3_pieces(b.addr, b.nbytes, start_[g], start_[g + 1]);
}

void GroupChecksums::wait() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [this] { return pending_ == 0; });
}

void memcpy_batch(const uint64_t* dst, const uint64_t* src, const int64_t* len, size_t n,
                  unsigned threads) {
  std::vector<uint64_t> prefix(n);
  uint64_t acc = 0;
  for (size_t i = 0; i < n; ++i) prefix[i] = (acc += len[i]);
  parallel_ranges(n, prefix, threads, [&](size_t begin, size_t end) {
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
