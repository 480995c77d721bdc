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
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace pybind11 {
class module_;
}

namespace tutti {

class StreamLink;

class CudaError : public std::runtime_error {
 public:
  explicit CudaError(const std::string& msg) : std::runtime_error(msg) {}
};

namespace cuda {

/// Whether the driver loaded and cuInit succeeded (loads it on the first call).
bool available();
/// Why not, "" when available.
std::string reason();
/// The driver's CUDA version, e.g. 13000.
int driver_version();

/// n_streams streams of one green context holding at least min_sms SMs of device (rounded up by
/// the driver to its granularity). The context is never destroyed (see green.py). streams hold
/// CUstream handles.
struct GreenStreams {
  std::vector<uint64_t> streams;
  unsigned sm_count = 0;
};
GreenStreams green_streams(int device, unsigned min_sms, unsigned n_streams);

/// n 32-bit words of pinned host memory mapped into the device (cuMemHostAlloc with
/// DEVICEMAP | PORTABLE), zeroed. host: their CPU address; device_ptr: the address GPU work uses.
class HostWords {
 public:
  HostWords(int device, size_t n);
  ~HostWords();
  HostWords(const HostWords&) = delete;
  HostWords& operator=(const HostWords&) = delete;
  uint64_t host() const { return reinterpret_cast<uint64_t>(host_); }
  uint64_t device_ptr() const { return device_ptr_; }
  size_t size() const { return n_; }

 private:
  void* host_ = nullptr;
  uint64_t device_ptr_ = 0;
  size_t n_ = 0;
};

/// Work enqueued on stream after this waits until (int32_t)(*device_addr - value) >= 0
/// (cuStreamWaitValue32, CU_STREAM_WAIT_VALUE_GEQ). device: the stream's device.
void wait_value32(int device, uint64_t stream, uint64_t device_addr, uint32_t value);
/// Enqueues a store of value at device_addr on stream (cuStreamWriteValue32).
void write_value32(int device, uint64_t stream, uint64_t device_addr, uint32_t value);

/// Enqueues on stream a copy of the 32-bit word at host_addr (pinned host memory) to device_addr,
/// read when the stream gets there (a DMA): kernels behind it read the word from device memory
/// (one PCIe read per chunk, not one per program).
void copy_word32(int device, uint64_t stream, uint64_t device_addr, uint64_t host_addr);

/// Enqueues on stream a host function (cuLaunchHostFunc) that admits chunks [0, chunks) of the
/// read stream behind link once the stream's earlier work ended: the read stream's next chunks
/// then go out without any thread of the caller (the Python loader, its GIL) taking part. A
/// stream destroyed before then detached its link: the call does nothing.
void allow_after(int device, uint64_t stream, std::shared_ptr<StreamLink> link, size_t chunks);

}  // namespace cuda

/// Registers the functions above on the extension module (cuda_bindings.cpp).
void bind_cuda(pybind11::module_& m);

}  // namespace tutti
