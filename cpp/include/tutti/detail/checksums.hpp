// XXH3-64 over pieces of memory, and the checksums of request groups computed as reads complete.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "tutti/detail/plan.hpp"
#include "tutti/detail/task_pool.hpp"

namespace tutti::detail {

// XXH3-64 over the pieces [begin, end) in order: the AVX2 build when the CPU has it (same value).
uint64_t xxh3_pieces(const uint64_t* addr, const int64_t* len, int64_t begin, int64_t end);

// Throws Error unless start[0..ngroups] is increasing and within [0, nreq]: a verified read's
// group is never empty (its sum would be 0, "a request failed", where checksum_groups gives
// the hash of nothing).
void check_groups(const int64_t* start, size_t ngroups, size_t nreq);

// The completion hook of a verified read (overlapping verification with the I/O still in
// flight). Group g = requests [start[g], start[g+1]) of the arrays addr/nbytes; when its last
// request lands and all of them succeeded, out[g] = xxh3_pieces over them, computed on `pool`
// (or inline without one). Groups with a failed request get 0. Ready groups go to the pool in
// tasks of about kTaskBytes, the rest at flush(): one task (one wake of a pool thread) per
// 72 KiB object cost the completing thread more than the hashing did. wait() sends what is
// held back, then returns once every checksum started has finished; call it before the arrays
// go away.
class GroupChecksums final : public Completion {
 public:
  GroupChecksums(const uint64_t* addr, const int64_t* nbytes, const int64_t* start,
                 size_t ngroups, size_t nreq, uint64_t* out, TaskPool* pool);
  void done(size_t request, bool ok) override;
  void flush() override;
  void wait();
  static constexpr int64_t kTaskBytes = int64_t{1} << 20;
  // Optional: told (g, +1) once group g is whole and its checksum owed (from done(), before
  // the engine counts the group's last op finished; the checksum may wait in a batch until
  // flush()) and (g, -1) once it is computed (a read stream uses it to know when a chunk's
  // checksums are final).
  std::function<void(uint32_t, int)> on_task;

 private:
  void compute(uint32_t g);
  std::vector<uint32_t> take_ready();  // under mu_: ready_ emptied into a batch, pending_ counted
  void dispatch(std::vector<uint32_t> groups);  // one pool task for a batch take_ready() made
  const uint64_t* addr_;
  const int64_t* nbytes_;
  const int64_t* start_;
  uint64_t* out_;
  TaskPool* pool_;
  std::mutex mu_;
  std::condition_variable cv_;
  int pending_ = 0;
  std::vector<uint32_t> ready_;  // whole, unfailed groups not yet sent (under mu_)
  int64_t ready_bytes_ = 0;
  std::vector<uint32_t> group_of_;
  std::unique_ptr<std::atomic<int32_t>[]> remaining_;
  std::unique_ptr<std::atomic<bool>[]> failed_;
};

}  // namespace tutti::detail
