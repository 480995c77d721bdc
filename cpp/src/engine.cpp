// make_engine: the one way to an engine (tutti/engine.hpp).
#include "tutti/engine.hpp"

#include "tutti/detail/engine_base.hpp"
#include "tutti/error.hpp"

namespace tutti {

std::unique_ptr<Engine> make_engine(const std::string& kind, const EngineOptions& opt) {
  TUTTI_EXPECT(opt.max_op_bytes >= 4096 && opt.max_op_bytes <= (int64_t{1} << 30),
               "max_op_bytes must be within [4 KiB, 1 GiB]");
  TUTTI_EXPECT(opt.read_inflight_bytes >= 0 && opt.write_inflight_bytes >= 0,
               "inflight bytes must be >= 0 (0: no cap)");
  if (kind == "uring") return detail::make_uring_engine(opt);
  if (kind == "posix") return detail::make_posix_engine(opt);
  throw Error("unknown engine kind '" + kind + "' (expected uring or posix)", __FILE__, __LINE__);
}

}  // namespace tutti
