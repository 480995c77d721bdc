// io_uring engine: O_DIRECT files registered once, memory registered once
// (IORING_REGISTER_BUFFERS, sparse table updated in place), kWriteRings write rings and
// kReadRings read rings (so a reader, or a writer, can put its next batch in flight while
// another one's batch drains), many SQEs per io_uring_enter, short transfers
// and -EAGAIN re-queued here so callers only ever see whole requests.
#include "tutti/detail/engine_base.hpp"
#include "tutti/error.hpp"

#ifdef TUTTI_HAVE_URING
#include <liburing.h>
#ifndef TUTTI_LIBURING_VENDORED_VERSION  // defined by the compat.h that CMake generates
#error "not the vendored liburing.h (cpp/third_party/liburing): check the include path"
#endif

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>

#include "tutti/detail/kernel_access.hpp"
#include "tutti/detail/plan.hpp"
#include "tutti/detail/stream.hpp"

namespace tutti::detail {
namespace {

constexpr unsigned kMaxFiles = 4096;
constexpr unsigned kMaxBuffers = 16384;
constexpr uint64_t kMaxBufferBytes = 1ull << 30;  // kernel limit per registered buffer
constexpr unsigned kReadRings = 2;  // read batches that may be in flight at once
// Write batches that may be in flight at once: two writers (the linker's chunk writers) overlap
// one's drain with the other's submissions instead of queueing on one ring for whole batches.
// How many bytes they put on a device together is the store's write scheduler's to bound.
constexpr unsigned kWriteRings = 2;

// One line on stderr the first time a kind of registration update fails in this process:
// what failed, the errno, and what follows from it.
void log_once(std::atomic<bool>& logged, const std::string& what, int err, const std::string& then) {
  if (logged.exchange(true)) return;
  std::fprintf(stderr, "tutti: %s failed: %s (errno %d); %s\n", what.c_str(), std::strerror(err),
               err, then.c_str());
}
std::atomic<bool> files_update_logged{false};
std::atomic<bool> buffers_update_logged{false};

// errno of a registration update that returned r for `want` entries (0 when all were updated).
int update_errno(int r, unsigned want) {
  if (r == static_cast<int>(want)) return 0;
  return r < 0 ? -r : EIO;  // a partial update: the kernel stopped at an entry it refused
}

class Ring {
 public:
  Ring(unsigned depth, int64_t max_bytes) : depth_(depth), max_bytes_(max_bytes) {
    io_uring_params p{};
    p.flags = IORING_SETUP_COOP_TASKRUN;
    int r = io_uring_queue_init_params(depth, &ring_, &p);
    if (r == -EINVAL) {  // kernel older than 5.19: no COOP_TASKRUN
      p = io_uring_params{};
      r = io_uring_queue_init_params(depth, &ring_, &p);
    }
    if (r < 0) TUTTI_SYS_FAIL(-r, "io_uring_queue_init", "");
    files_ok_ = io_uring_register_files_sparse(&ring_, kMaxFiles) == 0;
    bufs_ok_ = io_uring_register_buffers_sparse(&ring_, kMaxBuffers) == 0;
    if (files_ok_) file_err_ = std::make_unique<std::atomic<int>[]>(kMaxFiles);  // all 0
  }
  ~Ring() { io_uring_queue_exit(&ring_); }

  std::mutex mu;
  // The registered buffers as the plans of this ring's batches see them: replaced together with
  // the ring's buffer table, under mu, so a plan never names a buffer index the table lacks.
  BufferMap buffers;
  bool files_registered() const { return files_ok_; }

  // Point registered file `index` at fd. When the kernel refuses, operations on that file end
  // with its -errno (instead of reaching an empty or stale slot), and stderr says so once.
  // Needs no lock of the ring: the update is one io_uring_register call, which the kernel
  // serializes with this ring's submissions (no quiesce for a files update since Linux 5.13),
  // and file_err_'s entries are atomic. So opening a file never waits for a batch or a read
  // stream that holds the ring (a stream holds its ring for a whole layer-wise load).
  void set_file(int index, int fd) {
    if (!files_ok_ || index >= static_cast<int>(kMaxFiles)) return;
    const int err = update_errno(io_uring_register_files_update(&ring_, index, &fd, 1), 1);
    file_err_[index].store(-err, std::memory_order_release);
    if (err)
      log_once(files_update_logged,
               "io_uring_register_files_update of file " + std::to_string(index), err,
               "its requests fail with -" + std::to_string(err));
  }

  // Replace registered buffers [0, n) with iovs, clearing the old_n first; false when the kernel
  // refuses any of it (then the engine uses no registered buffers), and stderr says so once.
  bool set_buffers(const std::vector<iovec>& iovs, unsigned old_n) {
    if (!bufs_ok_) return false;
    std::vector<iovec> clear(old_n, iovec{nullptr, 0});
    std::vector<__u64> tags(std::max<size_t>(iovs.size(), old_n), 0);
    const unsigned n = static_cast<unsigned>(iovs.size());
    int err = 0;
    if (old_n)
      err = update_errno(
          io_uring_register_buffers_update_tag(&ring_, 0, clear.data(), tags.data(), old_n), old_n);
    if (!err && n)
      err = update_errno(
          io_uring_register_buffers_update_tag(&ring_, 0, iovs.data(), tags.data(), n), n);
    if (err)
      log_once(buffers_update_logged, "io_uring_register_buffers_update", err,
               "I/O goes on without registered buffers");
    return err == 0;
  }

  void run(Op op, Plan& plan, const Batch& b, Completion* on_done, const FileTable& files,
           int32_t* results, AtomicCounters& c);
  // The ops of a read stream, chunk after chunk, each chunk's ops submitted once the stream
  // allows the chunk.
  void run_stream(StreamPlan& sp, Stream& s, const FileTable& files, AtomicCounters& c);

 private:
  static constexpr uint64_t kWake = UINT64_MAX;  // user_data of a read on a stream's eventfd
  static constexpr uint64_t kDead = UINT64_MAX - 1;  // a NOP left in the SQ by abandon()
  struct Flight {  // ops to (re)submit and in flight
    std::deque<uint32_t> requeue;
    size_t next = 0;
    unsigned inflight = 0;
    int64_t inflight_bytes = 0;
    bool wake_armed = false;
  };
  void prep(io_uring_sqe* sqe, Op op, const Plan& plan, const IoOp& o, int fd, bool fixed_file);
  // 0 when an operation on `file` (its fd, when files are not registered) may go out, else -errno.
  int file_error(int64_t file, int fd) const {
    if (!files_ok_) return fd < 0 ? -EBADF : 0;
    return file < static_cast<int64_t>(kMaxFiles) ? file_err_[file].load(std::memory_order_acquire)
                                                  : -EBADF;
  }
  // Queue requeued ops, then new ones below `limit`, while the ring has room; end(idx, err)
  // finishes an op that cannot be submitted.
  template <class End>
  void fill(Op op, Plan& plan, Flight& f, size_t limit, const FileTable& files,
            AtomicCounters& c, End&& end);
  // 0, or the -errno of an io_uring_enter the kernel refused (not EINTR, EAGAIN or EBUSY)
  int enter(unsigned want, AtomicCounters& c);
  // Drain available completions: whole ops end(idx, 0 | -errno), partial ones are requeued.
  template <class End>
  void reap(Op op, Plan& plan, Flight& f, AtomicCounters& c, End&& end);
  // After enter failed with err: no op of the batch may stay with the kernel once its run
  // returns (the next batch on this ring would reap its completion as one of its own, and its
  // bytes would land in memory the caller has moved on from). Ops still in the submission
  // queue become NOPs and end with err, requeued ops and ops never queued too, and the ring
  // waits (submitting nothing) until every op the kernel took has completed; a read armed on a
  // stream's eventfd is completed by writing to wake_fd. Every op of the plan has then ended.
  template <class End>
  void abandon(Op op, Plan& plan, Flight& f, int err, int wake_fd, AtomicCounters& c, End&& end);

  io_uring ring_{};
  unsigned depth_;
  int64_t max_bytes_;  // bytes in flight (0: no cap); one op always goes
  bool files_ok_ = false;
  bool bufs_ok_ = false;
  // per registered file: 0, or -errno of its failed update (set by whichever thread opened it)
  std::unique_ptr<std::atomic<int>[]> file_err_;
  uint64_t* wake_target_ = nullptr;  // where the armed read on a stream's eventfd lands
};

void Ring::prep(io_uring_sqe* sqe, Op op, const Plan& plan, const IoOp& o, int fd,
                bool fixed_file) {
  const off_t off = o.offset + o.done;
  const iovec& v = plan.iovs[o.iov_begin];
  const unsigned len = static_cast<unsigned>(v.iov_len);  // an op is at most 1 GiB
  const bool single = o.iov_count == 1;
  if (single && o.buf_index >= 0) {
    if (op == Op::kRead)
      io_uring_prep_read_fixed(sqe, fd, v.iov_base, len, off, o.buf_index);
    else
      io_uring_prep_write_fixed(sqe, fd, v.iov_base, len, off, o.buf_index);
  } else if (single) {
    if (op == Op::kRead)
      io_uring_prep_read(sqe, fd, v.iov_base, len, off);
    else
      io_uring_prep_write(sqe, fd, v.iov_base, len, off);
  } else if (op == Op::kRead) {
    io_uring_prep_readv(sqe, fd, &plan.iovs[o.iov_begin], o.iov_count, off);
  } else {
    io_uring_prep_writev(sqe, fd, &plan.iovs[o.iov_begin], o.iov_count, off);
  }
  if (fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
  kernel_moves(&v, o.iov_count, o.nbytes - o.done, op == Op::kRead);
}

template <class End>
void Ring::fill(Op op, Plan& plan, Flight& f, size_t limit, const FileTable& files,
                AtomicCounters& c, End&& end) {
  while (f.inflight < depth_ && (f.next < limit || !f.requeue.empty()) &&
         (max_bytes_ == 0 || f.inflight == 0 || f.inflight_bytes < max_bytes_)) {
    uint32_t idx;
    if (!f.requeue.empty()) {
      idx = f.requeue.front();
      f.requeue.pop_front();
    } else {
      idx = static_cast<uint32_t>(f.next++);
    }
    IoOp& o = plan.ops[idx];
    int fd = files_ok_ ? static_cast<int>(o.file) : files.fd(static_cast<int>(o.file));
    if (const int err = file_error(o.file, fd)) {
      end(idx, err);
      continue;
    }
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (!sqe) {  // SQ full: put it back and submit what we have
      f.requeue.push_front(idx);
      break;
    }
    prep(sqe, op, plan, o, fd, files_ok_);
    io_uring_sqe_set_data64(sqe, idx);
    o.sent = o.nbytes - o.done;
    f.inflight++;
    f.inflight_bytes += o.sent;
    c.submissions++;
  }
}

int Ring::enter(unsigned want, AtomicCounters& c) {
  int r = io_uring_submit_and_wait(&ring_, std::max(1u, want));
  c.enter_calls++;
  return r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY ? r : 0;
}

std::atomic<bool> enter_failed_logged{false};

template <class End>
void Ring::abandon(Op op, Plan& plan, Flight& f, int err, int wake_fd, AtomicCounters& c,
                   End&& end) {
  log_once(enter_failed_logged, "io_uring_submit_and_wait", -err,
           "the batch's requests not yet done fail with it once those in flight have landed");
  // The queue from the kernel's head to our tail holds what the failed call did not submit:
  // NOPs now, ended here, so a later submission on this ring moves no bytes for them.
  const unsigned head = io_uring_smp_load_acquire(ring_.sq.khead);
  for (unsigned k = head; k != ring_.sq.sqe_tail; ++k) {
    io_uring_sqe* sqe = &ring_.sq.sqes[k & ring_.sq.ring_mask];
    const uint64_t data = sqe->user_data;
    io_uring_prep_nop(sqe);
    io_uring_sqe_set_data64(sqe, kDead);
    if (data == kWake) {
      wake_target_ = nullptr;
      f.wake_armed = false;
    } else if (data < plan.ops.size()) {
      f.inflight--;
      f.inflight_bytes -= plan.ops[data].sent;
      end(static_cast<uint32_t>(data), err);
    }
  }
  auto end_requeued = [&] {
    for (uint32_t idx : f.requeue) end(idx, err);
    f.requeue.clear();
  };
  end_requeued();
  for (bool poked = false; f.inflight || f.wake_armed;) {
    if (f.wake_armed && !poked && wake_fd >= 0) {
      uint64_t one = 1;
      if (::write(wake_fd, &one, sizeof one) < 0) { /* counter full: the read completes */ }
      poked = true;
    }
    io_uring_cqe* cqe = nullptr;
    const int r = io_uring_wait_cqe(&ring_, &cqe);  // submits nothing
    c.enter_calls++;
    if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY) {
      // the kernel still holds ops whose bytes may land: never return before they have
      ::usleep(1000);
      continue;
    }
    reap(op, plan, f, c, end);
    end_requeued();  // a partial transfer is not resubmitted
  }
  while (f.next < plan.ops.size()) end(static_cast<uint32_t>(f.next++), err);
}

template <class End>
void Ring::reap(Op op, Plan& plan, Flight& f, AtomicCounters& c, End&& end) {
  io_uring_cqe* cqe;
  unsigned head, seen = 0;
  io_uring_for_each_cqe(&ring_, head, cqe) {
    seen++;
    if (cqe->user_data == kWake) {
      if (cqe->res > 0) kernel_access(wake_target_, sizeof(uint64_t), true);
      wake_target_ = nullptr;
      f.wake_armed = false;
      continue;
    }
    if (cqe->user_data >= plan.ops.size()) continue;  // kDead: a NOP of an abandoned batch
    f.inflight--;
    uint32_t idx = static_cast<uint32_t>(cqe->user_data);
    IoOp& o = plan.ops[idx];
    f.inflight_bytes -= o.sent;
    int res = cqe->res;
    if (res > 0) kernel_moves(&plan.iovs[o.iov_begin], o.iov_count, res, op == Op::kRead);
    if (res == -EAGAIN || res == -EINTR) {
      c.requeues++;
      f.requeue.push_back(idx);
    } else if (res < 0) {
      end(idx, res);
    } else if (res == 0) {
      end(idx, -ENODATA);  // unexpected end of file
    } else if (o.done + res < o.nbytes) {
      advance_op(plan, o, res);
      c.requeues++;
      f.requeue.push_back(idx);
    } else {
      end(idx, 0);
    }
  }
  io_uring_cq_advance(&ring_, seen);
}

void Ring::run(Op op, Plan& plan, const Batch& b, Completion* on_done, const FileTable& files,
               int32_t* results, AtomicCounters& c) {
  Flight f;
  auto end = [&](uint32_t idx, int err) { finish_op(plan.ops[idx], b, on_done, err, results, c); };
  const size_t nops = plan.ops.size();
  const unsigned low_water = depth_ / 8;
  while (f.next < nops || !f.requeue.empty() || f.inflight) {
    fill(op, plan, f, nops, files, c, end);
    if (!f.inflight) continue;
    const bool more = f.next < nops || !f.requeue.empty();
    // Wait for all when nothing else is pending; otherwise refill at the low-water mark.
    if (const int err = enter(more ? f.inflight - std::min(f.inflight, low_water) : f.inflight, c)) {
      abandon(op, plan, f, err, -1, c, end);
      break;
    }
    reap(op, plan, f, c, end);
    if (on_done) on_done->flush();  // what the pass completed goes to the checksum threads
  }
  if (on_done) on_done->flush();  // requests that ended without I/O
}

void Ring::run_stream(StreamPlan& sp, Stream& s, const FileTable& files, AtomicCounters& c) {
  Plan& plan = sp.plan;
  const std::vector<size_t>& chunk_end = sp.chunk_end;
  const Batch& b = s.batch();
  int32_t* results = s.results_data();
  Completion* on_done = s.on_done();
  auto end = [&](uint32_t idx, int err) {
    finish_op(plan.ops[idx], b, on_done, err, results, c);
    s.op_finished(sp.op_chunk[idx]);
  };
  Flight f;
  const unsigned high_water = depth_ - std::max(1u, depth_ / 4);  // the queue never runs low
  const size_t nops = plan.ops.size();
  for (;;) {
    const size_t allowed = s.allowed();
    const bool cancelled = s.cancelled();
    const size_t limit =
        cancelled || allowed == 0 ? f.next : std::max(f.next, chunk_end[allowed - 1]);
    if (!f.inflight && f.requeue.empty()) {
      if (f.next >= nops || cancelled) break;
      if (f.next >= limit) {  // nothing allowed: sleep until allow() or cancel()
        if (on_done) on_done->flush();
        s.wait_allowed(allowed);
        continue;
      }
    }
    fill(Op::kRead, plan, f, limit, files, c, end);
    if (!f.inflight) continue;
    const bool more = f.next < limit || !f.requeue.empty();
    if (!more && !cancelled && f.next < nops && !f.wake_armed) {
      // the next chunk may be allowed any moment (allow() from the stream's owner): a read on
      // the eventfd ends the wait then
      if (io_uring_sqe* sqe = io_uring_get_sqe(&ring_)) {
        wake_target_ = s.wake_buf();
        kernel_access(wake_target_, sizeof(uint64_t), true);
        io_uring_prep_read(sqe, s.wake_fd(), wake_target_, sizeof(uint64_t), 0);
        io_uring_sqe_set_data64(sqe, kWake);
        f.wake_armed = true;
      }
    }
    if (on_done) on_done->flush();  // nothing whole waits behind the ring (plan-time groups too)
    // Top up once a quarter of the ring is free; otherwise wait until the oldest chunk's
    // operations are done, or, while the read on the eventfd is armed, for any completion: the
    // wake is one completion, and a wait for more would keep an allowed chunk from the devices
    // until the oldest chunk's operations had landed.
    const int err = enter(
        more ? f.inflight - std::min(f.inflight, high_water)
        : f.wake_armed ? 1u
                       : static_cast<unsigned>(std::min<size_t>(f.inflight, s.ops_left_oldest())),
        c);
    if (err) {  // every op of every chunk ends: the stream's owner sees them fail
      abandon(Op::kRead, plan, f, err, s.wake_fd(), c, end);
      break;
    }
    reap(Op::kRead, plan, f, c, end);
  }
  if (on_done) on_done->flush();  // a chunk is final only once its checksums are
  if (f.wake_armed) {  // complete our own read on the eventfd before the ring serves others
    uint64_t one = 1;
    if (::write(s.wake_fd(), &one, sizeof one) < 0) { /* counter full: the read completes */ }
    while (f.wake_armed) {
      if (const int err = enter(1, c)) abandon(Op::kRead, plan, f, err, s.wake_fd(), c, end);
      reap(Op::kRead, plan, f, c, end);
    }
  }
}

class UringEngine final : public EngineBase {
 public:
  explicit UringEngine(const EngineOptions& opt) : EngineBase(opt) {
    for (unsigned i = 0; i < kWriteRings; i++)
      rings_[i] = std::make_unique<Ring>(opt.queue_depth, opt.write_inflight_bytes);
    for (unsigned i = kWriteRings; i < kWriteRings + kReadRings; i++)
      rings_[i] = std::make_unique<Ring>(opt.queue_depth, opt.read_inflight_bytes);
  }
  ~UringEngine() override { close(); }

  std::string name() const override { return "uring"; }

  int register_buffers(const std::vector<std::pair<uint64_t, uint64_t>>& regions) override {
    auto life = live();
    std::vector<iovec> iovs;
    BufferMap map;
    for (auto [addr, len] : regions) {
      for (uint64_t off = 0; off < len; off += kMaxBufferBytes) {
        uint64_t n = std::min(kMaxBufferBytes, len - off);
        map.regions.push_back({addr + off, addr + off + n, static_cast<int>(iovs.size())});
        iovs.push_back({reinterpret_cast<void*>(addr + off), static_cast<size_t>(n)});
      }
    }
    TUTTI_EXPECT(iovs.size() <= kMaxBuffers, "register_buffers: too many regions");
    std::sort(map.regions.begin(), map.regions.end(),
              [](auto& x, auto& y) { return x.start < y.start; });
    // One registration at a time. reg_mu_ is never taken under a ring's lock, and each ring's
    // table and map change together under that ring's lock: batches keep running on the other
    // rings meanwhile, each with a map that matches its own ring's table.
    std::lock_guard reg(reg_mu_);
    bool ok = true;
    for (auto& r : rings_) {
      std::lock_guard lock(r->mu);
      const bool set = r->set_buffers(iovs, nbufs_);
      r->buffers = set ? map : BufferMap{};  // a refused update: this ring's table is unknown
      ok = set && ok;
    }
    if (!ok) {  // kernel refused (e.g. memlock limit): fall back to unregistered I/O
      for (auto& r : rings_) {
        std::lock_guard lock(r->mu);
        r->buffers = BufferMap{};
        r->set_buffers({}, std::max(nbufs_, static_cast<unsigned>(iovs.size())));
      }
      nbufs_ = 0;
      return 0;
    }
    nbufs_ = static_cast<unsigned>(iovs.size());
    return static_cast<int>(nbufs_);
  }

  void run_stream(Stream& s) override {
    // A ring is the stream's from its first allowed chunk on, not while it waits for one: an
    // idle stream would hold a read ring other batches and streams wait for
    if (s.wait_allowed(0) == 0) return;  // cancelled first
    auto life = live();
    Ring& ring = read_ring();
    std::lock_guard lock(ring.mu, std::adopt_lock);  // the stream's for the rest of its life
    StreamPlan sp = build_stream_plan(s.batch(), s.chunk_starts(), policy(ring), files_.size(),
                                      s.on_done(), s.results_data());
    for (size_t c = 0; c < s.nchunks(); ++c) s.planned(c, sp.chunk_ops[c]);
    ring.run_stream(sp, s, files_, stats_);
  }

 private:
  void file_opened(int index, const std::string& path) override {
    if (static_cast<unsigned>(index) >= kMaxFiles)
      TUTTI_SYS_FAIL(EMFILE, "uring engine: more than 4096 open files", path);
    for (auto& r : rings_) r->set_file(index, files_.fd(index));  // no ring lock (set_file)
  }

  void run_batch(Op op, const Batch& b, Completion* on_done, int32_t* results) override {
    Ring& ring = op == Op::kWrite ? write_ring() : read_ring();
    std::lock_guard lock(ring.mu, std::adopt_lock);  // locked by the picker
    Plan plan = build_plan(b, policy(ring), files_.size(), on_done, results);
    ring.run(op, plan, b, on_done, files_, results, stats_);
  }

  void release() override {
    for (auto& r : rings_) r.reset();
  }

  // The coalescing policy over the registered buffers of `ring` (whose lock the caller holds).
  PlanPolicy policy(const Ring& ring) {
    PlanPolicy pol;
    pol.max_op_bytes = opt_.max_op_bytes;
    pol.buffers = ring.buffers.regions.empty() ? nullptr : &ring.buffers;
    return pol;
  }

  Ring& write_ring() { return pick(0, kWriteRings, next_write_); }
  Ring& read_ring() { return pick(kWriteRings, kReadRings, next_read_); }

  // A locked ring of rings_[first, first + n): the first free one, else wait for the next in turn.
  Ring& pick(unsigned first, unsigned n, std::atomic<unsigned>& next) {
    for (unsigned i = first; i < first + n; i++)
      if (rings_[i]->mu.try_lock()) return *rings_[i];
    Ring& r = *rings_[first + next++ % n];
    r.mu.lock();
    return r;
  }

  std::unique_ptr<Ring> rings_[kWriteRings + kReadRings];  // writes first, then reads
  std::atomic<unsigned> next_write_{0}, next_read_{0};
  std::mutex reg_mu_;  // register_buffers; taken before any ring's lock, never under one
  unsigned nbufs_ = 0;  // under reg_mu_
};

}  // namespace

std::unique_ptr<Engine> make_uring_engine(const EngineOptions& opt) {
  return std::make_unique<UringEngine>(opt);
}

}  // namespace tutti::detail

namespace tutti {
bool uring_compiled() noexcept { return true; }
const char* uring_vendored_version() noexcept { return TUTTI_LIBURING_VENDORED_VERSION; }
}  // namespace tutti

#else  // !TUTTI_HAVE_URING

namespace tutti {
namespace detail {
std::unique_ptr<Engine> make_uring_engine(const EngineOptions&) {
  TUTTI_SYS_FAIL(ENOSYS, "tutti was built without io_uring (TUTTI_ALLOW_POSIX_ONLY)", "");
}
}  // namespace detail
bool uring_compiled() noexcept { return false; }
const char* uring_vendored_version() noexcept { return nullptr; }
}  // namespace tutti

#endif
