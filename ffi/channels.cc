#include "channels.h"

#include <cstddef>
#include <vector>

#include "vmm.h"

namespace jaxvmm {

Status WriteDeviceWord(Backend b, CUstream s, CUdeviceptr word, uint64_t value, const char* stage) {
  const DriverTable& d = Driver(b);
  return Call(-1, stage, Entry::kStreamWriteValue64, [&] { return d.StreamWriteValue64(s, word, value, 0); });
}

ChannelTable::~ChannelTable() {
  ScopedContext ctx(backend_, device_);  // cuMemFree needs the device's context (the engine's is gone by now)
  const DriverTable& d = Driver(backend_);
  for (ChannelWords* chunk : chunks_) d.MemFreeHost(chunk);
  for (CUdeviceptr chunk : device_chunks_) d.MemFree(chunk);
}

Status ChannelTable::GetOrCreate(int64_t site, ChannelKind kind, const ArrayMeta& meta, Channel** out, bool* created) {
  *created = false;
  if (Channel* c = Find(site, kind, meta)) {
    *out = c;
    return Status();
  }
  if (used_ == chunks_.size() * kWordsPerChunk) {
    void* p = nullptr;
    JAXVMM_RETURN_IF_ERROR(Call(-1, "graph channels", Entry::kMemHostAlloc, [&] {
      return Driver(backend_).MemHostAlloc(&p, sizeof(ChannelWords) * kWordsPerChunk,
                                           CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
    }));
    auto* chunk = static_cast<ChannelWords*>(p);
    for (size_t i = 0; i < kWordsPerChunk; ++i) new (&chunk[i]) ChannelWords();
    CUdeviceptr dev = 0;
    const std::vector<DeviceWords> zeros(kWordsPerChunk, DeviceWords{});
    Status st = Call(-1, "graph channels", Entry::kMemAlloc, [&] { return Driver(backend_).MemAlloc(&dev, sizeof(DeviceWords) * kWordsPerChunk); });
    if (st.ok())
      st = Call(-1, "graph channels", Entry::kMemcpyHtoD,
                [&] { return CopyToDeviceNow(Driver(backend_), dev, zeros.data(), sizeof(DeviceWords) * kWordsPerChunk); });
    if (!st.ok()) {
      if (dev) Driver(backend_).MemFree(dev);
      Driver(backend_).MemFreeHost(chunk);
      return st;
    }
    chunks_.push_back(chunk);
    device_chunks_.push_back(dev);
  }
  auto c = std::make_unique<Channel>();
  c->kind = kind;
  c->site = site;
  c->index = static_cast<int64_t>(channels_.size());
  c->meta = meta;
  c->w = &chunks_[used_ / kWordsPerChunk][used_ % kWordsPerChunk];
  const CUdeviceptr dw = device_chunks_[used_ / kWordsPerChunk] + sizeof(DeviceWords) * (used_ % kWordsPerChunk);
  c->dw = dw;
  ++used_;
  for (auto* word : {&c->w->knock, &c->w->probe, &c->w->request, &c->w->go, &c->w->result, &c->w->scratch[0],
                     &c->w->scratch[1], &c->w->scratch[2]})
    word->store(0, std::memory_order_relaxed);
  for (int i = 0; i < kMaxCells; ++i) {
    c->w->filled[i].store(0, std::memory_order_relaxed);
    c->w->done[i].store(0, std::memory_order_relaxed);
  }
  c->last_use = std::chrono::steady_clock::now();
  *out = c.get();
  by_site_[Key{site, static_cast<int>(kind), meta.nbytes, meta.signature}] = c.get();
  channels_.push_back(std::move(c));
  *created = true;
  return Status();
}

Channel* ChannelTable::Find(int64_t site, ChannelKind kind, const ArrayMeta& meta) {
  auto it = by_site_.find(Key{site, static_cast<int>(kind), meta.nbytes, meta.signature});
  return it == by_site_.end() ? nullptr : it->second;
}

}  // namespace jaxvmm
