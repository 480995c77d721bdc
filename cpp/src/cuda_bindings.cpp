// pybind11 bindings of the optional CUDA part (tutti/cuda.hpp); importing them loads nothing.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "tutti/cuda.hpp"

namespace py = pybind11;

namespace tutti {

void bind_cuda(py::module_& m) {
  m.def("cuda_available", &cuda::available, py::call_guard<py::gil_scoped_release>());
  m.def("cuda_reason", &cuda::reason, py::call_guard<py::gil_scoped_release>());
  m.def(
      "green_streams",
      [](int device, unsigned min_sms, unsigned n_streams) {
        cuda::GreenStreams g;
        {
          py::gil_scoped_release release;
          g = cuda::green_streams(device, min_sms, n_streams);
        }
        return py::make_tuple(g.streams, g.sm_count);
      },
      py::arg("device"), py::arg("min_sms"), py::arg("n_streams") = 1);
}

}  // namespace tutti
