// io_uring engine: O_DIRECT files registered once, memory registered once
// (IORING_REGISTER_BUFFERS, sparse table updated in place), one ring per
// direction, many SQEs per io_uring_enter, short transfers and -EAGAIN
// re-queued here so callers only ever see whole requests.
#include "tutti/engine.hpp"
#include "tutti/error.hpp"

#ifdef TUTTI_HAVE_URING
#include <liburing.h>

#include <algorithm>
#include <deque>

namespace tutti {
namespace {

constexpr unsigned kMaxFiles = 4096;
constexpr unsigned kMaxBuffers = 16384;
constexpr uint64_t kMaxBufferBytes = 1ull << 30;  // kernel limit per registered buffer

class Ring {
 public:
  explicit Ring(unsigned depth) : depth_(depth) {
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
  }
  ~Ring() { io_uring_queue_exit(&ring_); }

  std::mutex mu;
  bool files_registered() const { return files_ok_; }

  void set_file(int index, int fd) {
    if (!files_ok_ || index >= static_cast<int>(kMaxFiles)) return;
    io_uring_register_files_update(&ring_, index, &fd, 1);
  }

  // Replace registered buffers [0, n) with iovs; false when the kernel refuses.
  bool set_buffers(const std::vector<iovec>& iovs, unsigned old_n) {
    if (!bufs_ok_) return false;
    std::vector<iovec> clear(old_n, iovec{nullptr, 0});
    std::vector<__u64> tags(std::max<size_t>(iovs.size(), old_n), 0);
    if (old_n) io_uring_register_buffers_update_tag(&ring_, 0, clear.data(), tags.data(), old_n);
    if (iovs.empty()) return true;
    int r = io_uring_register_buffers_update_tag(&ring_, 0, iovs.data(), tags.data(), iovs.size());
    return r >= 0;
  }

  void run(Op op, Plan& plan, const Batch& b, const FileTable& files, int32_t* results,
           Counters& c);

 private:
  void prep(io_uring_sqe* sqe, Op op, const Plan& plan, const IoOp& o, int fd, bool fixed_file);
  bool reap(Plan& plan, const Batch& b, std::deque<uint32_t>& requeue, int32_t* results,
            Counters& c, unsigned& inflight);

  io_uring ring_{};
  unsigned depth_;
  bool files_ok_ = false;
  bool bufs_ok_ = false;
};

void Ring::prep(io_uring_sqe* sqe, Op op, const Plan& plan, const IoOp& o, int fd,
                bool fixed_file) {
  const off_t off = o.offset + o.done;
  const iovec& v = plan.iovs[o.iov_begin];
  const bool single = o.iov_count == 1;
  if (single && o.buf_index >= 0) {
    if (op == Op::kRead)
      io_uring_prep_read_fixed(sqe, fd, v.iov_base, v.iov_len, off, o.buf_index);
    else
      io_uring_prep_write_fixed(sqe, fd, v.iov_base, v.iov_len, off, o.buf_index);
  } else if (single) {
    if (op == Op::kRead)
      io_uring_prep_read(sqe, fd, v.iov_base, v.iov_len, off);
    else
      io_uring_prep_write(sqe, fd, v.iov_base, v.iov_len, off);
  } else if (op == Op::kRead) {
    io_uring_prep_readv(sqe, fd, &plan.iovs[o.iov_begin], o.iov_count, off);
  } else {
    io_uring_prep_writev(sqe, fd, &plan.iovs[o.iov_begin], o.iov_count, off);
  }
  if (fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
}

// Drain available completions. Returns false if nothing was there.
bool Ring::reap(Plan& plan, const Batch& b, std::deque<uint32_t>& requeue, int32_t* results,
                Counters& c, unsigned& inflight) {
  io_uring_cqe* cqe;
  unsigned head, seen = 0;
  io_uring_for_each_cqe(&ring_, head, cqe) {
    seen++;
    inflight--;
    uint32_t idx = static_cast<uint32_t>(cqe->user_data);
    IoOp& o = plan.ops[idx];
    int res = cqe->res;
    if (res == -EAGAIN || res == -EINTR) {
      c.requeues++;
      requeue.push_back(idx);
    } else if (res < 0) {
      finish_op(plan, o, b, res, results, c);
    } else if (res == 0) {
      finish_op(plan, o, b, -ENODATA, results, c);  // unexpected end of file
    } else if (o.done + res < o.nbytes) {
      advance_op(plan, o, res);
      c.requeues++;
      requeue.push_back(idx);
    } else {
      finish_op(plan, o, b, 0, results, c);
    }
  }
  io_uring_cq_advance(&ring_, seen);
  return seen > 0;
}

void Ring::run(Op op, Plan& plan, const Batch& b, const FileTable& files, int32_t* results,
               Counters& c) {
  std::deque<uint32_t> requeue;
  size_t next = 0;
  unsigned inflight = 0;
  const unsigned low_water = depth_ / 8;
  while (next < plan.ops.size() || !requeue.empty() || inflight) {
    while (inflight < depth_ && (next < plan.ops.size() || !requeue.empty())) {
      uint32_t idx;
      if (!requeue.empty()) {
        idx = requeue.front();
        requeue.pop_front();
      } else {
        idx = static_cast<uint32_t>(next++);
      }
      IoOp& o = plan.ops[idx];
      int fd = files_ok_ ? static_cast<int>(o.file) : files.fd(static_cast<int>(o.file));
      if (!files_ok_ && fd < 0) {
        finish_op(plan, o, b, -EBADF, results, c);
        continue;
      }
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (!sqe) {  // SQ full: put it back and submit what we have
        requeue.push_front(idx);
        break;
      }
      prep(sqe, op, plan, o, fd, files_ok_);
      io_uring_sqe_set_data64(sqe, idx);
      inflight++;
      c.submissions++;
    }
    if (!inflight) continue;
    const bool more = next < plan.ops.size() || !requeue.empty();
    // Wait for all when nothing else is pending; otherwise refill at the low-water mark.
    unsigned want = more ? inflight - std::min(inflight, low_water) : inflight;
    int r = io_uring_submit_and_wait(&ring_, std::max(1u, want));
    c.enter_calls++;
    if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY)
      TUTTI_SYS_FAIL(-r, "io_uring_submit_and_wait", "");
    reap(plan, b, requeue, results, c, inflight);
  }
}

class UringEngine : public Engine {
 public:
  explicit UringEngine(const EngineOptions& opt) : opt_(opt) {
    for (auto& r : rings_) r = std::make_unique<Ring>(opt.queue_depth);
  }
  ~UringEngine() override { close(); }

  std::string name() const override { return "uring"; }

  int open_file(const std::string& path, bool writable, bool direct) override {
    auto life = live();
    int idx = files.open(path, writable, direct);
    if (static_cast<unsigned>(idx) >= kMaxFiles) {
      files.close(idx);
      TUTTI_SYS_FAIL(EMFILE, "uring engine: more than 4096 open files", path);
    }
    for (auto& r : rings_) {
      std::lock_guard lock(r->mu);
      r->set_file(idx, files.fd(idx));
    }
    return idx;
  }

  void close_file(int index) override {
    auto life = live();
    for (auto& r : rings_) {
      std::lock_guard lock(r->mu);
      r->set_file(index, -1);
    }
    files.close(index);
  }

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
              [](auto& a, auto& b) { return a.start < b.start; });
    bool ok = true;
    for (auto& r : rings_) {
      std::lock_guard lock(r->mu);
      ok = r->set_buffers(iovs, nbufs_) && ok;
    }
    std::lock_guard lock(map_mu_);
    if (!ok) {  // kernel refused (e.g. memlock limit): fall back to unregistered I/O
      for (auto& r : rings_) {
        std::lock_guard rl(r->mu);
        r->set_buffers({}, static_cast<unsigned>(iovs.size()));
      }
      buffers_ = BufferMap{};
      nbufs_ = 0;
      return 0;
    }
    buffers_ = std::move(map);
    nbufs_ = static_cast<unsigned>(iovs.size());
    return static_cast<int>(nbufs_);
  }

  void unregister_buffers() override {
    if (!closed_) register_buffers({});
  }

  void submit(Op op, const Batch& b, int32_t* results) override {
    auto life = live();
    c_add(b);
    Ring& ring = *rings_[static_cast<int>(op)];
    std::lock_guard lock(ring.mu);
    BufferMap buffers;
    {
      std::lock_guard ml(map_mu_);
      buffers = buffers_;
    }
    PlanPolicy pol;
    pol.vectored = opt_.vectored;
    pol.max_op_bytes = opt_.max_op_bytes;
    pol.buffers = buffers.regions.empty() ? nullptr : &buffers;
    Plan plan = build_plan(b, pol, files.size(), results);
    ring.run(op, plan, b, files, results, counters);
  }

  // Waits for running batches, then releases rings and files. Idempotent.
  void close() override {
    std::unique_lock life(life_mu_);  // waits for running batches
    if (closed_.exchange(true)) return;
    for (auto& r : rings_) r.reset();
    files.close_all();
  }

 private:
  // Shared hold on the engine's life: close() waits for every holder.
  std::shared_lock<std::shared_mutex> live() {
    std::shared_lock<std::shared_mutex> lock(life_mu_);
    TUTTI_EXPECT(!closed_, "engine is closed");
    return lock;
  }

  void c_add(const Batch& b) {
    counters.batches++;
    counters.requests += b.n;
  }

  EngineOptions opt_;
  std::shared_mutex life_mu_;
  std::atomic<bool> closed_{false};
  std::unique_ptr<Ring> rings_[2];
  std::mutex map_mu_;
  BufferMap buffers_;
  unsigned nbufs_ = 0;
};

}  // namespace

std::unique_ptr<Engine> make_uring_engine(const EngineOptions& opt) {
  return std::make_unique<UringEngine>(opt);
}
bool uring_compiled() { return true; }

}  // namespace tutti

#else  // !TUTTI_HAVE_URING

namespace tutti {
std::unique_ptr<Engine> make_uring_engine(const EngineOptions&) {
  TUTTI_SYS_FAIL(ENOSYS, "tutti was built without liburing", "");
}
bool uring_compiled() { return false; }
}  // namespace tutti

#endif
