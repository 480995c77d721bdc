// Batch planning (validation + coalescing) and the file table, shared by both engines.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <climits>

#include "tutti/engine.hpp"
#include "tutti/error.hpp"

namespace tutti {

int BufferMap::find(uint64_t addr, uint64_t len) const {
  auto it = std::upper_bound(regions.begin(), regions.end(), addr,
                             [](uint64_t a, const Region& r) { return a < r.start; });
  if (it == regions.begin()) return -1;
  --it;
  return (addr >= it->start && addr + len <= it->end) ? it->index : -1;
}

namespace {

int validate(const Batch& b, size_t i, size_t nfiles, int64_t max_bytes) {
  if (b.file[i] < 0 || static_cast<size_t>(b.file[i]) >= nfiles) return -EBADF;
  if (b.offset[i] < 0 || b.nbytes[i] < 0 || b.nbytes[i] > max_bytes || b.addr[i] == 0)
    return -EINVAL;
  return 0;
}

bool file_contiguous(const Batch& b, size_t prev, size_t i) {
  return b.file[i] == b.file[prev] && b.offset[i] == b.offset[prev] + b.nbytes[prev];
}

bool mem_contiguous(const Batch& b, size_t prev, size_t i) {
  return b.addr[i] == b.addr[prev] + static_cast<uint64_t>(b.nbytes[prev]);
}

// May request i join the op that currently ends with request prev?
bool can_join(const Plan& p, const IoOp& op, const Batch& b, size_t prev, size_t i,
              const PlanPolicy& pol) {
  if (!file_contiguous(b, prev, i)) return false;
  if (op.nbytes + b.nbytes[i] > pol.max_op_bytes) return false;
  if (mem_contiguous(b, prev, i)) {
    if (pol.vectored || !pol.buffers) return true;
    // A fixed op must stay inside one registered buffer.
    const iovec& last = p.iovs[op.iov_begin + op.iov_count - 1];
    uint64_t start = reinterpret_cast<uint64_t>(last.iov_base);
    return pol.buffers->find(start, last.iov_len + b.nbytes[i]) == op.buf_index;
  }
  return pol.vectored && op.iov_count < pol.max_iov;
}

void start_op(Plan& p, const Batch& b, size_t i) {
  IoOp op;
  op.file = b.file[i];
  op.offset = b.offset[i];
  op.nbytes = b.nbytes[i];
  op.iov_begin = static_cast<uint32_t>(p.iovs.size());
  op.iov_count = 1;
  op.req_begin = op.req_end = static_cast<uint32_t>(i);
  p.iovs.push_back({reinterpret_cast<void*>(b.addr[i]), static_cast<size_t>(b.nbytes[i])});
  p.ops.push_back(op);
}

void join_op(Plan& p, IoOp& op, const Batch& b, size_t prev, size_t i) {
  if (mem_contiguous(b, prev, i)) {
    p.iovs.back().iov_len += b.nbytes[i];
  } else {
    p.iovs.push_back({reinterpret_cast<void*>(b.addr[i]), static_cast<size_t>(b.nbytes[i])});
    op.iov_count++;
  }
  op.nbytes += b.nbytes[i];
}

void assign_buffers(Plan& p, const BufferMap* buffers) {
  for (IoOp& op : p.ops) {
    if (op.iov_count != 1 || !buffers) continue;
    const iovec& v = p.iovs[op.iov_begin];
    op.buf_index = buffers->find(reinterpret_cast<uint64_t>(v.iov_base), v.iov_len);
  }
}

}  // namespace

Plan build_plan(const Batch& b, const PlanPolicy& pol, size_t nfiles, int32_t* results) {
  Plan p;
  p.ops.reserve(b.n);
  p.iovs.reserve(b.n);
  bool open = false;
  size_t prev = 0;
  for (size_t i = 0; i < b.n; ++i) {
    int err = validate(b, i, nfiles, int64_t{1} << 30);  // a request may exceed the op cap
    results[i] = err;
    if (err || b.nbytes[i] == 0) {
      if (b.groups) b.groups->done(b, i, err == 0);
      open = false;
      continue;
    }
    if (open && can_join(p, p.ops.back(), b, prev, i, pol)) {
      join_op(p, p.ops.back(), b, prev, i);
    } else {
      start_op(p, b, i);
      if (!pol.vectored && pol.buffers) {
        const iovec& v = p.iovs.back();
        p.ops.back().buf_index = pol.buffers->find(b.addr[i], v.iov_len);
      }
    }
    p.ops.back().req_end = static_cast<uint32_t>(i + 1);
    open = true;
    prev = i;
  }
  assign_buffers(p, pol.buffers);
  return p;
}

void advance_op(Plan& p, IoOp& op, int64_t res) {
  op.done += res;
  while (res > 0 && op.iov_count > 0) {
    iovec& v = p.iovs[op.iov_begin];
    if (static_cast<size_t>(res) < v.iov_len) {
      v.iov_base = static_cast<char*>(v.iov_base) + res;
      v.iov_len -= res;
      return;
    }
    res -= v.iov_len;
    op.iov_begin++;
    op.iov_count--;
  }
}

void finish_op(const Plan& p, const IoOp& op, const Batch& b, int err, int32_t* results,
               Counters& c) {
  (void)p;
  for (uint32_t i = op.req_begin; i < op.req_end; ++i) {
    if (results[i] != 0 || b.nbytes[i] == 0) continue;  // invalid ones keep their error
    results[i] = err ? err : static_cast<int32_t>(b.nbytes[i]);
    if (b.groups) b.groups->done(b, i, err == 0);
  }
  if (err) {
    c.errors += op.req_end - op.req_begin;
  } else {
    c.bytes += op.nbytes;
  }
}

FileTable::~FileTable() { close_all(); }

int FileTable::open(const std::string& path, bool writable, bool direct) {
  int flags = (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC | (direct ? O_DIRECT : 0);
  int fd = ::open(path.c_str(), flags);
  if (fd < 0) TUTTI_SYS_FAIL(errno, "open " + path, path);
  std::unique_lock lock(mu_);
  for (size_t i = 0; i < fds_.size(); ++i) {
    if (fds_[i] < 0) {
      fds_[i] = fd;
      paths_[i] = path;
      return static_cast<int>(i);
    }
  }
  fds_.push_back(fd);
  paths_.push_back(path);
  return static_cast<int>(fds_.size() - 1);
}

void FileTable::close(int index) {
  std::unique_lock lock(mu_);
  TUTTI_EXPECT(index >= 0 && static_cast<size_t>(index) < fds_.size() && fds_[index] >= 0,
               "no open file at index " + std::to_string(index));
  ::close(fds_[index]);
  fds_[index] = -1;
  paths_[index].clear();
}

int FileTable::fd(int index) const {
  std::shared_lock lock(mu_);
  return (index >= 0 && static_cast<size_t>(index) < fds_.size()) ? fds_[index] : -1;
}

size_t FileTable::size() const {
  std::shared_lock lock(mu_);
  return fds_.size();
}

std::string FileTable::path(int index) const {
  std::shared_lock lock(mu_);
  return (index >= 0 && static_cast<size_t>(index) < paths_.size()) ? paths_[index] : "";
}

void FileTable::close_all() {
  std::unique_lock lock(mu_);
  for (int& fd : fds_) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
}

int Engine::open_file(const std::string& path, bool writable, bool direct) {
  return files.open(path, writable, direct);
}

TaskPool* Engine::task_pool() {
  std::lock_guard lock(task_mu_);
  if (!tasks_) tasks_ = std::make_unique<TaskPool>(task_threads);
  return tasks_.get();
}

}  // namespace tutti
