// POSIX engine: the same batch contract on a worker pool doing preadv/pwritev,
// for hosts where io_uring is blocked (Docker's default seccomp profile) or absent.
#include <climits>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "tutti/detail/engine_base.hpp"
#include "tutti/detail/plan.hpp"
#include "tutti/error.hpp"

namespace tutti::detail {
namespace {

// A fixed set of workers that run fn(0..count-1) together with the caller.
class Pool {
 public:
  explicit Pool(unsigned n) {
    for (unsigned i = 0; i < n; ++i) threads_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  void run(const std::function<void(size_t)>& fn, size_t count) {
    std::unique_lock lock(mu_);
    fn_ = &fn;
    count_ = count;
    next_ = 0;
    busy_ = threads_.size();
    gen_++;
    lock.unlock();
    cv_.notify_all();
    drain();  // the caller works too
    lock.lock();
    done_cv_.wait(lock, [this] { return busy_ == 0; });
    fn_ = nullptr;
  }

 private:
  void drain() {
    for (size_t i; (i = next_.fetch_add(1)) < count_;) (*fn_)(i);
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || gen_ != seen; });
      if (stop_) return;
      seen = gen_;
      lock.unlock();
      drain();
      lock.lock();
      if (--busy_ == 0) done_cv_.notify_one();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(size_t)>* fn_ = nullptr;
  size_t count_ = 0;
  std::atomic<size_t> next_{0};
  size_t busy_ = 0;
  uint64_t gen_ = 0;
  bool stop_ = false;
};

// Run one op to completion; returns 0 or -errno.
int run_op(Op op, Plan& plan, IoOp& o, int fd, AtomicCounters& c) {
  if (fd < 0) return -EBADF;
  while (o.done < o.nbytes) {
    const iovec* iov = &plan.iovs[o.iov_begin];
    int cnt = static_cast<int>(std::min<uint32_t>(o.iov_count, IOV_MAX));
    ssize_t r = op == Op::kRead ? preadv(fd, iov, cnt, o.offset + o.done)
                                : pwritev(fd, iov, cnt, o.offset + o.done);
    c.enter_calls++;
    c.submissions++;
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) {
        c.requeues++;
        continue;
      }
      return -errno;
    }
    if (r == 0) return -ENODATA;  // unexpected end of file
    if (o.done + r < o.nbytes) c.requeues++;
    advance_op(plan, o, r);
  }
  return 0;
}

class PosixEngine final : public EngineBase {
 public:
  explicit PosixEngine(const EngineOptions& opt) : EngineBase(opt) {}
  ~PosixEngine() override { close(); }

  std::string name() const override { return "posix"; }

  int register_buffers(const std::vector<std::pair<uint64_t, uint64_t>>&) override { return 0; }

 private:
  void run_batch(Op op, const Batch& b, Completion* on_done, int32_t* results) override {
    PlanPolicy pol;
    pol.max_op_bytes = opt_.max_op_bytes;
    Plan plan = build_plan(b, pol, files_.size(), on_done, results);
    Dir& d = dirs_[static_cast<int>(op)];
    std::lock_guard lock(d.mu);
    if (!d.pool) d.pool = std::make_unique<Pool>(std::max(1u, opt_.threads) - 1);
    std::function<void(size_t)> fn = [&](size_t i) {
      IoOp& o = plan.ops[i];
      int err = run_op(op, plan, o, files_.fd(static_cast<int>(o.file)), stats_);
      finish_op(o, b, on_done, err, results, stats_);
    };
    d.pool->run(fn, plan.ops.size());
    if (on_done) on_done->flush();
  }

  void release() override {
    for (auto& d : dirs_) d.pool.reset();
  }

  struct Dir {
    std::mutex mu;
    std::unique_ptr<Pool> pool;
  };
  Dir dirs_[2];
};

}  // namespace

std::unique_ptr<Engine> make_posix_engine(const EngineOptions& opt) {
  return std::make_unique<PosixEngine>(opt);
}

}  // namespace tutti::detail
