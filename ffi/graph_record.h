// Graph-mode recording: what a call site's initialize stage sets up once (the grant kernels, its
// channel's cells and constant device words) and the fixed device work its execute stage records into
// XLA's command buffer. DESIGN.md, "Graph mode".
//
// Owns: whether graph mode can record rounds at all (its kernels loaded and warmed at the engine's
// first initialize stage, or why not, for the engine's life) and its own counters. Handed: the engine's
// grant kernels (loaded and warmed here), the channels it sets up or records (GraphMode's), and the
// stream that carries the setup writes (graph mode's gd2h, which never waits on XLA's streams). Never
// maps pages: a capture that must name a mapped cell is given one by GraphCells first.
//
// No lock of its own: every call is made with GraphMode::mu_ held (it sits inside GraphMode's lock order).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "channels.h"
#include "graph_kernels.h"
#include "slot.h"
#include "status.h"

namespace jaxvmm {

struct RecordStats {
  bool kernels = false;        // the kernels are loaded and warmed: captures can record rounds
  std::string kernels_error;   // why not, when they failed to load or warm up (every capture fails with it)
  int64_t cells = 0;           // cells reserved over all channels (K per small call site, 1 per large one)
  int64_t spares = 0;          // spare cells reserved (VAs only)
  int64_t early_captures = 0;  // rounds whose copy and publish were recorded as early launches (sm_90 and later)
};

class GraphRecorder {
 public:
  GraphRecorder(Backend b, int device, GraphKernels& kernels) : backend_(b), device_(device), kernels_(kernels) {}
  GraphRecorder(const GraphRecorder&) = delete;
  GraphRecorder& operator=(const GraphRecorder&) = delete;

  // The initialize stage, once per execution of call site `c`: at the engine's first one (until the
  // kernels were tried) loads the grant kernels and warms them on `c`'s words (no round of the engine
  // has started). Returns Ready().
  Status PrepareKernels(CUstream setup, Channel& c);
  // OK unless the kernels failed to load or warm up; then why, and how to run without graph mode, for
  // the engine's life. Graph mode has no other way to record a round: every capture fails with it (an
  // initialize stage does not: an execution that XLA does not capture runs on the op ring).
  const Status& Ready() const { return ready_; }
  // A new channel's cells (VAs, no pages; K of them, or 1), its spares and its constant device words.
  Status ReserveCells(CUstream setup, Channel& c, const ArrayMeta& meta, ChannelKind kind);

  // The fixed device work of one round, enqueued on XLA's capturing stream (no allocation here).
  Status RecordOffload(CUstream stream, Channel& c, CUdeviceptr src, size_t nbytes, CUdeviceptr token_out);
  Status RecordReload(CUstream stream, Channel& c, CUdeviceptr token_in, CUdeviceptr dst, size_t nbytes);
  // A prefetch hint cannot be decided at replay: the recorded work only passes the token on.
  Status RecordPrefetch(CUstream stream, CUdeviceptr token_in, CUdeviceptr token_out);

  const RecordStats& stats() const { return stats_; }

 private:
  Status WarmKernels(CUstream setup, Channel& c);  // each kernel launched once (loaded), at the first initialize
  Status SetUpCells(CUstream setup, Channel& c);   // the channel's constant device words (K, cells, flags, stable)
  Status ReservePages(const SlotSpec& spec, CellPages* p);  // a VA (internal slot, no pages) for a cell or spare
  // A round's nodes after its take: the copy between XLA's buffer `other` and the cell (out: cell ->
  // other, a reload), then the publish of the cell's filled/done word.
  Status RecordCopyAndPublish(CUstream stream, Channel& c, CUdeviceptr other, size_t nbytes, bool out, const char* stage);
  Status WriteDevice(CUstream s, CUdeviceptr word, uint64_t value, const char* stage) {
    return WriteDeviceWord(backend_, s, word, value, stage);
  }

  const Backend backend_;
  const int device_;
  GraphKernels& kernels_;
  Status ready_;  // PrepareKernels' outcome (OK until the kernels were tried)
  RecordStats stats_;
};

}  // namespace jaxvmm
