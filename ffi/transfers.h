// Transfers: the copies of a ticket's bytes between staging cells, device copies and host blocks, and
// how a stream waits until a ticket's D2H is done. Used by both paths of the engine (the op ring and
// graph mode); owns the graph D2H clock, the pinned word through which a graph-mode round's D2H
// completion is known (a sequence number, not an event: DESIGN.md, driver facts).
//
// No lock: the clock word is written by the device (gd2h_'s memops) and read with atomics; everything
// else is stateless. The caller picks the stream and, for pageable host blocks, the bounce buffers.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "bounce.h"
#include "driver.h"
#include "host_pool.h"
#include "status.h"
#include "tickets.h"

namespace jaxvmm {

// Where a ticket's bytes can be copied from: its device copy (when it keeps one) or its host block
// (once its D2H is done). A snapshot taken under the ledger lock.
struct Source {
  CUdeviceptr resident = 0;  // a device copy (a kept staging cell, or a graph round's lent cell)
  CUevent resident_ready = nullptr;  // null: the device copy is complete
  CUevent d2h_done = nullptr;
  uint64_t d2h_seq = 0;  // graph-mode ticket: its D2H is done once the graph clock reaches d2h_seq
  const void* host = nullptr;
  bool unified = false;   // the host block is a host_numa mapping: copy by unified address
  bool pageable = false;  // the host block is pageable memory: copy through a PageableBounce
  bool lent = false;      // graph mode: `resident` is a lent or held cell (GraphMode watches the copy)
};

// Caller holds the ledger lock. The ticket's own copy or host block (a lent cell is graph mode's).
Source SourceOf(const Ticket& t);

class Transfers {
 public:
  Transfers(Backend b, int device) : backend_(b), device_(device) {}
  ~Transfers();
  Transfers(const Transfers&) = delete;
  Transfers& operator=(const Transfers&) = delete;

  Status Init();  // the pinned clock word

  // The graph D2H clock: graph mode's D2H stream writes each D2H's sequence number here after it.
  std::atomic<uint64_t>* graph_clock() const { return clock_; }
  CUdeviceptr graph_clock_address() const { return reinterpret_cast<CUdeviceptr>(clock_); }
  // Whether t's D2H has finished (its event, or the graph clock).
  bool D2hDone(const Ticket& t) const;
  // Whether every graph-mode D2H up to sequence number `seq` has finished (0: none is waited for).
  bool ClockReached(uint64_t seq) const { return clock_->load(std::memory_order_acquire) >= seq; }

  // Enqueues on `s`: wait until `src` holds the bytes, then copy them to `dst` (D2D or H2D; a pageable
  // host block through `bounce`).
  Status CopyTicket(CUstream s, const Source& src, CUdeviceptr dst, size_t nbytes, PageableBounce& bounce,
                    const char* stage) const;
  // Enqueues on `s` the D2H of `nbytes` from `src` into `host` (by unified address for host_numa blocks).
  Status CopyToHost(CUstream s, const HostBlock& host, CUdeviceptr src, size_t nbytes, const char* stage) const;
  // Enqueues on `s` the H2D of `nbytes` from host memory `src` (unified: a host_numa block) into `dst`.
  Status CopyFromHost(CUstream s, CUdeviceptr dst, const void* src, bool unified, size_t nbytes, const char* stage) const;

 private:
  const Backend backend_;
  const int device_;
  std::atomic<uint64_t>* clock_ = nullptr;  // pinned, device-mapped
};

}  // namespace jaxvmm
