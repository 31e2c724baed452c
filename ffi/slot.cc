#include "slot.h"

#include <unistd.h>

#include <map>
#include <string>
#include <tuple>

namespace jaxvmm {

const char* SlotStateName(SlotState s) {
  switch (s) {
    case SlotState::kMapped: return "mapped";
    case SlotState::kReleased: return "released";
    case SlotState::kClosing: return "closing";
    case SlotState::kClosed: return "closed";
  }
  return "unknown";
}

namespace {

CUmemAllocationProp MakeProp(const Location& loc, CUmemAllocationHandleType handle_types) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = loc.type;
  prop.location.id = loc.id;
  prop.requestedHandleTypes = handle_types;
  return prop;
}

const char* LocationName(CUmemLocationType t) {
  return t == CU_MEM_LOCATION_TYPE_HOST_NUMA ? "host_numa" : "device";
}

using CapKey = std::tuple<int, int, int, int>;  // backend, device, location type, location id
std::mutex g_cap_mu;
std::map<CapKey, Status> g_cap_cache;
std::map<CapKey, size_t> g_gran_cache;

Status CheckCapabilityUncached(Backend b, int device, const Location& loc) {
  const DriverAvailability& a = Availability(b);
  if (!a.ok) return Status(Code::kUnavailable, std::string(BackendName(b)) + " backend unavailable: " + a.reason);
  const DriverTable& d = Driver(b);
  int count = 0;
  CUresult r = d.DeviceGetCount(&count);
  if (r != CUDA_SUCCESS) return Status::Driver(r, Entry::kDeviceGetCount);
  if (device < 0 || device >= count)
    return Status(Code::kInvalidArgument, "device " + std::to_string(device) + " does not exist (" +
                                              std::to_string(count) + " " + BackendName(b) + " devices)");
  ScopedContext ctx(b, device);
  if (!ctx.status().ok()) return ctx.status();
  CUdevice dev;
  r = d.DeviceGet(&dev, device);
  if (r != CUDA_SUCCESS) return Status::Driver(r, Entry::kDeviceGet);
  auto attribute = [&](CUdevice_attribute attr, const char* name, const char* what) -> Status {
    int v = 0;
    CUresult rr = d.DeviceGetAttribute(&v, attr, dev);
    if (rr != CUDA_SUCCESS) return Status::Driver(rr, Entry::kDeviceGetAttribute);
    if (v == 0)
      return Status(Code::kNotSupported, std::string(BackendName(b)) + " device " + std::to_string(device) +
                                             " does not support " + what + " (" + name + " = 0)");
    return Status();
  };
  JAXVMM_RETURN_IF_ERROR(attribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                   "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                                   "virtual memory management"));
  if (loc.type == CU_MEM_LOCATION_TYPE_HOST_NUMA) {
    JAXVMM_RETURN_IF_ERROR(attribute(CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                     "CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                                     "HOST_NUMA virtual memory"));
    if (loc.id < 0) return Status(Code::kInvalidArgument, "host NUMA node must be >= 0");
  } else if (loc.type == CU_MEM_LOCATION_TYPE_DEVICE) {
    if (loc.id != device)
      return Status(Code::kInvalidArgument, "device-located pages must live on the owning device");
  } else {
    return Status(Code::kNotSupported, "unsupported location type " + std::to_string(loc.type));
  }
  return Status();
}

const char* HandleTypeName(CUmemAllocationHandleType t) {
  switch (t) {
    case CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: return "posix_fd";
    case CU_MEM_HANDLE_TYPE_FABRIC: return "fabric";
    default: return "unknown";
  }
}

std::map<std::tuple<int, int, int, int, int>, Status> g_share_cache;

// Proven by asking and then by trying: FABRIC can read as supported and still be refused at cuMemCreate
// (no IMEX channel: CUDA_ERROR_NOT_PERMITTED), so one granule is created and released again.
Status CheckShareableUncached(Backend b, int device, const Location& loc, CUmemAllocationHandleType type) {
  size_t g = 0;
  JAXVMM_RETURN_IF_ERROR(Granularity(b, device, loc, &g));
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR && type != CU_MEM_HANDLE_TYPE_FABRIC)
    return Status(Code::kInvalidArgument, "unsupported shareable handle type " + std::to_string(type));
  const DriverTable& d = Driver(b);
  ScopedContext ctx(b, device);
  if (!ctx.status().ok()) return ctx.status();
  CUdevice dev;
  CUresult r = d.DeviceGet(&dev, device);
  if (r != CUDA_SUCCESS) return Status::Driver(r, Entry::kDeviceGet);
  const bool fabric = type == CU_MEM_HANDLE_TYPE_FABRIC;
  const char* attr_name = fabric ? "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"
                                 : "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED";
  int v = 0;
  r = d.DeviceGetAttribute(&v, fabric ? CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED
                                      : CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev);
  if (r != CUDA_SUCCESS) return Status::Driver(r, Entry::kDeviceGetAttribute);
  const std::string what = std::string(BackendName(b)) + " device " + std::to_string(device) + " cannot export " +
                           HandleTypeName(type) + " handles";
  if (v == 0) return Status(Code::kNotSupported, what + " (" + attr_name + " = 0)");
  CUmemAllocationProp prop = MakeProp(loc, type);
  CUmemGenericAllocationHandle h = 0;
  r = d.MemCreate(&h, g, &prop, 0);
  if (r == CUDA_ERROR_NOT_PERMITTED || r == CUDA_ERROR_NOT_SUPPORTED || r == CUDA_ERROR_INVALID_VALUE) {
    std::string why = fabric ? "; fabric handles need an IMEX channel (/dev/nvidia-caps-imex-channels) and a "
                               "system that permits them"
                             : "";
    return Status::Driver(r, Entry::kMemCreate)
        .WithCode(Code::kNotSupported)
        .Append(std::string(" (") + what + ": " + attr_name + " = 1, but the driver refused cuMemCreate with this "
                "handle type" + why + ")");
  }
  if (r != CUDA_SUCCESS) return Status::Driver(r, Entry::kMemCreate);
  r = d.MemRelease(h);
  if (r != CUDA_SUCCESS) return Status::Driver(r, Entry::kMemRelease);
  return Status();
}

}  // namespace

const char* ShareableName(CUmemAllocationHandleType t) { return HandleTypeName(t); }

Status CheckShareable(Backend b, int device, const Location& loc, CUmemAllocationHandleType type) {
  std::tuple<int, int, int, int, int> key{static_cast<int>(b), device, static_cast<int>(loc.type), loc.id,
                                          static_cast<int>(type)};
  {
    std::lock_guard<std::mutex> lock(g_cap_mu);
    auto it = g_share_cache.find(key);
    if (it != g_share_cache.end()) return it->second;
  }
  Status st = CheckShareableUncached(b, device, loc, type);
  if (st.ok() || st.code() == Code::kNotSupported || st.code() == Code::kInvalidArgument ||
      st.code() == Code::kUnavailable) {
    std::lock_guard<std::mutex> lock(g_cap_mu);
    g_share_cache[key] = st;
  }
  return st;
}

Status CheckCapability(Backend b, int device, const Location& loc) {
  CapKey key{static_cast<int>(b), device, static_cast<int>(loc.type), loc.id};
  {
    std::lock_guard<std::mutex> lock(g_cap_mu);
    auto it = g_cap_cache.find(key);
    if (it != g_cap_cache.end()) return it->second;
  }
  Status st = CheckCapabilityUncached(b, device, loc);
  // Driver hiccups are not cached; answers about the hardware are.
  if (st.ok() || st.code() == Code::kNotSupported || st.code() == Code::kInvalidArgument ||
      st.code() == Code::kUnavailable) {
    std::lock_guard<std::mutex> lock(g_cap_mu);
    g_cap_cache[key] = st;
  }
  return st;
}

Status Granularity(Backend b, int device, const Location& loc, size_t* out) {
  JAXVMM_RETURN_IF_ERROR(CheckCapability(b, device, loc));
  CapKey key{static_cast<int>(b), device, static_cast<int>(loc.type), loc.id};
  {
    std::lock_guard<std::mutex> lock(g_cap_mu);
    auto it = g_gran_cache.find(key);
    if (it != g_gran_cache.end()) {
      *out = it->second;
      return Status();
    }
  }
  ScopedContext ctx(b, device);
  if (!ctx.status().ok()) return ctx.status();
  CUmemAllocationProp prop = MakeProp(loc, CU_MEM_HANDLE_TYPE_NONE);
  size_t g = 0;
  const DriverTable& d = Driver(b);
  CUresult r = d.MemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDA_SUCCESS) return Status::Driver(r, Entry::kMemGetAllocationGranularity);
  if (g == 0 || (g & (g - 1)) != 0) return Status(Code::kInternal, "driver granularity is not a power of two");
  std::lock_guard<std::mutex> lock(g_cap_mu);
  g_gran_cache[key] = g;
  *out = g;
  return Status();
}

Status HostNumaLocation(Backend b, int device, Location* out) {
  {
    ScopedContext ctx(b, device);
    JAXVMM_RETURN_IF_ERROR(ctx.status());
    const DriverTable& d = Driver(b);
    CUdevice dev;
    JAXVMM_RETURN_IF_ERROR(Call(-1, "host NUMA node", Entry::kDeviceGet, [&] { return d.DeviceGet(&dev, device); }));
    int node = -1;
    if (d.DeviceGetAttribute(&node, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, dev) != CUDA_SUCCESS || node < 0) node = 0;
    *out = Location{CU_MEM_LOCATION_TYPE_HOST_NUMA, node};
  }
  return CheckCapability(b, device, *out);
}

// ---- lifecycle ----
Status Slot::Create(int64_t id, const SlotSpec& spec, std::vector<ByteGauge*> gauges, std::shared_ptr<Slot>* out,
                    std::shared_ptr<Slot>* remains) {
  return Build(id, spec, nullptr, std::move(gauges), out, remains);
}

Status Slot::Import(int64_t id, const SlotSpec& spec, const ImportSource& src, std::vector<ByteGauge*> gauges,
                    std::shared_ptr<Slot>* out, std::shared_ptr<Slot>* remains) {
  return Build(id, spec, &src, std::move(gauges), out, remains);
}

Status Slot::Build(int64_t id, const SlotSpec& spec_in, const ImportSource* src, std::vector<ByteGauge*> gauges,
                   std::shared_ptr<Slot>* out, std::shared_ptr<Slot>* remains) {
  const char* kStage = src ? "import" : "create";
  SlotSpec spec = spec_in;
  if (spec.access.empty()) spec.access.push_back(spec.device);
  if (src) {
    spec.handle_types = src->type;
    spec.map_on_create = true;
    spec.internal = false;
  }
  if (spec.nbytes == 0) return Status(Code::kInvalidArgument, "nbytes must be > 0").At(id, kStage);
  size_t g = 0;
  Status st = Granularity(spec.backend, spec.device, spec.location, &g);
  if (!st.ok()) return st.At(id, kStage);
  if (spec.nbytes > (size_t{1} << 48)) return Status(Code::kInvalidArgument, "nbytes exceeds 2**48").At(id, kStage);
  if (src) {
    if (src->alignment == 0 || (src->alignment & (src->alignment - 1)) != 0 || spec.nbytes % src->alignment != 0)
      return Status(Code::kInvalidArgument, "the handle's size " + std::to_string(spec.nbytes) +
                                                " is not a multiple of its granularity " +
                                                std::to_string(src->alignment))
          .At(id, kStage);
    if (src->alignment > g) g = src->alignment;
    if (spec.nbytes % g != 0)
      return Status(Code::kInvalidArgument, "the handle's size " + std::to_string(spec.nbytes) +
                                                " is not a multiple of this device's granularity " + std::to_string(g))
          .At(id, kStage);
  } else if (spec.handle_types != CU_MEM_HANDLE_TYPE_NONE) {
    st = CheckShareable(spec.backend, spec.device, spec.location, spec.handle_types);
    if (!st.ok()) return st.At(id, kStage);
  }
  for (int dev : spec.access) {
    Status a = CheckCapability(spec.backend, dev, Location{CU_MEM_LOCATION_TYPE_DEVICE, dev});
    if (!a.ok()) return a.Append(" (access list)").At(id, kStage);
  }
  ScopedContext ctx(spec.backend, spec.device);
  if (!ctx.status().ok()) return Status(ctx.status()).At(id, kStage);

  std::shared_ptr<Slot> slot(new Slot(id, spec));
  std::lock_guard<std::mutex> lock(slot->mu_);
  slot->gauges_ = std::move(gauges);
  slot->size_ = (spec.nbytes + g - 1) / g * g;
  slot->imported_ = src != nullptr;
  slot->import_ = src;
  if (!src && spec.handle_types != CU_MEM_HANDLE_TYPE_NONE) st = slot->channel_.Open(id);
  if (st.ok()) st = slot->va_.Reserve(spec.backend, slot->size_, g, id, kStage);
  if (st.ok()) {
    slot->address_ = slot->va_.base();
    if (spec.map_on_create) st = slot->MapPages(kStage, spec.location);
  }
  slot->import_ = nullptr;
  if (!st.ok()) {
    slot->Remember(st);
    Status undo = slot->DropPages("create rollback");
    if (undo.ok()) undo = slot->va_.Free(id, "create rollback");
    slot->Account();
    if (!undo.ok()) {
      slot->state_ = SlotState::kClosing;
      slot->Remember(undo);
      *remains = slot;
      st.Append(std::string("; rollback failed and was quarantined (") + undo.message() + ")");
    } else {
      slot->state_ = SlotState::kClosed;
    }
    return st;
  }
  slot->Account();
  slot->generation_ = src ? src->generation : spec.map_on_create ? 1 : 0;
  slot->state_ = spec.map_on_create ? SlotState::kMapped : SlotState::kReleased;
  slot->channel_.Publish(slot->state_ == SlotState::kMapped ? slot->generation_ : 0);
  if (src) {
    slot->import_counted_ = true;
    CountImport(+1);
  }
  *out = slot;
  return Status();
}

Status Slot::MapPages(const char* stage, const Location& where) {
  const SlotSpec& s = spec_;
  Status st;
  if (import_ == nullptr) {
    st = pages_.Create(s.backend, size_, MakeProp(where, s.handle_types), id_, stage);
  } else {
    void* os_handle = import_->type == CU_MEM_HANDLE_TYPE_FABRIC
                          ? const_cast<void*>(static_cast<const void*>(&import_->fabric))
                          : reinterpret_cast<void*>(static_cast<intptr_t>(import_->fd));
    st = pages_.Import(s.backend, os_handle, import_->type, id_, stage);
    if (st.ok()) {
      // Where the exporter's pages live, and whether they really are exportable as this type.
      CUmemAllocationProp prop = {};
      st = Call(id_, stage, Entry::kMemGetAllocationPropertiesFromHandle,
                [&] { return Driver(s.backend).MemGetAllocationPropertiesFromHandle(&prop, pages_.handle()); });
      // (A driver that reports no requested types for an imported handle is not second-guessed.)
      if (st.ok() && prop.requestedHandleTypes != 0 && (prop.requestedHandleTypes & import_->type) == 0)
        st = Status(Code::kInvalidArgument, std::string("the imported allocation was not created exportable as ") +
                                                HandleTypeName(import_->type))
                 .At(id_, stage);
      if (st.ok()) imported_location_ = Location{prop.location.type, prop.location.id};
    }
  }
  if (st.ok()) st = mapping_.Map(s.backend, address_, size_, pages_.handle(), id_, stage);
  if (st.ok()) st = GrantAccess(s.backend, address_, size_, s.access, id_, stage);
  if (!st.ok()) {
    // Undo this stage's partial work; what cannot be undone stays owned for Teardown to finish.
    Status undo = DropPages(stage);
    if (!undo.ok()) st.Append(std::string("; rollback incomplete: ") + undo.message());
    return st;
  }
  accessible_ = true;
  mapped_location_ = where;
  return Status();
}

Status Slot::DropPages(const char* stage) {
  accessible_ = false;
  JAXVMM_RETURN_IF_ERROR(mapping_.Unmap(id_, stage));
  return pages_.Release(id_, stage);
}

void Slot::Remember(const Status& st) { last_error_ = st.ToString(); }

void Slot::Account() {
  int64_t now = pages_.owned() || mapping_.owned() ? static_cast<int64_t>(size_) : 0;
  if (now == accounted_) return;
  for (ByteGauge* g : gauges_) g->Add(now - accounted_);
  accounted_ = now;
}

Status Slot::Release() {
  constexpr const char* kStage = "release";
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ != SlotState::kMapped)
    return Status(Code::kState, std::string("cannot release a ") + SlotStateName(state_) + " slot").At(id_, kStage);
  if (imported_)
    return Status(Code::kState, "an imported slot maps the exporter's pages and cannot be released; close it "
                                "(and import a new handle after the exporter remaps)")
        .At(id_, kStage);
  JAXVMM_RETURN_IF_ERROR(CheckNoViews(kStage));
  ScopedContext ctx(spec_.backend, spec_.device);
  if (!ctx.status().ok()) return Status(ctx.status()).At(id_, kStage);
  channel_.Publish(0);  // importers are stale from here on, whatever happens next
  Status st = DropPages(kStage);
  Account();
  if (!mapping_.owned()) state_ = SlotState::kReleased;  // pages gone from the VA even if the handle lingers
  if (state_ == SlotState::kMapped) channel_.Publish(generation_);  // nothing was unmapped after all
  if (!st.ok()) {
    if (state_ == SlotState::kReleased) st.Append("; the handle is released again on the next remap or close");
    Remember(st);
  }
  return st;
}

Status Slot::Remap(const Location* where) {
  constexpr const char* kStage = "remap";
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ != SlotState::kReleased)
    return Status(Code::kState, std::string("cannot remap a ") + SlotStateName(state_) + " slot").At(id_, kStage);
  ScopedContext ctx(spec_.backend, spec_.device);
  if (!ctx.status().ok()) return Status(ctx.status()).At(id_, kStage);
  Status st = DropPages(kStage);  // finish what an earlier failed release left behind
  if (st.ok()) st = MapPages(kStage, where ? *where : spec_.location);
  Account();
  if (!st.ok()) {
    Remember(st);
    return st;
  }
  if (mapping_.base() != va_.base() || address_ != va_.base())
    return Status(Code::kInternal, "remapped pages landed off the slot's address").At(id_, kStage);
  ++generation_;
  state_ = SlotState::kMapped;
  channel_.Publish(generation_);
  return Status();
}

Status Slot::Teardown() {
  constexpr const char* kStage = "close";
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ == SlotState::kClosed) return Status();
  JAXVMM_RETURN_IF_ERROR(CheckNoViews(kStage));
  state_ = SlotState::kClosing;
  channel_.MarkClosed();
  ScopedContext ctx(spec_.backend, spec_.device);
  if (!ctx.status().ok()) return Status(ctx.status()).At(id_, kStage);
  Status st = DropPages(kStage);
  Account();
  if (st.ok()) st = va_.Free(id_, kStage);
  if (!st.ok()) {
    Remember(st);
    return st;
  }
  state_ = SlotState::kClosed;
  if (import_counted_) {
    import_counted_ = false;
    CountImport(-1);
  }
  return Status();
}

Status Slot::CheckNoViews(const char* stage) const {
  int64_t n = views_.load();
  if (n == 0) return Status();
  return Status(Code::kState, std::to_string(n) + " zero-copy view" + (n == 1 ? "" : "s") +
                                  " (jax.Array from Slot.as_array) still alias the slot's pages; delete them "
                                  "(del the arrays, or let them go out of scope) first")
      .At(id_, stage);
}

Status Slot::AddView(size_t offset, size_t n) {
  constexpr const char* kStage = "as_array";
  std::lock_guard<std::mutex> lock(mu_);
  JAXVMM_RETURN_IF_ERROR(CheckAccessible(offset, n, kStage));
  views_.fetch_add(1);
  CountView(+1);
  return Status();
}

void Slot::DropView() {
  views_.fetch_sub(1);
  CountView(-1);
}

Status Slot::Export(CUmemAllocationHandleType type, ExportedHandle* out) {
  constexpr const char* kStage = "export";
  std::lock_guard<std::mutex> lock(mu_);
  if (imported_)
    return Status(Code::kState, "an imported slot cannot be exported again; export from the owning process")
        .At(id_, kStage);
  if ((spec_.handle_types & type) == 0 || !channel_.open())
    return Status(Code::kState, std::string("the slot was not created shareable as ") + HandleTypeName(type) +
                                    " (pass shareable='" + HandleTypeName(type) + "' to jaxvmm.Slot)")
        .At(id_, kStage);
  if (state_ != SlotState::kMapped || !pages_.owned())
    return Status(Code::kState, std::string("the slot is ") + SlotStateName(state_) + "; remap it before exporting")
        .At(id_, kStage);
  ScopedContext ctx(spec_.backend, spec_.device);
  if (!ctx.status().ok()) return Status(ctx.status()).At(id_, kStage);
  ExportedHandle h;
  h.type = type;
  void* dst = type == CU_MEM_HANDLE_TYPE_FABRIC ? static_cast<void*>(&h.fabric) : static_cast<void*>(&h.fd);
  const DriverTable& d = Driver(spec_.backend);
  JAXVMM_RETURN_IF_ERROR(Call(id_, kStage, Entry::kMemExportToShareableHandle,
                              [&] { return d.MemExportToShareableHandle(dst, pages_.handle(), type, 0); }));
  Status st;
  h.channel_fd = channel_.Dup(&st);
  if (h.channel_fd < 0) {
    if (h.fd >= 0) close(h.fd);  // nothing stays open on failure
    return st.At(id_, kStage);
  }
  h.generation = generation_;
  h.size = size_;
  CountExport();
  *out = h;
  return Status();
}

Status Slot::CheckAccessible(size_t offset, size_t n, const char* stage) const {
  if (state_ != SlotState::kMapped)
    return Status(Code::kState, std::string("the slot is ") + SlotStateName(state_) + "; remap it first")
        .At(id_, stage);
  if (offset > spec_.nbytes || n > spec_.nbytes - offset)
    return Status(Code::kInvalidArgument, "range [" + std::to_string(offset) + ", " + std::to_string(offset + n) +
                                              ") exceeds the slot's " + std::to_string(spec_.nbytes) + " bytes")
        .At(id_, stage);
  return Status();
}

template <typename Copy>
Status Slot::CopyIO(const char* stage, size_t offset, size_t n, Entry entry, Copy copy) {
  std::lock_guard<std::mutex> lock(mu_);
  JAXVMM_RETURN_IF_ERROR(CheckAccessible(offset, n, stage));
  if (n == 0) return Status();
  ScopedContext ctx(spec_.backend, spec_.device);
  if (!ctx.status().ok()) return Status(ctx.status()).At(id_, stage);
  return Call(id_, stage, entry, [&] { return copy(Driver(spec_.backend), address_ + offset); });
}

Status Slot::Write(size_t offset, const void* src, size_t n) {
  // The bytes are visible to every stream when Write returns (CopyToDeviceNow): on the H200 a graph
  // launched on another stream right after a write read the slot's old tail.
  return CopyIO("write", offset, n, Entry::kMemcpyHtoD,
                [&](const DriverTable& d, CUdeviceptr at) { return CopyToDeviceNow(d, at, src, n); });
}

Status Slot::Read(size_t offset, void* dst, size_t n) {
  return CopyIO("read", offset, n, Entry::kMemcpyDtoH,
                [&](const DriverTable& d, CUdeviceptr at) { return d.MemcpyDtoH(dst, at, n); });
}

SlotInfo Slot::Info() const {
  std::lock_guard<std::mutex> lock(mu_);
  return SlotInfo{id_,
                  spec_.backend,
                  spec_.device,
                  imported_ ? imported_location_ : (state_ == SlotState::kMapped ? mapped_location_ : spec_.location),
                  address_,
                  spec_.nbytes,
                  size_,
                  generation_,
                  state_,
                  state_ == SlotState::kMapped,
                  pages_.owned() || mapping_.owned() ? size_ : 0,
                  last_error_,
                  imported_,
                  static_cast<int>(spec_.handle_types),
                  views_.load()};
}

Slot::~Slot() {
  // Normal paths close slots through the registry; this is the last resort at interpreter exit.
  if (state_ != SlotState::kClosed && Availability(spec_.backend).ok) {
    Status st = Teardown();
    if (!st.ok()) ReportLeak(st);
  }
}

}  // namespace jaxvmm
