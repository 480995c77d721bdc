// The optional CUDA part: a few CUDA driver API calls, loaded at first use.
//
// Nothing here needs CUDA at build time: libcuda.so.1 is dlopen()ed on the first call and every
// entry point is resolved through cuGetProcAddress for a fixed ABI version (12.5), with our own
// declarations of the few types involved (cuda_shim.cpp). On a machine without the driver
// available() is false and reason() says why; every other call throws CudaError.
// Errors: a failing driver call throws CudaError naming the call and its CUresult (-> Python
// RuntimeError). Threads: every function may be called from any thread; a call that needs a
// context makes the device's primary context current when the thread has none.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace pybind11 {
class module_;
}

namespace tutti {

class CudaError : public std::runtime_error {
 public:
  explicit CudaError(const std::string& msg) : std::runtime_error(msg) {}
};

namespace cuda {

/// Whether the driver loaded and cuInit succeeded (loads it on the first call).
bool available();
/// Why not, "" when available.
std::string reason();

/// n_streams streams of one green context holding at least min_sms SMs of device (rounded up by
/// the driver to its granularity). The context is never destroyed (see green.py). streams hold
/// CUstream handles.
struct GreenStreams {
  std::vector<uint64_t> streams;
  unsigned sm_count = 0;
};
GreenStreams green_streams(int device, unsigned min_sms, unsigned n_streams);

}  // namespace cuda

/// Registers the functions above on the extension module (cuda_bindings.cpp).
void bind_cuda(pybind11::module_& m);

}  // namespace tutti
