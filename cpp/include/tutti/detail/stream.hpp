// The read stream behind tutti::ReadStream: what may be submitted, when a chunk is final, and
// the hooks the engines' run loops use (EngineBase::run_stream, the io_uring ring's loop).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "tutti/detail/checksums.hpp"
#include "tutti/detail/engine_base.hpp"
#include "tutti/engine.hpp"

namespace tutti::detail {

class Stream final : public ReadStream {
 public:
  Stream(EngineBase& engine, StreamSpec spec);  // validates spec, starts the thread
  ~Stream() override;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  size_t nchunks() const noexcept override { return spec_.chunk_start.size() - 1; }
  void allow(size_t chunks) override;
  ChunkResults wait(size_t chunk) override;
  bool final(size_t chunk) override;
  void cancel() noexcept override;
  void join() override;
  std::vector<int64_t> done_ns() override;

  // ---- for the engines' run loops (on the stream's thread)
  const Batch& batch() const { return batch_; }
  const std::vector<int64_t>& chunk_starts() const { return spec_.chunk_start; }
  int64_t chunk_begin(size_t c) const { return spec_.chunk_start[c]; }
  int64_t chunk_end(size_t c) const { return spec_.chunk_start[c + 1]; }
  int32_t* results_data() { return results_.data(); }
  Completion* on_done() { return groups_.get(); }  // the groups' checksums, or nullptr
  int wake_fd() const { return wake_fd_; }
  uint64_t* wake_buf() { return &wake_buf_; }  // target of the ring's read on wake_fd
  size_t allowed();                   // chunks that may be submitted now (allow())
  bool cancelled();
  size_t wait_allowed(size_t have);   // until more than `have` may be submitted or cancelled
  void planned(size_t c, size_t ops); // chunk c will finish after `ops` operations
  void op_finished(size_t c);         // one operation of chunk c ended (results set)
  size_t ops_left_oldest();  // operations left in the oldest chunk with any in flight (>= 1)

 private:
  void validate_groups();
  void run();
  void task(size_t c, int delta);
  void check_done(size_t c);  // holds mu_; chunk c may have become final
  void wake_loop();           // a write to wake_fd_: ends the ring's wait for completions
  EngineBase& engine_;
  StreamSpec spec_;
  std::vector<int32_t> results_;
  std::vector<uint64_t> sums_;
  std::vector<std::pair<size_t, size_t>> chunk_groups_;  // groups [first, second) of chunk c
  std::vector<uint32_t> group_chunk_;
  std::unique_ptr<GroupChecksums> groups_;
  Batch batch_;
  int wake_fd_ = -1;
  uint64_t wake_buf_ = 0;  // lives as long as the stream: a read may still be armed on error
  std::mutex mu_;
  std::condition_variable cv_;
  size_t allowed_ = 0;
  bool cancelled_ = false;
  bool ended_ = false;
  std::exception_ptr error_;
  std::vector<int64_t> ops_left_;
  std::vector<int32_t> tasks_left_;
  std::vector<char> planned_, done_;
  std::vector<int64_t> done_ns_;
  size_t oldest_ = 0;
  std::mutex join_mu_;  // one joiner at a time (std::thread::join from two threads is undefined)
  std::thread thread_;
};

}  // namespace tutti::detail
