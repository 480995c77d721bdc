// The engines' counters, updated from any thread; Engine::counters() returns a snapshot.
#pragma once

#include <atomic>
#include <cstdint>

#include "tutti/engine.hpp"

namespace tutti::detail {

struct AtomicCounters {
  std::atomic<uint64_t> batches{0}, requests{0}, bytes{0}, submissions{0}, enter_calls{0},
      requeues{0}, errors{0};

  Counters snapshot() const noexcept {
    Counters c;
    c.batches = batches.load();
    c.requests = requests.load();
    c.bytes = bytes.load();
    c.submissions = submissions.load();
    c.enter_calls = enter_calls.load();
    c.requeues = requeues.load();
    c.errors = errors.load();
    return c;
  }
};

}  // namespace tutti::detail
