// Registry: every live slot by id and by its exact (base, length), plus the quarantine of slots whose
// teardown failed. Lock order: the GIL (if any) -> Registry::mu_ -> Slot::mu_. Registry::mu_ is never
// held across a driver call, so a slow or failing teardown never blocks creating unrelated slots.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "slot.h"
#include "stat_fields.h"

namespace jaxvmm {

struct QuarantineEntry {
  int64_t id;
  Backend backend;
  int device;
  CUdeviceptr address;
  size_t size;
  size_t mapped_bytes;
  std::string error;
  int attempts;
};

// Slot counts and bytes of one owner (the user's slots, or jaxvmm's internal staging slots).
struct SlotCounts {
  int64_t slots = 0;
  int64_t reserved_bytes = 0;
  int64_t mapped_bytes = 0;
  int64_t peak_mapped_bytes = 0;
};

// stats() keys (and of each device, each owner).
inline constexpr StatField<SlotCounts> kSlotCountsFields[] = {
    {"slots", &SlotCounts::slots},
    {"reserved_bytes", &SlotCounts::reserved_bytes},
    {"mapped_bytes", &SlotCounts::mapped_bytes},
    {"peak_mapped_bytes", &SlotCounts::peak_mapped_bytes},
};

struct DeviceStats {  // totals over both owners, then each owner
  int64_t slots = 0;
  int64_t reserved_bytes = 0;
  int64_t mapped_bytes = 0;
  int64_t peak_mapped_bytes = 0;
  SlotCounts user, internal;
};

// stats()["devices"] keys.
inline constexpr StatField<DeviceStats> kDeviceStatsFields[] = {
    {"slots", &DeviceStats::slots},
    {"reserved_bytes", &DeviceStats::reserved_bytes},
    {"mapped_bytes", &DeviceStats::mapped_bytes},
    {"peak_mapped_bytes", &DeviceStats::peak_mapped_bytes},
};

struct RegistryStats {
  int64_t slots = 0;
  int64_t reserved_bytes = 0;   // live slots and quarantined reservations
  int64_t mapped_bytes = 0;     // physical bytes attached to live or quarantined slots
  int64_t peak_mapped_bytes = 0;
  int64_t created = 0, closed = 0, releases = 0, remaps = 0;
  SlotCounts user, internal;  // the same, split by SlotSpec::internal (peaks are per owner)
  std::vector<QuarantineEntry> quarantine;
  std::map<std::pair<int, int>, DeviceStats> devices;  // (backend, device)
};

// stats() keys.
inline constexpr StatField<RegistryStats> kRegistryStatsFields[] = {
    {"slots", &RegistryStats::slots},
    {"reserved_bytes", &RegistryStats::reserved_bytes},
    {"mapped_bytes", &RegistryStats::mapped_bytes},
    {"peak_mapped_bytes", &RegistryStats::peak_mapped_bytes},
    {"created", &RegistryStats::created},
    {"closed", &RegistryStats::closed},
    {"releases", &RegistryStats::releases},
    {"remaps", &RegistryStats::remaps},
};

class Registry {
 public:
  static Registry& Get();  // never destroyed

  Status Create(const SlotSpec& spec, int64_t* id);
  // Maps another process's pages (Slot::Import) as a new slot of this process.
  Status Import(const SlotSpec& spec, const ImportSource& src, int64_t* id);
  Status Lookup(int64_t id, std::shared_ptr<Slot>* out) const;
  // Exact provenance: succeeds only for the (base, length) a slot reserved. `length` 0 means the slot's size.
  Status FindRange(CUdeviceptr base, size_t length, int64_t* id) const;

  Status Release(int64_t id);
  Status Remap(int64_t id);
  Status RemapAt(int64_t id, const Location& where);  // pages at `where` for this mapping (Slot::Remap)
  // Removes the slot first (it is never handed out again), then tears it down; on failure the remains
  // go to the quarantine, the failure is logged once, and a kQuarantined status is returned. A slot with
  // live zero-copy views is refused (kState) and stays open.
  Status Close(int64_t id);
  // Retries quarantined teardowns now; returns how many are still quarantined.
  size_t RetryQuarantine();
  // Closes every slot (interpreter exit). Failures end in the quarantine.
  void CloseAll();

  RegistryStats Stats() const;
  void ResetPeak();  // peak_mapped_bytes := mapped_bytes, process-wide and per device
  // The live mapped-bytes gauge of (b, device): every slot, or jaxvmm's internal ones only (staging and
  // graph-mode cells). The pointer stays valid for the process's life (the registry is never destroyed);
  // reading it takes no lock (the memory sampler reads it every ~100 us).
  const ByteGauge* MappedGauge(Backend b, int device, bool internal_only);

 private:
  Status RemapAt(int64_t id, const Location* where);  // null: the slot's own location
  Registry() = default;
  void Quarantine(std::shared_ptr<Slot> slot, const Status& why, bool registered);
  Status Add(const SlotSpec& spec, const ImportSource* src, int64_t* id);
  ByteGauge* DeviceGauge(Backend b, int device);  // caller holds mu_
  ByteGauge* OwnerGauge(bool internal, int backend, int device);  // caller holds mu_; (-1, -1): process-wide
  void CountSlot(const Slot& s, int64_t slots, int64_t reserved_bytes);  // caller holds mu_
  void MaybeRetryQuarantine();
  // kOutOfMemory while the process is within the headroom of vm.max_map_count (registry.cc). Takes
  // maps_mu_, then mu_.
  Status CheckMapHeadroom(int64_t id);
  size_t SlotsHeld() const;  // open and quarantined slots; takes mu_

  mutable std::mutex mu_;
  int64_t next_id_ = 1;
  std::map<int64_t, std::shared_ptr<Slot>> by_id_;
  std::map<CUdeviceptr, int64_t> by_base_;
  struct Quarantined {
    std::shared_ptr<Slot> slot;
    int attempts;
    bool registered;  // false: remains of a create that never succeeded (not counted as closed)
  };
  std::vector<Quarantined> quarantine_;
  std::chrono::steady_clock::time_point last_retry_{};
  int64_t created_ = 0, closed_ = 0, releases_ = 0, remaps_ = 0;
  ByteGauge mapped_;
  std::map<std::pair<int, int>, std::unique_ptr<ByteGauge>> device_mapped_;
  std::map<std::pair<int, int>, DeviceStats> devices_;  // slots and reserved bytes (total, user, internal)
  // mapped bytes per owner: key (internal, backend, device); (internal, -1, -1) is the process-wide gauge
  std::map<std::tuple<bool, int, int>, std::unique_ptr<ByteGauge>> owner_mapped_;
  // Lock order: maps_mu_ before mu_. The process's mappings when last counted, and the slots then.
  std::mutex maps_mu_;
  int64_t maps_counted_ = -1, slots_counted_ = 0;
};

}  // namespace jaxvmm
