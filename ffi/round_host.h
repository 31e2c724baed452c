// Host blocks for graph-mode round tickets. The poller makes a round's ticket while the device may wait
// for that round, so it never pins memory there (cuMemHostAlloc waits for a driver lock a blocked
// cuGraphLaunch holds: DESIGN.md, driver facts). A block is carved from the host store's pool; without
// room it is pageable memory, copied only through this part's pinned bounce buffers (the driver never
// sees a pageable pointer), while a grower thread pins more for the tickets after it.
//
// Owns the bounce buffers, the grower and the count of pageable tickets; handed the host store. Its
// own state is atomics and the bounce buffers' lock: callable from the poller and an initialize stage.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "bounce.h"
#include "host_pool.h"
#include "status.h"
#include "worker.h"

namespace jaxvmm {

class RoundHostSupply {
 public:
  RoundHostSupply(Backend b, int device, HostStore& host) : backend_(b), device_(device), host_(host), bounce_(b, device) {}
  ~RoundHostSupply();  // the grower finishes its task and stops
  RoundHostSupply(const RoundHostSupply&) = delete;
  RoundHostSupply& operator=(const RoundHostSupply&) = delete;

  Status Init();  // the grower thread
  // At an initialize stage (where pinning is safe): the bounce buffers. `readers_can_bounce`: the
  // engine's other readers of round tickets (the op ring's resolver) can copy a pageable one; without
  // that, or without these buffers, a round whose ticket finds no pinned room fails instead.
  void Prepare(bool readers_can_bounce);
  // At an initialize stage: pinned room for a new call site's first rounds (over the host pool's limit
  // nothing is pinned and the rounds fall back as they would).
  void Reserve(size_t bytes) { (void)host_.Reserve(bytes); }

  // A round ticket's host block (the poller): carved from the pool, else pageable (and the grower pins
  // more behind it).
  Status Allocate(size_t nbytes, HostBlock* out);
  // Copies to and from pageable round tickets go through these (the poller only).
  PageableBounce& bounce() { return bounce_; }

  int64_t fallbacks() const { return fallbacks_.load(std::memory_order_relaxed); }  // pageable tickets made
  int64_t copies() const { return bounce_.copies(); }  // pieces copied through the bounce buffers

 private:
  const Backend backend_;
  const int device_;
  HostStore& host_;
  PageableBounce bounce_;
  std::atomic<bool> pageable_ok_{false};  // Prepare: bounce_ and the other readers' buffers are ready
  std::atomic<int64_t> fallbacks_{0};
  std::atomic<bool> growing_{false};  // a growth is queued on grower_
  std::unique_ptr<Worker> grower_;
};

}  // namespace jaxvmm
