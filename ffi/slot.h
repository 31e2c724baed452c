// Slot: a fixed virtual address range whose physical pages can be released and mapped again at the
// same address. No XLA, no Python. See DESIGN.md for the state machine.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "driver.h"
#include "share.h"
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
  CUmemAllocationHandleType handle_types = CU_MEM_HANDLE_TYPE_NONE;  // exportable as (POSIX FD, FABRIC)
  bool map_on_create = true;  // false: reserve only; the slot starts RELEASED (staging slots)
  bool internal = false;      // jaxvmm's own (the offload engine's staging slots), not the user's:
                              // accounted apart in stats() so a user's leak check is not disturbed
};

// What an importer maps: another process's pages, named by a shareable handle.
struct ImportSource {
  CUmemAllocationHandleType type = CU_MEM_HANDLE_TYPE_NONE;
  int fd = -1;                    // POSIX_FILE_DESCRIPTOR: borrowed for the call, never closed by the slot
  CUmemFabricHandle fabric = {};  // FABRIC
  size_t alignment = 0;           // the exporter's granularity (the reservation is aligned to it too)
  uint64_t generation = 0;        // the exporter's generation the handle was exported at
};

// What Slot::Export hands out. Every descriptor in it is new and owned by the caller.
struct ExportedHandle {
  CUmemAllocationHandleType type = CU_MEM_HANDLE_TYPE_NONE;
  int fd = -1;                    // POSIX_FILE_DESCRIPTOR
  CUmemFabricHandle fabric = {};  // FABRIC
  int channel_fd = -1;            // the exporter's generation channel (share.h)
  uint64_t generation = 0;
  size_t size = 0;
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
  bool imported;        // maps another process's pages (Slot::Import)
  int handle_types;     // CUmemAllocationHandleType bits the pages can be exported as
  int64_t views;        // live zero-copy views
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
// The host NUMA node nearest `device` (CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID; node 0 where the driver names
// none), checked like CheckCapability: where host pages the device may map live.
Status HostNumaLocation(Backend b, int device, Location* out);
// Whether pages at `loc` can be created exportable as `type` (POSIX FD, FABRIC): the device attribute, then
// one granule created and released with that handle type requested. Cached like CheckCapability.
Status CheckShareable(Backend b, int device, const Location& loc, CUmemAllocationHandleType type);
const char* ShareableName(CUmemAllocationHandleType t);  // "posix_fd", "fabric

class Slot {
 public:
  // reserve -> create -> map -> one access grant. On failure everything done is rolled back; if the
  // rollback itself fails, *remains receives the half-built slot so the caller can quarantine it.
  // `gauges` (may be empty) follow the bytes of physical memory attached to the slot.
  static Status Create(int64_t id, const SlotSpec& spec, std::vector<ByteGauge*> gauges,
                       std::shared_ptr<Slot>* out, std::shared_ptr<Slot>* remains);

  // reserve -> import -> map -> one access grant, at a new fixed VA of this process; rolls back exactly
  // like Create. An imported slot cannot be released or remapped (its pages are the exporter's): close it.
  static Status Import(int64_t id, const SlotSpec& spec, const ImportSource& src, std::vector<ByteGauge*> gauges,
                       std::shared_ptr<Slot>* out, std::shared_ptr<Slot>* remains);
  // A shareable handle of the mapped pages (spec.handle_types must include `type`) plus a descriptor of
  // the generation channel. Nothing is left open on failure.
  Status Export(CUmemAllocationHandleType type, ExportedHandle* out);
  // Zero-copy views: AddView succeeds only while the pages are mapped and [offset, offset+n) lies inside
  // the slot; while any view lives, Release and Teardown are refused (kState). DropView never fails.
  Status AddView(size_t offset, size_t n);
  void DropView();
  int64_t views() const { return views_.load(); }
  // The Python object is gone while views live: whoever drops the last view closes the slot.
  void RequestCloseWhenUnviewed() { close_when_unviewed_.store(true); }
  bool close_when_unviewed() const { return close_when_unviewed_.load(); }

  Status Release();   // unmap + release; the VA stays reserved
  // create + map + access at the same VA; generation + 1. `where` (null: spec().location) puts the pages
  // elsewhere for this mapping only, e.g. on the host when the device has no memory left; the device's
  // access grant is the same.
  Status Remap(const Location* where = nullptr);
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
  Status MapPages(const char* stage, const Location& where);  // create (or import) + map + access; rolls back its own partial work
  Status CheckNoViews(const char* stage) const;  // caller holds mu_
  static Status Build(int64_t id, const SlotSpec& spec, const ImportSource* src, std::vector<ByteGauge*> gauges,
                      std::shared_ptr<Slot>* out, std::shared_ptr<Slot>* remains);
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
  const ImportSource* import_ = nullptr;  // set only during Import (the descriptor is borrowed)
  bool imported_ = false;
  bool import_counted_ = false;
  Location imported_location_;            // where the exporter's pages live (from the handle)
  Location mapped_location_;   // where the pages mapped now live (spec_.location unless Remap moved them)
  ExportChannel channel_;                 // exporters only (spec.handle_types != NONE)
  std::atomic<int64_t> views_{0};
  std::atomic<bool> close_when_unviewed_{false};
};

}  // namespace jaxvmm
