// Batch planning shared by both engines: validation, coalescing into operations, the bookkeeping
// of short transfers, and the joined plan of a read stream's chunks.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tutti/detail/counters.hpp"
#include "tutti/engine.hpp"

namespace tutti::detail {

// Told once per request when its result is final (ok: it succeeded), from an engine thread.
// flush(): the engine is about to wait or return: whatever done() held back to batch must go now.
class Completion {
 public:
  virtual void done(size_t request, bool ok) = 0;
  virtual void flush() {}

 protected:
  ~Completion() = default;
};

// Forwards request i as base + i (a chunk of a stream to the stream's hook).
class ShiftedCompletion final : public Completion {
 public:
  ShiftedCompletion(Completion* inner, size_t base) : inner_(inner), base_(base) {}
  void done(size_t request, bool ok) override { inner_->done(base_ + request, ok); }
  void flush() override { inner_->flush(); }

 private:
  Completion* inner_;
  size_t base_;
};

// Registered memory regions (a single-iovec op inside one goes as READ_FIXED / WRITE_FIXED),
// sorted by address.
struct BufferMap {
  struct Region {
    uint64_t start;
    uint64_t end;
    int index;  // registered buffer index
  };
  std::vector<Region> regions;
  // Index of the registered buffer holding [addr, addr+len), or -1.
  int find(uint64_t addr, uint64_t len) const;
};

// One I/O operation: a file-contiguous run of requests [req_begin, req_end).
struct IoOp {
  int64_t file;
  int64_t offset;
  int64_t nbytes;
  int64_t done = 0;
  int64_t sent = 0;  // bytes of the submission in flight (the io_uring engine's byte cap)
  uint32_t iov_begin;
  uint32_t iov_count;
  uint32_t req_begin;
  uint32_t req_end;
  int buf_index = -1;  // registered buffer for a single-iovec op, or -1
};

struct Plan {
  std::vector<IoOp> ops;
  std::vector<iovec> iovs;
};

// Coalescing policy for build_plan: file-contiguous requests join one op (one READV / WRITEV,
// one iovec per memory-contiguous piece), up to max_iov iovecs and max_op_bytes.
struct PlanPolicy {
  size_t max_iov = 1024;  // IOV_MAX
  int64_t max_op_bytes = 1 << 30;
  const BufferMap* buffers = nullptr;  // registered buffers, for single-iovec ops
};

// Validate requests (bad ones get -EINVAL/-EBADF in results) and coalesce the rest. Refused and
// empty requests are final at once: on_done (optional) hears of them here.
Plan build_plan(const Batch& b, const PlanPolicy& policy, size_t nfiles, Completion* on_done,
                int32_t* results);
// Advance an op after a short transfer of `res` bytes (adjusts its iovecs).
void advance_op(Plan& plan, IoOp& op, int64_t res);
// Mark every request of op with its result (nbytes, or err when err != 0) and tell on_done.
void finish_op(const IoOp& op, const Batch& b, Completion* on_done, int err, int32_t* results,
               AtomicCounters& c);

// The chunks of a read stream planned one by one (an op never spans two chunks) and joined;
// request indices are the stream's.
struct StreamPlan {
  Plan plan;
  std::vector<uint32_t> op_chunk;   // op i belongs to chunk op_chunk[i]
  std::vector<size_t> chunk_end;    // ops of chunks <= c: [0, chunk_end[c])
  std::vector<size_t> chunk_ops;    // ops of chunk c
};
StreamPlan build_stream_plan(const Batch& all, const std::vector<int64_t>& chunk_start,
                             const PlanPolicy& policy, size_t nfiles, Completion* on_done,
                             int32_t* results);

}  // namespace tutti::detail
