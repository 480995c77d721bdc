// The CUDA driver API behind tutti/cuda.hpp, loaded lazily: dlopen("libcuda.so.1") on the first
// call, cuDriverGetVersion and cuGetProcAddress_v2 by dlsym, every other entry point through
// cuGetProcAddress for the CUDA 12.5 ABI (or the driver's own version when older), so a CUDA 13
// driver hands back the variants these declarations describe.
// The declarations are ours, written from the driver API reference, not copied from cuda.h.
#include <dlfcn.h>

#include <mutex>
#include <string>

#include "tutti/cuda.hpp"

namespace tutti::cuda {
namespace {

using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUstream = void*;
using CUgreenCtx = void*;
using CUdevResourceDesc = void*;

constexpr int kAbiVersion = 12050;  // green-context streams appeared in 12.5
constexpr int kDevResourceTypeSm = 1;
constexpr unsigned kGreenCtxDefaultStream = 0x1;  // required by cuGreenCtxCreate
constexpr unsigned kStreamNonBlocking = 0x1;      // required by cuGreenCtxStreamCreate

// CUdevResource: the type, 92 bytes the driver keeps, then a 48-byte union whose SM member
// starts with smCount (CUDA 12.4 to 13: 144 bytes, 8-aligned).
struct SmResource {
  unsigned sm_count, min_partition_size, coscheduled_alignment, flags;
};
struct alignas(8) DevResource {
  int type;
  unsigned char reserved[92];
  union {
    SmResource sm;
    unsigned char abi[48];
  } u;
};
static_assert(sizeof(DevResource) == 144, "CUdevResource is 144 bytes");

struct Api {
  CUresult (*GetErrorName)(CUresult, const char**) = nullptr;
  CUresult (*Init)(unsigned) = nullptr;
  CUresult (*DeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*DevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*CtxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*CtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*CtxGetStreamPriorityRange)(int*, int*) = nullptr;  // (least, greatest)
  // green contexts (12.4+, their streams 12.5+): null where the driver has none
  CUresult (*DeviceGetDevResource)(CUdevice, DevResource*, int) = nullptr;
  CUresult (*DevSmResourceSplitByCount)(DevResource*, unsigned*, const DevResource*, DevResource*,
                                        unsigned, unsigned) = nullptr;
  CUresult (*DevResourceGenerateDesc)(CUdevResourceDesc*, DevResource*, unsigned) = nullptr;
  CUresult (*GreenCtxCreate)(CUgreenCtx*, CUdevResourceDesc, CUdevice, unsigned) = nullptr;
  CUresult (*GreenCtxStreamCreate)(CUstream*, CUgreenCtx, unsigned, int) = nullptr;
  int version = 0;
};

using GetProc = CUresult (*)(const char*, void**, int, unsigned long long, int*);

struct Loaded {
  Api api;
  std::string reason;  // empty when loaded
};

template <typename F>
bool resolve(GetProc get, int version, const char* name, F& fn) {
  void* p = nullptr;
  int status = 0;
  if (get(name, &p, version, 0, &status) != 0 || p == nullptr) return false;
  fn = reinterpret_cast<F>(p);
  return true;
}

// Loads the driver once; never unloads it (the process may hold CUDA objects until exit).
std::string load(Api& a) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return std::string("cannot load libcuda.so.1: ") + dlerror();
  auto version_fn = reinterpret_cast<CUresult (*)(int*)>(dlsym(lib, "cuDriverGetVersion"));
  auto get = reinterpret_cast<GetProc>(dlsym(lib, "cuGetProcAddress_v2"));
  if (version_fn == nullptr || get == nullptr)
    return "the CUDA driver is older than 12.0 (no cuGetProcAddress_v2)";
  if (version_fn(&a.version) != 0) return "cuDriverGetVersion failed";
  const int v = a.version < kAbiVersion ? a.version : kAbiVersion;
  const bool required = resolve(get, v, "cuGetErrorName", a.GetErrorName) &&
                        resolve(get, v, "cuInit", a.Init) &&
                        resolve(get, v, "cuDeviceGet", a.DeviceGet) &&
                        resolve(get, v, "cuDevicePrimaryCtxRetain", a.DevicePrimaryCtxRetain) &&
                        resolve(get, v, "cuCtxGetCurrent", a.CtxGetCurrent) &&
                        resolve(get, v, "cuCtxSetCurrent", a.CtxSetCurrent);
  if (!required) return "the CUDA driver lacks a context call";
  resolve(get, v, "cuCtxGetStreamPriorityRange", a.CtxGetStreamPriorityRange);
  resolve(get, v, "cuDeviceGetDevResource", a.DeviceGetDevResource);
  resolve(get, v, "cuDevSmResourceSplitByCount", a.DevSmResourceSplitByCount);
  resolve(get, v, "cuDevResourceGenerateDesc", a.DevResourceGenerateDesc);
  resolve(get, v, "cuGreenCtxCreate", a.GreenCtxCreate);
  resolve(get, v, "cuGreenCtxStreamCreate", a.GreenCtxStreamCreate);
  const CUresult r = a.Init(0);
  if (r != 0) return "cuInit failed with CUresult " + std::to_string(r);
  return "";
}

const Loaded& loaded() {
  static Loaded l;
  static std::once_flag once;
  std::call_once(once, [] { l.reason = load(l.api); });
  return l;
}

const Api& api() {
  const Loaded& l = loaded();
  if (!l.reason.empty()) throw CudaError("CUDA driver unavailable: " + l.reason);
  return l.api;
}

void check(CUresult r, const char* call) {
  if (r == 0) return;
  const char* name = nullptr;
  if (api().GetErrorName(r, &name) != 0 || name == nullptr) name = "unknown CUresult";
  throw CudaError(std::string(call) + " failed: " + name + " (" + std::to_string(r) + ")");
}

// Makes the device's primary context current on this thread when the thread has none (the
// CUDA runtime, e.g. torch, does the same lazily); a thread with a context keeps it.
void ensure_context(int device) {
  const Api& a = api();
  CUcontext ctx = nullptr;
  check(a.CtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (ctx != nullptr) return;
  CUdevice dev = 0;
  check(a.DeviceGet(&dev, device), "cuDeviceGet");
  check(a.DevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");  // held for good
  check(a.CtxSetCurrent(ctx), "cuCtxSetCurrent");
}

}  // namespace

bool available() { return loaded().reason.empty(); }

std::string reason() { return loaded().reason; }

GreenStreams green_streams(int device, unsigned min_sms, unsigned n_streams) {
  const Api& a = api();
  if (a.GreenCtxStreamCreate == nullptr || a.DevSmResourceSplitByCount == nullptr)
    throw CudaError("the CUDA driver (" + std::to_string(a.version) +
                    ") has no green-context streams (needs 12.5+)");
  ensure_context(device);
  CUdevice dev = 0;
  check(a.DeviceGet(&dev, device), "cuDeviceGet");
  DevResource all{}, group{}, rest{};
  check(a.DeviceGetDevResource(dev, &all, kDevResourceTypeSm), "cuDeviceGetDevResource");
  unsigned groups = 1;
  check(a.DevSmResourceSplitByCount(&group, &groups, &all, &rest, 0, min_sms),
        "cuDevSmResourceSplitByCount");
  if (groups < 1) throw CudaError("cuDevSmResourceSplitByCount returned no group");
  CUdevResourceDesc desc = nullptr;
  check(a.DevResourceGenerateDesc(&desc, &group, 1), "cuDevResourceGenerateDesc");
  CUgreenCtx green = nullptr;  // never destroyed (see green.py)
  check(a.GreenCtxCreate(&green, desc, dev, kGreenCtxDefaultStream), "cuGreenCtxCreate");
  // The greatest priority: when an SM of the partition frees, the block scheduler starts the I/O
  // kernel's blocks before the forward's queued ones (whose kernels may use every SM), as it does
  // for the "priority" stream green.py falls back to.
  int least = 0, greatest = 0;
  if (a.CtxGetStreamPriorityRange != nullptr)
    check(a.CtxGetStreamPriorityRange(&least, &greatest), "cuCtxGetStreamPriorityRange");
  GreenStreams out{{}, group.u.sm.sm_count};
  for (unsigned i = 0; i < n_streams; ++i) {
    CUstream stream = nullptr;
    check(a.GreenCtxStreamCreate(&stream, green, kStreamNonBlocking, greatest),
          "cuGreenCtxStreamCreate");
    out.streams.push_back(reinterpret_cast<uint64_t>(stream));
  }
  return out;
}

}  // namespace tutti::cuda
