// The batch I/O contract shared by the io_uring and the POSIX engines.
//
// A batch is n requests given as parallel arrays: file index, file offset,
// nbytes, memory address. Each request gets one int32 result: nbytes on success,
// -errno on failure. A request is never reported partial: short transfers and
// -EAGAIN are re-queued inside the engine. Consecutive requests that are
// contiguous in the file are coalesced into one operation (one SQE, one
// preadv); an operation fails or succeeds as a whole.
//
// Thread safety: reads and writes go through separate submission paths, so a
// read batch and a write batch from two threads proceed concurrently. The
// io_uring engine has two read rings: two read batches from two threads are in
// flight at once (a pipelined reader submits the next batch while one drains);
// the POSIX engine serialises read batches (one worker pool per direction). Opening and closing
// files may happen while batches run.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <thread>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

namespace tutti {

enum class Op : int { kRead = 0, kWrite = 1 };

struct Counters {
  std::atomic<uint64_t> batches{0};      // submit() calls
  std::atomic<uint64_t> requests{0};     // requests in those batches
  std::atomic<uint64_t> bytes{0};        // bytes moved successfully
  std::atomic<uint64_t> submissions{0};  // SQEs prepared / preadv calls issued
  std::atomic<uint64_t> enter_calls{0};  // io_uring_enter (or preadv/pwritev) system calls
  std::atomic<uint64_t> requeues{0};     // short transfers and -EAGAIN re-queued
  std::atomic<uint64_t> errors{0};       // requests that ended with -errno
};

struct Batch;

// A fixed pool of worker threads running queued tasks (checksums of completed pages).
class TaskPool {
 public:
  explicit TaskPool(unsigned threads);
  ~TaskPool();
  void push(std::function<void()> task);

 private:
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  std::vector<std::thread> threads_;
  bool stop_ = false;
};

// Checksums of request groups computed as reads complete (overlapping verification with the
// I/O still in flight). Group g = requests [start[g], start[g+1]); when its last request lands
// and every one of them succeeded, out[g] = XXH3-64 over its pieces in request order, computed
// on `pool` (or inline without one). Groups with a failed request get 0. wait() returns once
// every checksum started has finished; call it before the batch's arrays go away.
class GroupChecksums {
 public:
  GroupChecksums(const int64_t* group_start, size_t ngroups, size_t nreq, uint64_t* out,
                 TaskPool* pool);
  void done(const Batch& b, size_t req, bool ok);
  void wait();
  // Optional: told (g, +1) when group g's checksum is queued on the pool and (g, -1) once it
  // is computed (a read stream uses it to know when a chunk's checksums are final).
  std::function<void(uint32_t, int)> on_task;

 private:
  void compute(const Batch& b, uint32_t g);
  TaskPool* pool_;
  std::mutex mu_;
  std::condition_variable cv_;
  int pending_ = 0;
  const int64_t* start_;
  uint64_t* out_;
  std::vector<uint32_t> group_of_;
  std::unique_ptr<std::atomic<int32_t>[]> remaining_;
  std::unique_ptr<std::atomic<bool>[]> failed_;
};

// A batch described by the caller; arrays are owned by the caller.
struct Batch {
  const int64_t* file = nullptr;
  const int64_t* offset = nullptr;
  const int64_t* nbytes = nullptr;
  const uint64_t* addr = nullptr;
  size_t n = 0;
  GroupChecksums* groups = nullptr;  // optional: checksum groups as they complete
};

// Registered memory regions (for READ_FIXED / WRITE_FIXED), sorted by address.
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

// One I/O operation: a file-contiguous run of requests.
struct IoOp {
  int64_t file;
  int64_t offset;
  int64_t nbytes;
  int64_t done = 0;
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

// Coalescing policy for build_plan.
struct PlanPolicy {
  bool vectored = true;        // merge file-contiguous requests into one op with several iovecs
  size_t max_iov = 1024;       // IOV_MAX
  int64_t max_op_bytes = 1 << 30;
  const BufferMap* buffers = nullptr;  // split fixed ops at registered-buffer boundaries
};

// Validate requests (bad ones get -EINVAL/-EBADF in results) and coalesce the rest.
Plan build_plan(const Batch& b, const PlanPolicy& policy, size_t nfiles, int32_t* results);
// Advance an op after a short transfer of `res` bytes (adjusts its iovecs).
void advance_op(Plan& plan, IoOp& op, int64_t res);
// Mark every request of op with result r (nbytes on success, -errno on failure).
void finish_op(const Plan& plan, const IoOp& op, const Batch& b, int err, int32_t* results,
               Counters& c);

// Open files shared by an engine's submission paths.
class FileTable {
 public:
  ~FileTable();
  int open(const std::string& path, bool writable, bool direct);  // -> file index
  void close(int index);
  int fd(int index) const;  // -1 when closed
  size_t size() const;
  std::string path(int index) const;
  void close_all();

 private:
  mutable std::shared_mutex mu_;
  std::vector<int> fds_;
  std::vector<std::string> paths_;
};

class ReadStream;

class Engine {
 public:
  virtual ~Engine() = default;
  virtual std::string name() const = 0;
  // Open a file (O_DIRECT when direct) and return its index for batches.
  virtual int open_file(const std::string& path, bool writable, bool direct);
  // Register [addr, addr+len) regions for fixed I/O, replacing those registered before (none
  // unregisters them); returns how many were registered (0 when the engine does not use
  // registered buffers).
  virtual int register_buffers(const std::vector<std::pair<uint64_t, uint64_t>>& regions) = 0;
  // Run one batch to completion. results has b.n entries.
  virtual void submit(Op op, const Batch& b, int32_t* results) = 0;
  virtual void close() = 0;
  // Worker threads for per-page checksums during reads (created on first use).
  TaskPool* task_pool();
  // Run a read stream to its end (called on the stream's own thread). This default submits
  // one chunk after another; the io_uring engine keeps the next chunks' operations queued
  // behind the current one's.
  virtual void run_stream(ReadStream& s);

  Counters counters;
  FileTable files;
  unsigned task_threads = 8;

 private:
  std::mutex task_mu_;
  std::unique_ptr<TaskPool> tasks_;
};

// One read of many chunks (e.g. the layers of one restore) kept back to back at the device: the
// requests of chunk c are submitted once allow(c + 1) was called, in order, so the next chunk's
// operations wait in the queue while the current chunk's drain, and a newly allowed chunk wakes
// the submitter at once. wait(c) returns once every request of chunk c has its result and the
// checksums of its groups are computed. The arrays are copied in; a thread runs the stream.
// Groups (optional, as in read_verify) must each lie inside one chunk.
class ReadStream {
 public:
  ReadStream(Engine& engine, std::vector<int64_t> file, std::vector<int64_t> offset,
             std::vector<int64_t> nbytes, std::vector<uint64_t> addr,
             std::vector<int64_t> chunk_start, std::vector<int64_t> group_start);
  ~ReadStream();  // cancel() and join(), errors dropped
  ReadStream(const ReadStream&) = delete;
  ReadStream& operator=(const ReadStream&) = delete;

  void allow(size_t chunks);  // chunks [0, chunks) may be submitted (never shrinks)
  void wait(size_t chunk);    // until chunk is final; rethrows the stream's error
  void cancel();              // nothing new is submitted; unsubmitted requests get -ECANCELED
  void join();                // until the stream's thread ended; rethrows its error

  size_t nchunks() const { return chunk_start_.size() - 1; }
  int64_t chunk_begin(size_t c) const { return chunk_start_[c]; }
  int64_t chunk_end(size_t c) const { return chunk_start_[c + 1]; }
  std::pair<size_t, size_t> chunk_groups(size_t c) const { return chunk_groups_[c]; }
  const int32_t* results() const { return results_.data(); }
  const uint64_t* sums() const { return sums_.data(); }
  const int64_t* group_starts() const { return group_start_.data(); }

  // ---- for the engines' run loops
  const Batch& batch() const { return batch_; }
  int32_t* results_data() { return results_.data(); }
  uint64_t* sums_data() { return sums_.data(); }
  int wake_fd() const { return wake_fd_; }
  uint64_t* wake_buf() { return &wake_buf_; }  // target of the ring's read on wake_fd
  size_t allowed();        // chunks allowed so far
  bool cancelled();
  size_t wait_allowed(size_t have);  // until more than `have` are allowed or cancelled
  void planned(size_t c, size_t ops);  // chunk c will finish after `ops` operations
  void op_finished(size_t c);          // one operation of chunk c ended (results set)
  size_t ops_left_oldest();  // operations left in the oldest chunk with any in flight (>= 1)

 private:
  void run();
  void task(size_t c, int delta);
  void check_done(size_t c);  // holds mu_
  Engine& engine_;
  std::vector<int64_t> file_, offset_, nbytes_;
  std::vector<uint64_t> addr_;
  std::vector<int64_t> chunk_start_, group_start_;
  std::vector<int32_t> results_;
  std::vector<uint64_t> sums_;
  std::vector<std::pair<size_t, size_t>> chunk_groups_;
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
  size_t oldest_ = 0;
  std::thread thread_;
};

struct EngineOptions {
  unsigned queue_depth = 1024;  // SQ entries per ring / in-flight ops per batch
  bool vectored = true;         // coalesce file-contiguous requests into READV/WRITEV
  bool register_files = true;
  unsigned threads = 8;         // posix engine: workers per direction
  int64_t max_op_bytes = 1 << 30;  // largest coalesced operation (bytes)
};

std::unique_ptr<Engine> make_uring_engine(const EngineOptions& opt);  // throws SysError
std::unique_ptr<Engine> make_posix_engine(const EngineOptions& opt);
bool uring_compiled();
const char* uring_vendored_version();  // liburing release built in, or nullptr without io_uring

}  // namespace tutti
