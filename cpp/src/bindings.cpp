// pybind11 bindings only: int64 arrays in, one int32 result per request out,
// GIL released for the whole batch. No logic lives here.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "tutti/cuda.hpp"
#include "tutti/engine.hpp"
#include "tutti/error.hpp"
#include "tutti/memory.hpp"

namespace py = pybind11;
using tutti::Engine;

namespace {

using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using U64 = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;

size_t same_length(std::initializer_list<py::ssize_t> sizes) {
  py::ssize_t n = *sizes.begin();
  for (auto s : sizes) TUTTI_EXPECT(s == n, "batch arrays must have the same length");
  return static_cast<size_t>(n);
}

tutti::Op op_of(const std::string& op) {
  if (op == "read") return tutti::Op::kRead;
  if (op == "write") return tutti::Op::kWrite;
  throw tutti::Error("op must be 'read' or 'write', got '" + op + "'", __FILE__, __LINE__);
}

// submit(op, files, offsets, nbytes, addrs, group_starts=None) -> results, or (results, sums)
// when group_starts is given (a verified read: see tutti::Groups).
py::object submit(Engine& e, const std::string& op, const I64& file, const I64& offset,
                  const I64& nbytes, const U64& addr, const py::object& group_starts) {
  const tutti::Op o = op_of(op);
  const size_t n = same_length({file.size(), offset.size(), nbytes.size(), addr.size()});
  py::array_t<int32_t> results(static_cast<py::ssize_t>(n));
  const tutti::Batch b{file.data(), offset.data(), nbytes.data(), addr.data(), n};
  int32_t* out = results.mutable_data();
  if (group_starts.is_none()) {
    py::gil_scoped_release release;
    e.submit(o, b, out, nullptr);
    return std::move(results);
  }
  const auto starts = group_starts.cast<I64>();
  TUTTI_EXPECT(starts.size() >= 1, "group_starts needs at least one entry");
  const size_t ngroups = static_cast<size_t>(starts.size() - 1);
  py::array_t<uint64_t> sums(static_cast<py::ssize_t>(ngroups));
  const tutti::Groups groups{starts.data(), ngroups, sums.mutable_data()};
  {
    py::gil_scoped_release release;
    e.submit(o, b, out, &groups);
  }
  return py::make_tuple(results, sums);
}

std::vector<int64_t> vec(const I64& a) { return {a.data(), a.data() + a.size()}; }

// A many-chunk read kept back to back at the device (see ReadStream in engine.hpp).
std::unique_ptr<tutti::ReadStream> read_stream(Engine& e, const I64& file, const I64& offset,
                                               const I64& nbytes, const U64& addr,
                                               const I64& chunk_start,
                                               const py::object& group_starts) {
  same_length({file.size(), offset.size(), nbytes.size(), addr.size()});
  tutti::StreamSpec spec;
  if (!group_starts.is_none()) spec.group_start = vec(group_starts.cast<I64>());
  spec.addr.assign(addr.data(), addr.data() + addr.size());
  spec.file = vec(file);
  spec.offset = vec(offset);
  spec.nbytes = vec(nbytes);
  spec.chunk_start = vec(chunk_start);
  py::gil_scoped_release release;
  return e.read_stream(std::move(spec));
}

// wait(c): chunk c final -> (its results, the checksums of its groups), copies. The GIL is let
// go only when the chunk is not final yet: under a busy interpreter each release costs up to a
// switch interval to get it back (SGLang's scheduler thread launching a forward holds it).
py::tuple stream_wait(tutti::ReadStream& s, size_t c) {
  tutti::ChunkResults r;
  if (s.final(c)) {
    r = s.wait(c);
  } else {
    py::gil_scoped_release release;
    r = s.wait(c);
  }
  py::array_t<int32_t> res(static_cast<py::ssize_t>(r.n_requests));
  std::copy(r.results, r.results + r.n_requests, res.mutable_data());
  py::array_t<uint64_t> sums(static_cast<py::ssize_t>(r.n_groups));
  std::copy(r.sums, r.sums + r.n_groups, sums.mutable_data());
  return py::make_tuple(res, sums);
}

py::dict counters(const Engine& e) {
  const tutti::Counters c = e.counters();
  py::dict d;
  d["batches"] = c.batches;
  d["requests"] = c.requests;
  d["bytes"] = c.bytes;
  d["submissions"] = c.submissions;
  d["enter_calls"] = c.enter_calls;
  d["requeues"] = c.requeues;
  d["errors"] = c.errors;
  return d;
}

std::unique_ptr<Engine> make_engine(const std::string& kind, unsigned queue_depth, unsigned threads,
                                    int64_t max_op_bytes, int64_t read_inflight_bytes,
                                    int64_t write_inflight_bytes) {
  tutti::EngineOptions opt;
  opt.queue_depth = queue_depth;
  opt.threads = threads;
  opt.max_op_bytes = max_op_bytes;
  opt.read_inflight_bytes = read_inflight_bytes;
  opt.write_inflight_bytes = write_inflight_bytes;
  return tutti::make_engine(kind, opt);
}

py::array_t<uint64_t> checksum_groups(const U64& addr, const I64& len, const I64& group_start,
                                      unsigned threads) {
  same_length({addr.size(), len.size()});
  TUTTI_EXPECT(group_start.size() >= 1, "group_start needs at least one entry");
  size_t ngroups = static_cast<size_t>(group_start.size() - 1);
  const int64_t* gs = group_start.data();
  for (size_t g = 0; g < ngroups; ++g)
    TUTTI_EXPECT(gs[g] >= 0 && gs[g] <= gs[g + 1] && gs[g + 1] <= addr.size(),
                 "group_start must be non-decreasing and within the arrays");
  py::array_t<uint64_t> out(static_cast<py::ssize_t>(ngroups));
  uint64_t* o = out.mutable_data();
  {
    py::gil_scoped_release release;
    tutti::checksum_groups(addr.data(), len.data(), gs, ngroups, o, threads);
  }
  return out;
}

void memcpy_batch(const U64& dst, const U64& src, const I64& len, unsigned threads) {
  size_t n = same_length({dst.size(), src.size(), len.size()});
  py::gil_scoped_release release;
  tutti::memcpy_batch(dst.data(), src.data(), len.data(), n, threads);
}

}  // namespace

PYBIND11_MODULE(_engine, m) {
  m.doc() = "tutti_hicache I/O engine (io_uring / POSIX), checksums and aligned buffers";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const tutti::CudaError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (const tutti::SysError& e) {
      py::object exc = py::module_::import("builtins").attr("OSError")(
          e.err(), e.what(), e.path().empty() ? py::object(py::none()) : py::str(e.path()));
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    } catch (const tutti::Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  py::class_<Engine>(m, "Engine")
      .def_property_readonly("name", &Engine::name)
      .def("open_file", &Engine::open_file, py::arg("path"), py::arg("writable"),
           py::arg("direct") = true, py::call_guard<py::gil_scoped_release>())
      .def("register_buffers", &Engine::register_buffers, py::arg("regions"),
           py::call_guard<py::gil_scoped_release>())
      .def("submit", &submit, py::arg("op"), py::arg("files"), py::arg("offsets"),
           py::arg("nbytes"), py::arg("addrs"), py::arg("group_starts") = py::none())
      .def("read_stream", &read_stream, py::arg("files"), py::arg("offsets"), py::arg("nbytes"),
           py::arg("addrs"), py::arg("chunk_starts"), py::arg("group_starts") = py::none(),
           py::keep_alive<0, 1>())
      .def("counters", &counters)
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>());

  py::class_<tutti::ReadStream>(m, "ReadStream")
      .def_property_readonly("nchunks", &tutti::ReadStream::nchunks)
      // allow() takes the stream's mutex (held briefly, never by a thread that needs the GIL)
      // and writes an eventfd: it keeps the GIL, as stream_wait does when nothing blocks
      .def("allow", &tutti::ReadStream::allow, py::arg("chunks"))
      .def("final", &tutti::ReadStream::final, py::arg("chunk"))
      .def("wait", &stream_wait, py::arg("chunk"))
      .def("cancel", &tutti::ReadStream::cancel, py::call_guard<py::gil_scoped_release>())
      .def("join", &tutti::ReadStream::join, py::call_guard<py::gil_scoped_release>())
      .def("done_ns", &tutti::ReadStream::done_ns);

  m.def("make_engine", &make_engine, py::arg("kind"), py::arg("queue_depth") = 1024,
        py::arg("threads") = 8, py::arg("max_op_bytes") = 1 << 30,
        py::arg("read_inflight_bytes") = 0, py::arg("write_inflight_bytes") = 0);
  m.def("uring_compiled", &tutti::uring_compiled);
  // The vendored liburing release compiled in ("2.3"), None in a POSIX-only build.
  if (const char* v = tutti::uring_vendored_version())
    m.attr("URING_VENDORED_VERSION") = v;
  else
    m.attr("URING_VENDORED_VERSION") = py::none();
  // The sanitizer this module was built under ("address", "thread"), None in a normal build.
#ifdef TUTTI_SANITIZER
  m.attr("SANITIZER") = TUTTI_SANITIZER;
#else
  m.attr("SANITIZER") = py::none();
#endif
  tutti::bind_cuda(m);
  m.def("checksum_groups", &checksum_groups, py::arg("addr"), py::arg("nbytes"),
        py::arg("group_start"), py::arg("threads") = 1);
  m.def("memcpy_batch", &memcpy_batch, py::arg("dst"), py::arg("src"), py::arg("nbytes"),
        py::arg("threads") = 1);

  py::class_<tutti::AlignedBuffer>(m, "AlignedBuffer", py::buffer_protocol())
      .def(py::init<size_t>(), py::arg("nbytes"))
      .def_property_readonly("address",
                             [](const tutti::AlignedBuffer& b) {
                               return reinterpret_cast<uint64_t>(b.data());
                             })
      .def_property_readonly("nbytes", &tutti::AlignedBuffer::nbytes)
      .def_buffer([](tutti::AlignedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.nbytes())}, {1});
      });
}
