// XXH3-64 over pieces (SSE2 here, AVX2 in xxh3_avx2.cpp, picked once by CPU), and the group
// checksums of verified reads.
#include "tutti/detail/checksums.hpp"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "tutti/error.hpp"

namespace tutti::detail {

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

const PiecesFn pieces_fn = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") ? &xxh3_pieces_avx2 : &xxh3_pieces_sse2;
}();

}  // namespace

uint64_t xxh3_pieces(const uint64_t* addr, const int64_t* len, int64_t begin, int64_t end) {
  return pieces_fn(addr, len, begin, end);
}

void check_groups(const int64_t* start, size_t ngroups, size_t nreq) {
  for (size_t g = 0; g < ngroups; ++g)
    TUTTI_EXPECT(start[g] >= 0 && start[g] < start[g + 1] &&
                     static_cast<size_t>(start[g + 1]) <= nreq,
                 "groups must be non-empty, increasing and within the batch");
}

GroupChecksums::GroupChecksums(const uint64_t* addr, const int64_t* nbytes, const int64_t* start,
                               size_t ngroups, size_t nreq, uint64_t* out, TaskPool* pool)
    : addr_(addr),
      nbytes_(nbytes),
      start_(start),
      out_(out),
      pool_(pool),
      group_of_(nreq, UINT32_MAX),
      remaining_(new std::atomic<int32_t>[ngroups]),
      failed_(new std::atomic<bool>[ngroups]) {
  if (pool_) ready_.reserve(ngroups);  // done() never allocates under mu_
  for (size_t g = 0; g < ngroups; ++g) {
    remaining_[g] = static_cast<int32_t>(start[g + 1] - start[g]);
    failed_[g] = false;
    out_[g] = 0;
    for (int64_t i = start[g]; i < start[g + 1]; ++i)
      group_of_[static_cast<size_t>(i)] = static_cast<uint32_t>(g);
  }
}

void GroupChecksums::done(size_t request, bool ok) {
  const uint32_t g = group_of_[request];
  if (g == UINT32_MAX) return;
  if (!ok) failed_[g] = true;
  if (remaining_[g].fetch_sub(1) != 1 || failed_[g]) return;
  if (!pool_) {
    compute(g);
    return;
  }
  if (on_task) on_task(g, +1);  // now, before the engine counts the group's last op finished
  std::vector<uint32_t> batch;
  {
    std::lock_guard lock(mu_);
    ready_.push_back(g);
    for (int64_t i = start_[g]; i < start_[g + 1]; ++i) ready_bytes_ += nbytes_[i];
    if (ready_bytes_ < kTaskBytes) return;
    batch = take_ready();
  }
  dispatch(std::move(batch));
}

void GroupChecksums::flush() {
  std::vector<uint32_t> batch;
  {
    std::lock_guard lock(mu_);
    if (ready_.empty()) return;
    batch = take_ready();
  }
  dispatch(std::move(batch));
}

std::vector<uint32_t> GroupChecksums::take_ready() {
  std::vector<uint32_t> batch(ready_.begin(), ready_.end());  // ready_ keeps its reserved capacity
  ready_.clear();
  ready_bytes_ = 0;
  pending_++;  // settled by the task dispatch() makes of them
  return batch;
}

void GroupChecksums::dispatch(std::vector<uint32_t> groups) {
  auto run = [this](const std::vector<uint32_t>& gs) {
    for (const uint32_t g : gs) {
      compute(g);
      if (on_task) on_task(g, -1);
    }
    std::lock_guard lock(mu_);
    if (--pending_ == 0) cv_.notify_all();
  };
  try {
    pool_->push([run, groups] { run(groups); });
  } catch (...) {  // no room for the task: compute here, so pending_ and the chunks still settle
    run(groups);
  }
}

void GroupChecksums::compute(uint32_t g) {
  out_[g] = xxh3_pieces(addr_, nbytes_, start_[g], start_[g + 1]);
}

void GroupChecksums::wait() {
  if (pool_) flush();
  std::unique_lock lock(mu_);
  cv_.wait(lock, [this] { return pending_ == 0; });
}

}  // namespace tutti::detail
