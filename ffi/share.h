// Sharing a slot's pages with other processes: the exporter's generation channel and the counters of
// what sharing holds. No XLA, no Python. See DESIGN.md, "Shared slots".
//
// The channel is one page of a memfd that the exporting slot owns and writes, and that travels beside the
// shareable handle (as a second descriptor). Importers map it read-only and compare its words with the
// generation their handle was exported at: the view is current only while the exporter still maps those
// same pages. The exporter writes the words under its slot lock at every transition (map, release, remap,
// close); a reader sees each 8-byte word atomically (aligned, written with one store).
#pragma once

#include <atomic>
#include <cstdint>

#include "stat_fields.h"
#include "status.h"

namespace jaxvmm {

// Layout of the channel page, shared with jaxvmm/share.py (which reads it with struct "<QQQQq").
struct ChannelPage {
  uint64_t magic;                      // kChannelMagic
  std::atomic<uint64_t> generation;    // the exporter's generation while its pages are mapped; 0 otherwise
  std::atomic<uint64_t> closed;        // 1 once the exporting slot is closed
  uint64_t slot;                       // the exporter's slot id (diagnostics)
  int64_t pid;                         // the exporter's pid (diagnostics)
};
inline constexpr uint64_t kChannelMagic = 0x6c6e6e6168636d76ull;  // "vmchannl"
inline constexpr size_t kChannelBytes = 4096;

class ExportChannel {
 public:
  ExportChannel() = default;
  ExportChannel(const ExportChannel&) = delete;
  ExportChannel& operator=(const ExportChannel&) = delete;
  ~ExportChannel();

  Status Open(int64_t slot);            // memfd + one shared page; counted in ShareStats().channel_fds
  bool open() const { return page_ != nullptr; }
  void Publish(uint64_t generation);    // pages mapped at `generation` (0: no pages)
  void MarkClosed();
  // A new descriptor of the channel (close-on-exec), owned by the caller; -1 with *st set on failure.
  int Dup(Status* st) const;

 private:
  int fd_ = -1;
  ChannelPage* page_ = nullptr;
};

struct ShareStats {
  int64_t exports = 0;        // successful Slot::Export calls
  int64_t imports = 0;        // successful Slot::Import calls
  int64_t imported_slots = 0; // imported slots not yet torn down
  int64_t views = 0;          // live zero-copy views (DLPack tensors not yet deleted)
  int64_t channel_fds = 0;    // channel descriptors jaxvmm holds (one per shareable slot)
};

// share_stats() keys.
inline constexpr StatField<ShareStats> kShareStatsFields[] = {
    {"exports", &ShareStats::exports},
    {"imports", &ShareStats::imports},
    {"imported_slots", &ShareStats::imported_slots},
    {"views", &ShareStats::views},
    {"channel_fds", &ShareStats::channel_fds},
};
ShareStats ReadShareStats();

// Internal counters (share.cc). Each one moves with the event it names.
void CountExport();
void CountImport(int64_t delta_slots);
void CountView(int64_t delta);

}  // namespace jaxvmm
