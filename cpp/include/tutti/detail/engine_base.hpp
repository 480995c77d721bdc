// What both engines share: the file table, counters, checksum workers, the engine's life (close
// waits for running batches), verified reads on a completion hook, and the default read-stream
// loop. An engine supplies run_batch and release, and may override run_stream.
#pragma once

#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "tutti/detail/counters.hpp"
#include "tutti/detail/file_table.hpp"
#include "tutti/detail/plan.hpp"
#include "tutti/detail/task_pool.hpp"
#include "tutti/engine.hpp"

namespace tutti::detail {

class Stream;

class EngineBase : public Engine {
 public:
  explicit EngineBase(const EngineOptions& opt) : opt_(opt) {}

  int open_file(const std::string& path, bool writable, bool direct) final;
  void submit(Op op, const Batch& b, int32_t* results, const Groups* groups) final;
  std::unique_ptr<ReadStream> read_stream(StreamSpec spec) final;
  Counters counters() const noexcept final { return stats_.snapshot(); }
  void close() final;

  // Runs a read stream to its end, on the stream's own thread. This default submits one chunk
  // after another as a batch; the io_uring engine keeps the next chunks' operations queued
  // behind the current one's.
  virtual void run_stream(Stream& s);
  // Workers for per-group checksums during reads (created on first use).
  TaskPool* task_pool();
  // ~Stream: the stream is gone. read_stream registers each stream, and close() cancels those
  // still registered before it waits for them: a stream waiting for its owner's allow() holds
  // the engine's life, and a close() from that owner (or racing its load) would wait forever.
  void forget(Stream* s) noexcept;

 protected:
  // One batch to completion; the caller holds live(). on_done (optional) hears of each request.
  virtual void run_batch(Op op, const Batch& b, Completion* on_done, int32_t* results) = 0;
  // A file was opened at `index` (the io_uring engine registers it); throwing closes it again.
  virtual void file_opened(int index, const std::string& path) {
    (void)index;
    (void)path;
  }
  // close(): free rings and workers; files are closed afterwards. Called once.
  virtual void release() = 0;
  // Shared hold on the engine's life: close() waits for every holder. Throws once closed.
  std::shared_lock<std::shared_mutex> live();

  const EngineOptions opt_;
  FileTable files_;
  AtomicCounters stats_;

 private:
  std::shared_mutex life_mu_;
  bool closed_ = false;  // under life_mu_
  std::mutex streams_mu_;
  std::set<Stream*> streams_;  // under streams_mu_
  bool closing_ = false;       // under streams_mu_: close() has begun, no new stream
  std::mutex task_mu_;
  std::unique_ptr<TaskPool> tasks_;
};

std::unique_ptr<Engine> make_uring_engine(const EngineOptions& opt);  // throws SysError
std::unique_ptr<Engine> make_posix_engine(const EngineOptions& opt);

}  // namespace tutti::detail
