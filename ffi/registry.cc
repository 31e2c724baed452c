#include "registry.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>

namespace jaxvmm {

namespace {
constexpr auto kRetryInterval = std::chrono::milliseconds(100);
std::pair<int, int> DeviceKey(const Slot& s) { return {static_cast<int>(s.spec().backend), s.spec().device}; }

// Memory mappings. Linux refuses a process more than vm.max_map_count of them (65,530 by default), and
// past that every mmap of the process fails: a thread XLA starts, the compiler's code. A slot takes
// about two (its reservation and its mapped pages; the driver's own for device memory). A slot is
// refused while the process still has kMapHeadroom of them, with a message that names the limit.
constexpr int64_t kMapsPerSlot = 2;
int64_t MapHeadroom(int64_t limit) { return std::max<int64_t>(4096, limit / 16); }

int64_t MaxMapCount() {  // 0: no such limit here (not Linux)
  static const int64_t limit = [] {
    std::ifstream f("/proc/sys/vm/max_map_count");
    int64_t n = 0;
    return (f >> n) ? n : int64_t{0};
  }();
  return limit;
}

int64_t ProcessMaps() {  // -1 if /proc/self/maps cannot be read
  std::ifstream f("/proc/self/maps");
  if (!f) return -1;
  int64_t n = 0;
  std::string line;
  while (std::getline(f, line)) ++n;
  return n;
}
}  // namespace

Status Registry::CheckMapHeadroom(int64_t id) {
  const int64_t limit = MaxMapCount();
  if (limit <= 0) return Status();
  std::lock_guard<std::mutex> lock(maps_mu_);
  const int64_t slots = static_cast<int64_t>(SlotsHeld());
  // Far from the limit by jaxvmm's own count: no need to read /proc/self/maps (~3 ms per 10,000
  // mappings). Near it, the process's count, estimated between reads as the last count plus
  // kMapsPerSlot per slot created since: read again once those slots have used a quarter of what the
  // last count left, and before refusing.
  const int64_t headroom = MapHeadroom(limit);
  if ((slots + 1) * kMapsPerSlot < limit / 2) return Status();
  const int64_t since = slots - slots_counted_;
  int64_t estimate = maps_counted_ + since * kMapsPerSlot;
  if (maps_counted_ < 0 || since * kMapsPerSlot * 4 >= limit - headroom - maps_counted_ ||
      estimate + kMapsPerSlot > limit - headroom) {
    maps_counted_ = ProcessMaps();
    slots_counted_ = slots;
    estimate = maps_counted_;
  }
  if (estimate >= 0 && estimate + kMapsPerSlot > limit - headroom) {
    return Status(Code::kOutOfMemory,
                  "the process has " + std::to_string(estimate) + " memory mappings of vm.max_map_count=" +
                      std::to_string(limit) + " (" + std::to_string(slots) +
                      " slots open, about 2 each); jaxvmm keeps " + std::to_string(headroom) +
                      " free for the rest of the process (past the limit every mmap fails, XLA's threads included): "
                      "close slots, or raise the limit (sysctl vm.max_map_count)")
        .At(id, "create");
  }
  return Status();
}

size_t Registry::SlotsHeld() const {
  std::lock_guard<std::mutex> lock(mu_);
  return by_id_.size() + quarantine_.size();
}

Registry& Registry::Get() {
  static Registry* r = new Registry();
  return *r;
}

ByteGauge* Registry::DeviceGauge(Backend b, int device) {
  auto& g = device_mapped_[{static_cast<int>(b), device}];
  if (!g) g = std::make_unique<ByteGauge>();
  return g.get();
}

ByteGauge* Registry::OwnerGauge(bool internal, int backend, int device) {
  auto& g = owner_mapped_[{internal, backend, device}];
  if (!g) g = std::make_unique<ByteGauge>();
  return g.get();
}

void Registry::CountSlot(const Slot& s, int64_t slots, int64_t reserved_bytes) {
  DeviceStats& d = devices_[DeviceKey(s)];
  SlotCounts& o = s.spec().internal ? d.internal : d.user;
  d.slots += slots;
  d.reserved_bytes += reserved_bytes;
  o.slots += slots;
  o.reserved_bytes += reserved_bytes;
}

Status Registry::Create(const SlotSpec& spec, int64_t* id) { return Add(spec, nullptr, id); }

Status Registry::Import(const SlotSpec& spec, const ImportSource& src, int64_t* id) { return Add(spec, &src, id); }

Status Registry::Add(const SlotSpec& spec, const ImportSource* src, int64_t* id) {
  MaybeRetryQuarantine();
  int64_t new_id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    new_id = next_id_++;
  }
  JAXVMM_RETURN_IF_ERROR(CheckMapHeadroom(new_id));
  std::vector<ByteGauge*> gauges;
  {
    std::lock_guard<std::mutex> lock(mu_);
    gauges = {&mapped_, DeviceGauge(spec.backend, spec.device), OwnerGauge(spec.internal, -1, -1),
              OwnerGauge(spec.internal, static_cast<int>(spec.backend), spec.device)};
  }
  std::shared_ptr<Slot> slot, remains;
  Status st = src ? Slot::Import(new_id, spec, *src, gauges, &slot, &remains)
                  : Slot::Create(new_id, spec, gauges, &slot, &remains);
  if (!st.ok()) {
    if (remains) Quarantine(remains, st, false);
    return st;
  }
  std::lock_guard<std::mutex> lock(mu_);
  by_id_[new_id] = slot;
  by_base_[slot->address()] = new_id;
  ++created_;
  CountSlot(*slot, 1, static_cast<int64_t>(slot->size()));
  *id = new_id;
  return Status();
}

Status Registry::Lookup(int64_t id, std::shared_ptr<Slot>* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return Status(Code::kNotFound, "no open slot with this id (closed?)").At(id, "lookup");
  *out = it->second;
  return Status();
}

Status Registry::FindRange(CUdeviceptr base, size_t length, int64_t* id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_base_.find(base);
  char where[64];
  std::snprintf(where, sizeof(where), "0x%llx+%zu", static_cast<unsigned long long>(base), length);
  if (it == by_base_.end())
    return Status(Code::kNotFound, std::string("no slot starts at ") + where + " (ranges must match exactly)");
  const Slot& s = *by_id_.at(it->second);
  if (length != 0 && length != s.size())
    return Status(Code::kNotFound, std::string("range ") + where + " does not match slot " +
                                       std::to_string(it->second) + " of " + std::to_string(s.size()) + " bytes");
  *id = it->second;
  return Status();
}

Status Registry::Release(int64_t id) {
  std::shared_ptr<Slot> slot;
  JAXVMM_RETURN_IF_ERROR(Lookup(id, &slot));
  Status st = slot->Release();
  std::lock_guard<std::mutex> lock(mu_);
  if (st.ok()) ++releases_;
  return st;
}

Status Registry::Remap(int64_t id) { return RemapAt(id, nullptr); }

Status Registry::RemapAt(int64_t id, const Location& where) { return RemapAt(id, &where); }

Status Registry::RemapAt(int64_t id, const Location* where) {
  std::shared_ptr<Slot> slot;
  JAXVMM_RETURN_IF_ERROR(Lookup(id, &slot));
  Status st = slot->Remap(where);
  std::lock_guard<std::mutex> lock(mu_);
  if (st.ok()) ++remaps_;
  return st;
}

Status Registry::Close(int64_t id) {
  std::shared_ptr<Slot> slot;
  {
    // Unregister first: a slot whose teardown gets stuck must never be handed out again.
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_id_.find(id);
    if (it == by_id_.end()) return Status(Code::kNotFound, "no open slot with this id (already closed?)").At(id, "close");
    slot = it->second;
    if (slot->views() > 0) {
      Status busy = Status(Code::kState, std::to_string(slot->views()) +
                                             " zero-copy view(s) (jax.Array from Slot.as_array) still alias the "
                                             "slot's pages; delete them first (the slot stays open)")
                        .At(id, "close");
      return busy;
    }
    by_id_.erase(it);
    by_base_.erase(slot->address());
    CountSlot(*slot, -1, 0);
  }
  Status st = slot->Teardown();
  std::lock_guard<std::mutex> lock(mu_);
  if (st.ok()) {
    CountSlot(*slot, 0, -static_cast<int64_t>(slot->size()));
    ++closed_;
    return st;
  }
  quarantine_.push_back(Quarantined{slot, 1, true});
  std::fprintf(stderr, "%s; quarantined, will be retried (see jaxvmm.stats()['quarantine'])\n", st.ToString().c_str());
  return Status(st).WithCode(Code::kQuarantined).Append("; the slot was quarantined and its teardown will be retried");
}

void Registry::Quarantine(std::shared_ptr<Slot> slot, const Status& why, bool registered) {
  std::lock_guard<std::mutex> lock(mu_);
  CountSlot(*slot, 0, static_cast<int64_t>(slot->size()));
  quarantine_.push_back(Quarantined{std::move(slot), 1, registered});
  std::fprintf(stderr, "%s; remains quarantined, will be retried\n", why.ToString().c_str());
}

void Registry::MaybeRetryQuarantine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (quarantine_.empty() || std::chrono::steady_clock::now() - last_retry_ < kRetryInterval) return;
  }
  RetryQuarantine();
}

size_t Registry::RetryQuarantine() {
  std::vector<Quarantined> batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    batch.swap(quarantine_);
    last_retry_ = std::chrono::steady_clock::now();
  }
  std::vector<Quarantined> still;
  for (auto& q : batch) {
    Status st = q.slot->Teardown();  // resumes where the last attempt stopped
    std::lock_guard<std::mutex> lock(mu_);
    if (st.ok()) {
      CountSlot(*q.slot, 0, -static_cast<int64_t>(q.slot->size()));
      if (q.registered) ++closed_;
    } else {
      ++q.attempts;
      still.push_back(std::move(q));
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& q : still) quarantine_.push_back(std::move(q));
  return quarantine_.size();
}

void Registry::CloseAll() {
  std::vector<int64_t> ids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, slot] : by_id_) ids.push_back(id);
  }
  for (int64_t id : ids) Close(id);
  RetryQuarantine();
}

void Registry::ResetPeak() {
  std::lock_guard<std::mutex> lock(mu_);
  mapped_.ResetPeak();
  for (auto& [key, g] : device_mapped_) g->ResetPeak();
  for (auto& [key, g] : owner_mapped_) g->ResetPeak();
}

const ByteGauge* Registry::MappedGauge(Backend b, int device, bool internal_only) {
  std::lock_guard<std::mutex> lock(mu_);
  return internal_only ? OwnerGauge(true, static_cast<int>(b), device) : DeviceGauge(b, device);
}

RegistryStats Registry::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  RegistryStats s;
  s.slots = static_cast<int64_t>(by_id_.size());
  for (const auto& [key, d] : devices_) s.reserved_bytes += d.reserved_bytes;
  s.mapped_bytes = mapped_.value();
  s.peak_mapped_bytes = mapped_.peak();
  s.created = created_;
  s.closed = closed_;
  s.releases = releases_;
  s.remaps = remaps_;
  s.devices = devices_;
  for (const auto& [key, g] : device_mapped_) {
    s.devices[key].mapped_bytes = g->value();
    s.devices[key].peak_mapped_bytes = g->peak();
  }
  for (const auto& [key, d] : devices_) {
    for (SlotCounts* o : {&s.user, &s.internal}) {
      const SlotCounts& from = o == &s.user ? d.user : d.internal;
      o->slots += from.slots;
      o->reserved_bytes += from.reserved_bytes;
    }
  }
  for (const auto& [key, g] : owner_mapped_) {
    const auto& [internal, backend, device] = key;
    SlotCounts& o = internal ? s.internal : s.user;
    if (device < 0) {  // process-wide
      o.mapped_bytes = g->value();
      o.peak_mapped_bytes = g->peak();
    } else {
      SlotCounts& od = internal ? s.devices[{backend, device}].internal : s.devices[{backend, device}].user;
      od.mapped_bytes = g->value();
      od.peak_mapped_bytes = g->peak();
    }
  }
  for (const auto& q : quarantine_) {
    SlotInfo i = q.slot->Info();
    s.quarantine.push_back(
        QuarantineEntry{i.id, i.backend, i.device, i.address, i.size, i.mapped_bytes, i.last_error, q.attempts});
  }
  return s;
}

}  // namespace jaxvmm
