// The read stream's bookkeeping: what may be submitted (allow()), when a chunk is final; its thread runs the engine's stream loop (EngineBase::run_stream, or the
// io_uring ring's).
#include "tutti/detail/stream.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <time.h>

#include <algorithm>
#include <cerrno>

#include "tutti/error.hpp"

namespace tutti::detail {

namespace {
int64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}
}  // namespace

Stream::Stream(EngineBase& engine, StreamSpec spec) : engine_(engine), spec_(std::move(spec)) {
  const size_t n = spec_.file.size();
  const auto& cs = spec_.chunk_start;
  TUTTI_EXPECT(spec_.offset.size() == n && spec_.nbytes.size() == n && spec_.addr.size() == n,
               "batch arrays must have the same length");
  TUTTI_EXPECT(cs.size() >= 2 && cs.front() == 0 && cs.back() == static_cast<int64_t>(n),
               "chunk_start must run from 0 to the number of requests");
  for (size_t c = 0; c + 1 < cs.size(); ++c)
    TUTTI_EXPECT(cs[c] <= cs[c + 1], "chunk_start must be non-decreasing");
  const size_t nc = nchunks();
  results_.assign(n, 0);
  chunk_groups_.assign(nc, {0, 0});
  validate_groups();
  ops_left_.assign(nc, 0);
  tasks_left_.assign(nc, 0);
  planned_.assign(nc, 0);
  done_.assign(nc, 0);
  done_ns_.assign(nc, 0);
  batch_ = Batch{spec_.file.data(), spec_.offset.data(), spec_.nbytes.data(), spec_.addr.data(), n};
  if (!sums_.empty()) {
    groups_ = std::make_unique<GroupChecksums>(batch_.addr, batch_.nbytes, spec_.group_start.data(),
                                               sums_.size(), n, sums_.data(), engine_.task_pool());
    groups_->on_task = [this](uint32_t g, int delta) { task(group_chunk_[g], delta); };
  }
  wake_fd_ = eventfd(0, EFD_CLOEXEC);
  if (wake_fd_ < 0) TUTTI_SYS_FAIL(errno, "eventfd", "");
  thread_ = std::thread([this] { run(); });
}

// Groups in order, each non-empty and inside one chunk; sets sums_, chunk_groups_, group_chunk_.
void Stream::validate_groups() {
  const auto& gs = spec_.group_start;
  const auto& cs = spec_.chunk_start;
  const size_t ng = gs.empty() ? 0 : gs.size() - 1, nc = nchunks();
  const int64_t n = static_cast<int64_t>(spec_.file.size());
  sums_.assign(ng, 0);
  group_chunk_.assign(ng, 0);
  size_t c = 0;
  for (size_t g = 0; g < ng; ++g) {
    TUTTI_EXPECT(gs[g] >= 0 && gs[g] < gs[g + 1] && gs[g + 1] <= n,
                 "groups must be non-empty, increasing and within the batch");
    while (c < nc && cs[c + 1] <= gs[g]) c++;
    TUTTI_EXPECT(c < nc && gs[g + 1] <= cs[c + 1], "a checksum group must lie inside one chunk");
    if (chunk_groups_[c].second == 0) chunk_groups_[c].first = g;
    chunk_groups_[c].second = g + 1;
    group_chunk_[g] = static_cast<uint32_t>(c);
  }
}

Stream::~Stream() {
  engine_.forget(this);  // before cancel: close() may be cancelling every registered stream
  cancel();
  {
    std::lock_guard joining(join_mu_);
    if (thread_.joinable()) thread_.join();
  }
  if (groups_) groups_->wait();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Stream::run() {
  try {
    engine_.run_stream(*this);
  } catch (...) {
    std::lock_guard lock(mu_);
    error_ = std::current_exception();
  }
  if (groups_) groups_->wait();
  std::lock_guard lock(mu_);
  for (size_t c = 0; c < nchunks(); ++c) {  // whatever never ran ends here
    for (int64_t i = chunk_begin(c); i < chunk_end(c); ++i) {
      const size_t r = static_cast<size_t>(i);
      if (results_[r] == 0 && spec_.nbytes[r] != 0) results_[r] = -ECANCELED;
    }
    if (!done_[c]) done_ns_[c] = now_ns();
    done_[c] = 1;
  }
  ended_ = true;
  cv_.notify_all();
}

void Stream::allow(size_t chunks) {
  {
    std::lock_guard lock(mu_);
    if (chunks <= allowed_) return;
    allowed_ = std::min(chunks, nchunks());
  }
  cv_.notify_all();
  wake_loop();
}

void Stream::wake_loop() {
  uint64_t one = 1;
  if (::write(wake_fd_, &one, sizeof one) < 0) { /* the counter is full: a wake is pending */ }
}

void Stream::cancel() noexcept {
  {
    std::lock_guard lock(mu_);
    if (cancelled_) return;
    cancelled_ = true;
  }
  cv_.notify_all();
  wake_loop();
}

ChunkResults Stream::wait(size_t chunk) {
  TUTTI_EXPECT(chunk < nchunks(), "read stream: no such chunk");
  {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return done_[chunk] || ended_; });
    if (error_) std::rethrow_exception(error_);
  }
  const size_t b0 = static_cast<size_t>(chunk_begin(chunk));
  const auto [g0, g1] = chunk_groups_[chunk];
  return ChunkResults{results_.data() + b0, static_cast<size_t>(chunk_end(chunk)) - b0,
                      sums_.data() + g0, g1 - g0};
}

bool Stream::final(size_t chunk) {
  TUTTI_EXPECT(chunk < nchunks(), "read stream: no such chunk");
  std::lock_guard lock(mu_);
  return done_[chunk] || ended_;
}

void Stream::join() {
  {
    std::lock_guard joining(join_mu_);
    if (thread_.joinable()) thread_.join();
  }
  std::lock_guard lock(mu_);
  if (error_) std::rethrow_exception(error_);
}

std::vector<int64_t> Stream::done_ns() {
  std::lock_guard lock(mu_);
  return done_ns_;
}

size_t Stream::allowed() {
  std::lock_guard lock(mu_);
  return allowed_;
}

bool Stream::cancelled() {
  std::lock_guard lock(mu_);
  return cancelled_;
}

size_t Stream::wait_allowed(size_t have) {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return allowed_ > have || cancelled_; });
  return cancelled_ ? have : allowed_;
}

void Stream::planned(size_t c, size_t ops) {
  std::lock_guard lock(mu_);
  ops_left_[c] += static_cast<int64_t>(ops);
  planned_[c] = 1;
  check_done(c);
}

void Stream::op_finished(size_t c) {
  std::lock_guard lock(mu_);
  ops_left_[c]--;
  check_done(c);
}

void Stream::task(size_t c, int delta) {  // on a checksum thread (GroupChecksums::on_task)
  std::lock_guard lock(mu_);
  tasks_left_[c] += delta;
  check_done(c);
}

size_t Stream::ops_left_oldest() {
  std::lock_guard lock(mu_);  // chunks with only checksums left need no more completions
  while (oldest_ < nchunks() && (done_[oldest_] || (planned_[oldest_] && !ops_left_[oldest_])))
    oldest_++;
  if (oldest_ == nchunks()) return 1;
  return static_cast<size_t>(std::max<int64_t>(1, ops_left_[oldest_]));
}

void Stream::check_done(size_t c) {
  if (done_[c] || !planned_[c] || ops_left_[c] > 0 || tasks_left_[c] > 0) return;
  done_[c] = 1;
  done_ns_[c] = now_ns();
  cv_.notify_all();  // wait()
}

}  // namespace tutti::detail
