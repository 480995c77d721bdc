// TaskPool: workers that run queued tasks; the destructor drains the queue, then joins.
#include "tutti/detail/task_pool.hpp"

#include <algorithm>
#include <utility>

namespace tutti::detail {

TaskPool::TaskPool(unsigned threads) {
  for (unsigned i = 0; i < std::max(1u, threads); ++i) threads_.emplace_back([this] { loop(); });
}

TaskPool::~TaskPool() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void TaskPool::push(std::function<void()> task) {
  {
    std::lock_guard lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void TaskPool::loop() {
  for (;;) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
    if (tasks_.empty()) return;  // stop_ and drained
    auto task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    task();
  }
}

}  // namespace tutti::detail
