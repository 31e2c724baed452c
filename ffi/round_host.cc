#include "round_host.h"

#include <algorithm>
#include <cstdio>
#include <string>

namespace jaxvmm {

RoundHostSupply::~RoundHostSupply() { grower_.reset(); }

Status RoundHostSupply::Init() {
  grower_ = std::make_unique<Worker>("jaxvmm-grow", backend_, device_);
  return Status();
}

void RoundHostSupply::Prepare(bool readers_can_bounce) {
  Status st = bounce_.Init();  // idempotent
  if (!st.ok()) std::fprintf(stderr, "jaxvmm: pageable bounce buffers unavailable: %s\n", st.ToString().c_str());
  pageable_ok_.store(bounce_.ready() && readers_can_bounce);
}

Status RoundHostSupply::Allocate(size_t nbytes, HostBlock* out) {
  bool carved = false;
  JAXVMM_RETURN_IF_ERROR(host_.TryAllocate(nbytes, out, &carved));
  if (carved) return Status();
  if (!pageable_ok_.load())
    return Status(Code::kOutOfMemory, "the pinned host pool has no room for " + std::to_string(nbytes) +
                                          " bytes and the pageable fallback is unavailable");
  *out = host_.Pageable(nbytes);
  if (!*out) return Status(Code::kOutOfMemory, "no host memory for " + std::to_string(nbytes) + " bytes (pageable fallback)");
  fallbacks_.fetch_add(1, std::memory_order_relaxed);
  if (!growing_.exchange(true)) {
    const size_t want = std::max<size_t>(4 * nbytes, HostPool::ChunkSize());
    grower_->Post([this, want, nbytes] {
      // Room for four such tickets (or a chunk); under host_pool_limit, as much as fits down to one
      // ticket. An error at one ticket (the limit) leaves the fallback in use.
      for (size_t w = want; !host_.Reserve(w).ok() && w > nbytes;) w = std::max(w / 2, nbytes);
      growing_.store(false);
    });
  }
  return Status();
}

}  // namespace jaxvmm
