// LMCache 0.5.6's compiled CUDA ops (lmcache/cuda_ops*.so) on the GPU machine's torch 2.11, for
// the benchmark's lmcache-* baselines only (never part of tutti_hicache).
//
// The wheel was built against torch >= 2.13, whose c10::NotImplementedError declares its own
// out-of-line constructor NotImplementedError(SourceLocation, std::string); torch 2.11 only
// inherits Error's constructors, so libc10 has no such symbol and `import lmcache.cuda_ops` fails
// with "undefined symbol: _ZN3c1019NotImplementedErrorC1...". That is the only symbol the module
// lacks there (checked against torch 2.11's exports). Without the module LMCache falls back to its
// torch ops, which restored wrong KV in a 0.5.23 server (benchmarks.md §12), so the baseline
// would be a configuration nobody runs.
//
// This library defines that one constructor, under its mangled name, as what torch 2.11's header
// makes of the same expression: the inherited Error(SourceLocation, std::string) constructor plus
// NotImplementedError's vtable. bench/gpu_setup.sh builds it only where the import fails for this
// symbol, and the harness preloads it into LMCache's daemon and the lmcache-* servers
// (TUTTI_LMCACHE_PRELOAD). The constructor only runs when cuda_ops raises NotImplementedError.
#include <torch/csrc/api/include/torch/version.h>

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
#error "torch >= 2.13 exports NotImplementedError(SourceLocation, std::string): no shim is needed"
#endif

#include <c10/util/Exception.h>

#include <new>
#include <string>
#include <utility>

// Same parameters as the member constructor (the object first, as `this`), so the same calling
// convention; the name is the complete-object constructor's (C1) mangled name.
void tutti_lmcache_not_implemented_ctor(c10::NotImplementedError* self, c10::SourceLocation loc,
                                        std::string msg)
    __asm__("_ZN3c1019NotImplementedErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE");

void tutti_lmcache_not_implemented_ctor(c10::NotImplementedError* self, c10::SourceLocation loc,
                                        std::string msg) {
  new (self) c10::NotImplementedError(loc, std::move(msg));
}
