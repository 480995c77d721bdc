// What both engines share (see engine_base.hpp), and the default read-stream loop: one chunk
// after another, each a batch of its own.
#include "tutti/detail/engine_base.hpp"

#include "tutti/detail/checksums.hpp"
#include "tutti/detail/stream.hpp"
#include "tutti/error.hpp"

namespace tutti::detail {

std::shared_lock<std::shared_mutex> EngineBase::live() {
  std::shared_lock<std::shared_mutex> lock(life_mu_);
  TUTTI_EXPECT(!closed_, "engine is closed");
  return lock;
}

int EngineBase::open_file(const std::string& path, bool writable, bool direct) {
  auto life = live();
  const int index = files_.open(path, writable, direct);
  try {
    file_opened(index, path);
  } catch (...) {
    files_.close(index);
    throw;
  }
  return index;
}

void EngineBase::submit(Op op, const Batch& b, int32_t* results, const Groups* groups) {
  auto life = live();
  stats_.batches++;
  stats_.requests += b.n;
  if (!groups) {
    run_batch(op, b, nullptr, results);
    return;
  }
  TUTTI_EXPECT(op == Op::kRead, "checksum groups are for reads only");
  check_groups(groups->start, groups->n, b.n);
  GroupChecksums sums(b.addr, b.nbytes, groups->start, groups->n, b.n, groups->sums,
                      task_pool());
  try {
    run_batch(op, b, &sums, results);
  } catch (...) {
    sums.wait();  // no checksum may still be reading the caller's memory
    throw;
  }
  sums.wait();
}

std::unique_ptr<ReadStream> EngineBase::read_stream(StreamSpec spec) {
  auto life = live();
  auto s = std::make_unique<Stream>(*this, std::move(spec));
  bool registered = false;
  {
    std::lock_guard lock(streams_mu_);
    if (!closing_) registered = streams_.insert(s.get()).second;
  }
  if (!registered) {  // close() began meanwhile and would not cancel this one
    s->cancel();
    TUTTI_EXPECT(false, "engine is closed");
  }
  stats_.batches++;
  stats_.requests += s->batch().n;
  return s;
}

void EngineBase::forget(Stream* s) noexcept {
  std::lock_guard lock(streams_mu_);
  streams_.erase(s);
}

void EngineBase::close() {
  {
    std::lock_guard streams(streams_mu_);
    closing_ = true;
    for (Stream* s : streams_) s->cancel();  // a stream waiting for allow() ends now
  }
  std::unique_lock lock(life_mu_);  // waits for running batches and streams
  if (closed_) return;
  closed_ = true;
  release();
  files_.close_all();
}

TaskPool* EngineBase::task_pool() {
  std::lock_guard lock(task_mu_);
  if (!tasks_) tasks_ = std::make_unique<TaskPool>(opt_.threads);
  return tasks_.get();
}

void EngineBase::run_stream(Stream& s) {
  const Batch& all = s.batch();
  size_t allowed = 0;
  for (size_t c = 0; c < s.nchunks(); ++c) {
    while (allowed <= c) {  // admitted by allow()
      size_t now = s.wait_allowed(allowed);
      if (now == allowed) return;  // cancelled
      allowed = now;
    }
    if (s.cancelled()) return;
    const int64_t b0 = s.chunk_begin(c);
    const Batch b{all.file + b0, all.offset + b0, all.nbytes + b0, all.addr + b0,
                  static_cast<size_t>(s.chunk_end(c) - b0)};
    ShiftedCompletion hook(s.on_done(), static_cast<size_t>(b0));
    s.planned(c, 1);
    {
      auto life = live();
      run_batch(Op::kRead, b, s.on_done() ? &hook : nullptr, s.results_data() + b0);
    }
    s.op_finished(c);
  }
}

}  // namespace tutti::detail
