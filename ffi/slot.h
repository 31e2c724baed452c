// Slot: a fixed virtual address range whose physical pages can be released and mapped again at the
// same address. No XLA, no Python. See DESIGN.md for the state machine.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "driver.h"
#include "status.h"
#include "vmm.h"

namespace jaxvmm {

struct Location {
  CUmemLocationType type = CU_MEM_LOCATION_TYPE_DEVICE;
  int id = 0;  // device ordinal or host NUMA node
};

struct SlotSpec {
  Backend backend = Backend::kPosix;
  int device = 0;             // the device that owns the slot (its context, its streams)
  Location location;          // where the physical pages live
  std::vector<int> access;    // devices granted read/write, in one cuMemSetAccess; empty = {device}
  size_t nbytes = 0;          // requested; the reservation is rounded up to the granularity
  CUmemAllocationHandleType handle_types = CU_MEM_HANDLE_TYPE_NONE;  // shareable handles (later)
  bool map_on_create = true;  // false: reserve only; the slot starts RELEASED (staging slots)
  bool internal = false;      // jaxvmm's own (the offload engine's staging slots), not the user's:
                              // accounted apart in stats() so a user's leak check is not disturbed
};

enum class SlotState : int {
  kMapped = 0,    // pages mapped and accessible at address()
  kReleased = 1,  // VA reserved, no pages; touching the range faults
  kClosing = 2,   // teardown started and failed part way; quarantined, resumes on retry
  kClosed = 3,    // everything returned to the driver
};
const char* SlotStateName(SlotState s);

struct SlotInfo {
  int64_t id;
  Backend backend;
  int device;
  Location location;
  CUdeviceptr address;
  size_t nbytes;
  size_t size;
  uint64_t generation;
  SlotState state;
  bool mapped;
  size_t mapped_bytes;  // physical bytes still attached (also when a failed stage left some behind)
  std::string last_error;
};

// A byte gauge with a high-water mark, updated lock-free. Slots move the process-wide and per-device
// mapped-bytes gauges from inside their own lock, so the totals are exact under concurrency.
class ByteGauge {
 public:
  void Add(int64_t delta) {
    int64_t now = value_.fetch_add(delta, std::memory_order_relaxed) + delta;
    int64_t peak = peak_.load(std::memory_order_relaxed);
    while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }
  int64_t value() const { return value_.load(std::memory_order_relaxed); }
  int64_t peak() const { return peak_.load(std::memory_order_relaxed); }
  void ResetPeak() { peak_.store(value(), std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> value_{0}, peak_{0};
};

// Capability and granularity, checked once per (backend, device, location) and cached.
Status CheckCapability(Backend b, int device, const Location& loc);
Status Granularity(Backend b, int device, const Location& loc, size_t* out);

class Slot {
 public:
  // reserve -> create -> map -> one access grant. On failure everything done is rolled back; if the
  // rollback itself fails, *remains receives the half-built slot so the caller can quarantine it.
  // `gauges` (may be empty) follow the bytes of physical memory attached to the slot.
  static Status Create(int64_t id, const SlotSpec& spec, std::vector<ByteGauge*> gauges,
                       std::shared_ptr<Slot>* out, std::shared_ptr<Slot>* remains);

  Status Release();   // unmap + release; the VA stays reserved
  Status Remap();     // create + map + access at the same VA; generation + 1
  Status Teardown();  // unmap -> release -> free, each stage committed; a retry resumes
  Status Write(size_t offset, const void* src, size_t n);
  Status Read(size_t offset, void* dst, size_t n);

  SlotInfo Info() const;
  int64_t id() const { return id_; }
  CUdeviceptr address() const { return address_; }
  size_t size() const { return size_; }
  const SlotSpec& spec() const { return spec_; }

  ~Slot();

 private:
  Slot(int64_t id, const SlotSpec& spec) : id_(id), spec_(spec) {}
  Status MapPages(const char* stage);   // create + map + access; rolls back its own partial work
  Status DropPages(const char* stage);  // unmap + release whatever is attached
  Status CheckAccessible(size_t offset, size_t n, const char* stage) const;
  template <typename Copy>
  Status CopyIO(const char* stage, size_t offset, size_t n, Entry entry, Copy copy);  // Read/Write
  void Remember(const Status& st);
  void Account();  // moves the gauges to the bytes attached now; caller holds mu_

  const int64_t id_;
  const SlotSpec spec_;
  CUdeviceptr address_ = 0;  // fixed for the slot's life once reserved
  size_t size_ = 0;

  mutable std::mutex mu_;  // guards everything below; driver calls for this slot run under it
  Reservation va_;
  PhysicalMemory pages_;
  Mapping mapping_;
  bool accessible_ = false;
  SlotState state_ = SlotState::kReleased;
  uint64_t generation_ = 0;
  std::string last_error_;
  std::vector<ByteGauge*> gauges_;
  int64_t accounted_ = 0;
};

}  // namespace jaxvmm
