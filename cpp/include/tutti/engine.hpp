// The batch I/O contract of the io_uring and POSIX engines (internals: tutti/detail/).
//
// A batch is n requests given as parallel arrays (file index, file offset, nbytes, address).
// Each request gets one int32 result: nbytes on success, -errno on failure, never partial: short
// transfers and -EAGAIN are re-queued inside. File-contiguous requests coalesce into one
// operation, which succeeds or fails as a whole. Files opened with O_DIRECT need offsets, sizes
// and addresses aligned to 4 KiB (else -EINVAL from the kernel).
// Errors: per-request failures are results; bad arguments and misuse throw tutti::Error
// (-> ValueError); a system call failing at setup throws tutti::SysError (-> OSError).
// Threads: every member may be called from any thread. Reads and writes have separate paths;
// the io_uring engine runs two read batches at once, the POSIX engine one per direction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace tutti {

enum class Op : int { kRead = 0, kWrite = 1 };

/// n requests; the arrays stay the caller's and must live until submit() returns. A request
/// outside these ranges ends with -EBADF (file) or -EINVAL, the rest of the batch runs.
/// Requests run concurrently: two reads into overlapping memory race (which bytes land there
/// is unspecified), as does a read into memory that another request writes from.
struct Batch {
  const int64_t* file = nullptr;    ///< index from Engine::open_file
  const int64_t* offset = nullptr;  ///< byte offset in the file, >= 0
  const int64_t* nbytes = nullptr;  ///< bytes to move, 0 to 1 GiB (0: result 0, nothing moved)
  const uint64_t* addr = nullptr;   ///< memory address, not 0
  size_t n = 0;
};

/// Checksum groups of a read: group g is requests [start[g], start[g+1]) (start has n+1 entries,
/// non-decreasing, within the batch). sums[g] = XXH3-64 over the group's bytes in request order,
/// computed as soon as its last request lands, or 0 when any of its requests failed.
struct Groups {
  const int64_t* start = nullptr;
  size_t n = 0;
  uint64_t* sums = nullptr;
};

/// Totals since the engine was made.
struct Counters {
  uint64_t batches = 0;      ///< submit() calls and read streams
  uint64_t requests = 0;     ///< requests in them
  uint64_t bytes = 0;        ///< bytes moved successfully
  uint64_t submissions = 0;  ///< SQEs prepared / preadv-pwritev calls
  uint64_t enter_calls = 0;  ///< io_uring_enter (or preadv/pwritev) system calls
  uint64_t requeues = 0;     ///< short transfers and -EAGAIN re-queued
  uint64_t errors = 0;       ///< requests whose I/O ended with -errno (not those refused at
                             ///< validation, -EBADF/-EINVAL, nor cancelled ones, -ECANCELED)
};

/// The arrays of a read stream, moved into it. chunk_start runs from 0 to n (n_chunks + 1
/// entries, non-decreasing); group_start is empty or as Groups::start, each group inside a chunk.
struct StreamSpec {
  std::vector<int64_t> file, offset, nbytes;
  std::vector<uint64_t> addr;
  std::vector<int64_t> chunk_start, group_start;
};

/// A chunk's final results and its groups' checksums; valid as long as the stream.
struct ChunkResults {
  const int32_t* results = nullptr;
  size_t n_requests = 0;
  const uint64_t* sums = nullptr;
  size_t n_groups = 0;
};

/// One read of many chunks (the layers of a restore) kept back to back at the device, run on a
/// thread of its own: chunk c's requests go out once allow(c + 1) admitted it, queued behind the
/// earlier chunks'. The destructor cancels and joins (errors dropped). It must not outlive
/// its engine.
class ReadStream {
 public:
  virtual ~ReadStream() = default;
  [[nodiscard]] virtual size_t nchunks() const noexcept = 0;
  /// Chunks [0, chunks) may be submitted; never shrinks (a smaller count is ignored).
  virtual void allow(size_t chunks) = 0;
  /// Blocks until chunk's results and checksums are final; rethrows the stream's error.
  [[nodiscard]] virtual ChunkResults wait(size_t chunk) = 0;
  /// Whether wait(chunk) would return without blocking (the chunk is final, or the stream ended).
  [[nodiscard]] virtual bool final(size_t chunk) = 0;
  /// Nothing new is submitted; requests not yet submitted end with -ECANCELED.
  virtual void cancel() noexcept = 0;
  /// Blocks until the stream's thread ended (nothing lands in memory after); rethrows its error.
  virtual void join() = 0;
  /// CLOCK_MONOTONIC nanoseconds at which each chunk became final (0: not yet), for tracing.
  [[nodiscard]] virtual std::vector<int64_t> done_ns() = 0;
};

struct EngineOptions {
  unsigned queue_depth = 1024;     ///< SQ entries per ring: operations in flight per batch
  unsigned threads = 8;            ///< POSIX workers per direction; checksum threads
  int64_t max_op_bytes = 1 << 30;  ///< largest coalesced operation, 4 KiB to 1 GiB
  /// io_uring: bytes in flight per ring, by direction (0: no cap, queue_depth ops only). A ring
  /// always keeps at least one operation in flight, whatever its size. The store derives them
  /// from the device queues (tutti_hicache/iodepth.py); the POSIX engine's bound is its threads.
  int64_t read_inflight_bytes = 0;
  int64_t write_inflight_bytes = 0;
};

class Engine {
 public:
  virtual ~Engine() = default;
  [[nodiscard]] virtual std::string name() const = 0;  ///< "uring" or "posix"
  /// Opens path (O_DIRECT when direct) for the engine's life; returns its index for batches.
  /// Throws SysError with the path when open(2) fails (EMFILE past 4096 files for io_uring).
  /// Offsets hold for regular files and block devices; on a pipe or FIFO io_uring ignores them
  /// and the POSIX engine's requests end with -ESPIPE (the tests use a FIFO to hold a request in
  /// flight; the store opens its own segment files only). Memory registered with
  /// register_buffers must stay mapped until it is registered again: io_uring keeps its pages.
  [[nodiscard]] virtual int open_file(const std::string& path, bool writable, bool direct) = 0;
  /// Registers [addr, addr + nbytes) regions for fixed I/O, replacing earlier ones (none:
  /// unregister). Returns how many buffers were registered, 0 when the kernel refused or the
  /// engine has no use for them (I/O then works unregistered).
  virtual int register_buffers(const std::vector<std::pair<uint64_t, uint64_t>>& regions) = 0;
  /// Runs one batch to completion; results has b.n entries. groups (reads only, or nullptr)
  /// checksums groups of requests while the rest of the batch is in flight.
  virtual void submit(Op op, const Batch& b, int32_t* results, const Groups* groups) = 0;
  /// Starts a read stream; nothing is submitted before its first allow().
  [[nodiscard]] virtual std::unique_ptr<ReadStream> read_stream(StreamSpec spec) = 0;
  [[nodiscard]] virtual Counters counters() const noexcept = 0;
  /// Waits for running batches, then releases rings, threads and files. Idempotent; anything
  /// but counters() afterwards throws Error("engine is closed").
  virtual void close() = 0;
};

/// kind "uring" (throws SysError when the kernel refuses io_uring, ENOSYS in a build without
/// it) or "posix". Throws Error for an unknown kind or options out of range.
[[nodiscard]] std::unique_ptr<Engine> make_engine(const std::string& kind,
                                                  const EngineOptions& opt);
[[nodiscard]] bool uring_compiled() noexcept;  ///< whether this build has the io_uring engine
/// The vendored liburing release compiled in ("2.3"), nullptr in a POSIX-only build.
[[nodiscard]] const char* uring_vendored_version() noexcept;

}  // namespace tutti
