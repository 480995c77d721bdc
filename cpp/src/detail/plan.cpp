// Batch planning (validation + coalescing) shared by both engines, and the joined plan of a
// read stream's chunks.
#include "tutti/detail/plan.hpp"

#include <cerrno>

#include <algorithm>

namespace tutti::detail {

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
bool can_join(const IoOp& op, const Batch& b, size_t prev, size_t i, const PlanPolicy& pol) {
  if (!file_contiguous(b, prev, i)) return false;
  if (op.nbytes + b.nbytes[i] > pol.max_op_bytes) return false;
  return mem_contiguous(b, prev, i) || op.iov_count < pol.max_iov;
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
    p.iovs.back().iov_len += static_cast<size_t>(b.nbytes[i]);
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

Plan build_plan(const Batch& b, const PlanPolicy& pol, size_t nfiles, Completion* on_done,
                int32_t* results) {
  Plan p;
  p.ops.reserve(b.n);
  p.iovs.reserve(b.n);
  bool open = false;
  size_t prev = 0;
  for (size_t i = 0; i < b.n; ++i) {
    int err = validate(b, i, nfiles, int64_t{1} << 30);  // a request may exceed the op cap
    results[i] = err;
    if (err || b.nbytes[i] == 0) {
      if (on_done) on_done->done(i, err == 0);
      open = false;
      continue;
    }
    if (open && can_join(p.ops.back(), b, prev, i, pol)) {
      join_op(p, p.ops.back(), b, prev, i);
    } else {
      start_op(p, b, i);
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
  if (res <= 0) return;
  size_t left = static_cast<size_t>(res);
  while (left > 0 && op.iov_count > 0) {
    iovec& v = p.iovs[op.iov_begin];
    if (left < v.iov_len) {
      v.iov_base = static_cast<char*>(v.iov_base) + left;
      v.iov_len -= left;
      return;
    }
    left -= v.iov_len;
    op.iov_begin++;
    op.iov_count--;
  }
}

void finish_op(const IoOp& op, const Batch& b, Completion* on_done, int err, int32_t* results,
               AtomicCounters& c) {
  for (uint32_t i = op.req_begin; i < op.req_end; ++i) {
    if (results[i] != 0 || b.nbytes[i] == 0) continue;  // invalid ones keep their error
    results[i] = err ? err : static_cast<int32_t>(b.nbytes[i]);
    if (on_done) on_done->done(i, err == 0);
  }
  if (err) {
    c.errors += op.req_end - op.req_begin;
  } else {
    c.bytes += static_cast<uint64_t>(op.nbytes);
  }
}

StreamPlan build_stream_plan(const Batch& all, const std::vector<int64_t>& chunk_start,
                             const PlanPolicy& pol, size_t nfiles, Completion* on_done,
                             int32_t* results) {
  StreamPlan sp;
  const size_t nchunks = chunk_start.size() - 1;
  sp.chunk_end.resize(nchunks);
  sp.chunk_ops.resize(nchunks);
  for (size_t c = 0; c < nchunks; ++c) {
    const int64_t b0 = chunk_start[c];
    const Batch b{all.file + b0, all.offset + b0, all.nbytes + b0, all.addr + b0,
                  static_cast<size_t>(chunk_start[c + 1] - b0)};
    ShiftedCompletion hook(on_done, static_cast<size_t>(b0));
    Plan p = build_plan(b, pol, nfiles, on_done ? &hook : nullptr, results + b0);
    const uint32_t iov0 = static_cast<uint32_t>(sp.plan.iovs.size());
    for (IoOp o : p.ops) {
      o.iov_begin += iov0;
      o.req_begin += static_cast<uint32_t>(b0);
      o.req_end += static_cast<uint32_t>(b0);
      sp.plan.ops.push_back(o);
      sp.op_chunk.push_back(static_cast<uint32_t>(c));
    }
    sp.plan.iovs.insert(sp.plan.iovs.end(), p.iovs.begin(), p.iovs.end());
    sp.chunk_end[c] = sp.plan.ops.size();
    sp.chunk_ops[c] = p.ops.size();
  }
  return sp;
}

}  // namespace tutti::detail
