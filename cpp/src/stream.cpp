// ReadStream: the bookkeeping of a many-chunk read (what may be submitted, when a chunk is
// final) and the default run loop, one chunk after another. The io_uring engine overrides
// Engine::run_stream to keep the chunks back to back in one ring (uring_engine.cpp).
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>

#include "tutti/engine.hpp"
#include "tutti/error.hpp"

namespace tutti {

ReadStream::ReadStream(Engine& engine, std::vector<int64_t> file, std::vector<int64_t> offset,
                       std::vector<int64_t> nbytes, std::vector<uint64_t> addr,
                       std::vector<int64_t> chunk_start, std::vector<int64_t> group_start)
    : engine_(engine),
      file_(std::move(file)),
      offset_(std::move(offset)),
      nbytes_(std::move(nbytes)),
      addr_(std::move(addr)),
      chunk_start_(std::move(chunk_start)),
      group_start_(std::move(group_start)) {
  const size_t n = file_.size();
  TUTTI_EXPECT(offset_.size() == n && nbytes_.size() == n && addr_.size() == n,
               "batch arrays must have the same length");
  TUTTI_EXPECT(chunk_start_.size() >= 2 && chunk_start_.front() == 0 &&
                   chunk_start_.back() == static_cast<int64_t>(n),
               "chunk_start must run from 0 to the number of requests");
  for (size_t c = 0; c + 1 < chunk_start_.size(); ++c)
    TUTTI_EXPECT(chunk_start_[c] <= chunk_start_[c + 1], "chunk_start must be non-decreasing");
  const size_t nc = nchunks();
  results_.assign(n, 0);
  chunk_groups_.assign(nc, {0, 0});
  const size_t ng = group_start_.empty() ? 0 : group_start_.size() - 1;
  sums_.assign(ng, 0);
  group_chunk_.assign(ng, 0);
  size_t c = 0;
  for (size_t g = 0; g < ng; ++g) {  // groups in order, each inside one chunk
    TUTTI_EXPECT(group_start_[g] >= 0 && group_start_[g] < group_start_[g + 1] &&
                     group_start_[g + 1] <= static_cast<int64_t>(n),
                 "groups must be non-empty, increasing and within the batch");
    while (c < nc && chunk_start_[c + 1] <= group_start_[g]) c++;
    TUTTI_EXPECT(c < nc && group_start_[g + 1] <= chunk_start_[c + 1],
                 "a checksum group must lie inside one chunk");
    if (chunk_groups_[c].second == 0) chunk_groups_[c].first = g;
    chunk_groups_[c].second = g + 1;
    group_chunk_[g] = static_cast<uint32_t>(c);
  }
  ops_left_.assign(nc, 0);
  tasks_left_.assign(nc, 0);
  planned_.assign(nc, 0);
  done_.assign(nc, 0);
  batch_ = Batch{file_.data(), offset_.data(), nbytes_.data(), addr_.data(), n, nullptr};
  if (ng) {
    groups_ = std::make_unique<GroupChecksums>(group_start_.data(), ng, n, sums_.data(),
                                               engine_.task_pool());
    groups_->on_task = [this](uint32_t g, int delta) { task(group_chunk_[g], delta); };
    batch_.groups = groups_.get();
  }
  wake_fd_ = eventfd(0, EFD_CLOEXEC);
  if (wake_fd_ < 0) TUTTI_SYS_FAIL(errno, "eventfd", "");
  thread_ = std::thread([this] { run(); });
}

ReadStream::~ReadStream() {
  cancel();
  if (thread_.joinable()) thread_.join();
  if (groups_) groups_->wait();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void ReadStream::run() {
  try {
    engine_.run_stream(*this);
  } catch (...) {
    std::lock_guard lock(mu_);
    error_ = std::current_exception();
  }
  if (groups_) groups_->wait();
  std::lock_guard lock(mu_);
  for (size_t c = 0; c < nchunks(); ++c) {  // whatever never ran ends here
    for (int64_t i = chunk_start_[c]; i < chunk_start_[c + 1]; ++i)
      if (results_[i] == 0 && nbytes_[i] != 0) results_[i] = -ECANCELED;
    done_[c] = 1;
  }
  ended_ = true;
  cv_.notify_all();
}

void ReadStream::allow(size_t chunks) {
  {
    std::lock_guard lock(mu_);
    if (chunks <= allowed_) return;
    allowed_ = std::min(chunks, nchunks());
  }
  cv_.notify_all();
  uint64_t one = 1;
  if (::write(wake_fd_, &one, sizeof one) < 0) { /* the counter is full: a wake is pending */ }
}

void ReadStream::cancel() {
  {
    std::lock_guard lock(mu_);
    if (cancelled_) return;
    cancelled_ = true;
  }
  cv_.notify_all();
  uint64_t one = 1;
  if (::write(wake_fd_, &one, sizeof one) < 0) { /* a wake is pending */ }
}

void ReadStream::wait(size_t chunk) {
  TUTTI_EXPECT(chunk < nchunks(), "read stream: no such chunk");
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return done_[chunk] || ended_; });
  if (error_) std::rethrow_exception(error_);
}

void ReadStream::join() {
  if (thread_.joinable()) thread_.join();
  std::lock_guard lock(mu_);
  if (error_) std::rethrow_exception(error_);
}

size_t ReadStream::allowed() {
  std::lock_guard lock(mu_);
  return allowed_;
}

bool ReadStream::cancelled() {
  std::lock_guard lock(mu_);
  return cancelled_;
}

size_t ReadStream::wait_allowed(size_t have) {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return allowed_ > have || cancelled_; });
  return cancelled_ ? have : allowed_;
}

void ReadStream::planned(size_t c, size_t ops) {
  std::lock_guard lock(mu_);
  ops_left_[c] += static_cast<int64_t>(ops);
  planned_[c] = 1;
  check_done(c);
}

void ReadStream::op_finished(size_t c) {
  std::lock_guard lock(mu_);
  ops_left_[c]--;
  check_done(c);
}

void ReadStream::task(size_t c, int delta) {
  std::lock_guard lock(mu_);
  tasks_left_[c] += delta;
  check_done(c);
}

size_t ReadStream::ops_left_oldest() {
  std::lock_guard lock(mu_);  // chunks with only checksums left need no more completions
  while (oldest_ < nchunks() && (done_[oldest_] || (planned_[oldest_] && !ops_left_[oldest_])))
    oldest_++;
  if (oldest_ == nchunks()) return 1;
  return static_cast<size_t>(std::max<int64_t>(1, ops_left_[oldest_]));
}

void ReadStream::check_done(size_t c) {
  if (done_[c] || !planned_[c] || ops_left_[c] > 0 || tasks_left_[c] > 0) return;
  done_[c] = 1;
  cv_.notify_all();
}

// Default: one chunk after another, each a batch of its own.
void Engine::run_stream(ReadStream& s) {
  const Batch& all = s.batch();
  size_t allowed = 0;
  for (size_t c = 0; c < s.nchunks(); ++c) {
    while (allowed <= c) {
      size_t now = s.wait_allowed(allowed);
      if (now == allowed) return;  // cancelled
      allowed = now;
    }
    if (s.cancelled()) return;
    const int64_t b0 = s.chunk_begin(c), n = s.chunk_end(c) - b0;
    Batch b{all.file + b0, all.offset + b0, all.nbytes + b0, all.addr + b0,
            static_cast<size_t>(n), nullptr};
    auto [g0, g1] = s.chunk_groups(c);
    std::vector<int64_t> starts;  // the chunk's groups, relative to the chunk
    std::unique_ptr<GroupChecksums> groups;
    if (all.groups && g1 > g0) {
      starts.resize(g1 - g0 + 1);
      const int64_t* gs = s.group_starts();
      for (size_t g = g0; g <= g1; ++g) starts[g - g0] = gs[g] - b0;
      groups = std::make_unique<GroupChecksums>(starts.data(), g1 - g0, b.n, s.sums_data() + g0,
                                                task_pool());
      b.groups = groups.get();
    }
    s.planned(c, 1);
    try {
      submit(Op::kRead, b, s.results_data() + b0);
    } catch (...) {
      if (groups) groups->wait();
      throw;
    }
    if (groups) groups->wait();
    s.op_finished(c);
  }
}

}  // namespace tutti
