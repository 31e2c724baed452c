// The engine's kernels: graph mode's grant kernels and the op ring's copy, a module loaded at run time
// from checked-in PTX (graph_kernels_ptx.h, made by tools/gen_ptx.sh from ffi/kernels/graph_kernels.cu),
// so building jaxvmm needs no CUDA toolkit. Each launch is capturable (XLA's capture records it as a
// kernel node); the grant kernels are one thread, the copies a grid.
//
// Owned by the engine; graph mode loads and warms it at the engine's first initialize stage, outside any
// capture (GraphRecorder::PrepareKernels), and the op ring launches its copy only once warmed() says
// so. Unload only after every stream that may still run one of its kernels is synchronized. A driver
// that cannot load it (no PTX JIT, too old for the PTX ISA) leaves graph mode unable to capture any
// call site (GraphRecorder::Ready) and the op ring on driver copies.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "driver.h"
#include "status.h"

namespace jaxvmm {

class GraphKernels {
 public:
  explicit GraphKernels(Backend b) : backend_(b) {}
  ~GraphKernels();  // unloads (the owner has synchronized the streams)
  GraphKernels(const GraphKernels&) = delete;
  GraphKernels& operator=(const GraphKernels&) = delete;

  // Loads the module in the current context (device `device`'s): the compute_90 one when the device is
  // sm_90 or later (its round kernels can be launched early), else the compute_80 one. Failure is
  // remembered (why()) and not retried. Also reads the device's SM count, which bounds the ring
  // reload's grid (RingReloadBlocks).
  Status Load(int device);
  bool loaded() const { return module_ != nullptr; }
  bool tried() const { return tried_; }
  // Every kernel has run once (GraphRecorder::WarmKernels): under lazy module loading a first launch may
  // wait for the device to drain, which must never happen once anything waits on the device. Any thread.
  bool warmed() const { return warmed_.load(std::memory_order_acquire); }
  void MarkWarmed() { warmed_.store(true, std::memory_order_release); }
  const std::string& why() const { return why_; }  // why it did not load ("" when it did)
  void Unload();

  // jaxvmm_take_offload(cells, token_out, knock); see graph_kernels.cu. `cells`: a channel's DeviceWords.
  Status TakeOffload(CUstream s, CUdeviceptr cells, CUdeviceptr token_out, CUdeviceptr knock) const;
  // jaxvmm_take_reload(cells, token_in, probe, request, go).
  Status TakeReload(CUstream s, CUdeviceptr cells, CUdeviceptr token_in, CUdeviceptr probe, CUdeviceptr request,
                    CUdeviceptr go) const;
  // jaxvmm_cell_copy(cells, other, nbytes, out): the round's copy into (out false) or out of the cell
  // the take kernel chose. Publishes nothing: Publish, the next node, does. Launched early where the
  // module can (can_launch_early()): with programmatic stream serialization, so its blocks may start
  // while the kernel before it (the take) ends; the kernel waits for that kernel's end before it reads
  // `ptr` (griddepcontrol).
  Status CellCopy(CUstream s, CUdeviceptr cells, CUdeviceptr other, size_t nbytes, bool out) const;
  // jaxvmm_publish(cells): one thread writes 1 into the chosen cell's filled/done word (launched as
  // CellCopy is; early, it waits for the copy's end before it writes).
  Status Publish(CUstream s, CUdeviceptr cells, const char* stage) const;
  // The loaded module is the compute_90 one (an sm_90 or later device), whose round kernels wait for
  // the kernel before them: CellCopy and Publish are launched early.
  bool can_launch_early() const { return sm90_; }
  // The copy kernel's grid for nbytes: 256 threads a block, enough blocks for four 16-byte units a
  // thread, at most kMaxCopyBlocks (grid-stride beyond).
  static unsigned CopyBlocks(size_t nbytes);
  static constexpr unsigned kCopyThreads = 256, kMaxCopyBlocks = 1024;
  // jaxvmm_copy(dst, src, nbytes, word, value): the op ring's copy of nbytes (CopyBlocks' grid), and
  // with `word` != 0 `value` written there (an offload's token into XLA's output).
  Status Copy(CUstream s, CUdeviceptr dst, CUdeviceptr src, size_t nbytes, CUdeviceptr word, uint64_t value,
              const char* stage) const;
  // jaxvmm_ring_reload(dst, src, nbytes, token_in, tag, probe, seen, seq, ready): the op ring's reload
  // copy out of its cell, which also publishes the token it holds (probe, then seen = seq) and, unless
  // that token is `tag` (!= 0, the prediction), first waits for ready >= seq. RingReloadBlocks' grid.
  Status RingReload(CUstream s, CUdeviceptr dst, CUdeviceptr src, size_t nbytes, CUdeviceptr token_in, uint64_t tag,
                    CUdeviceptr probe, CUdeviceptr seen, uint64_t seq, CUdeviceptr ready) const;
  // The ring reload's grid: CopyBlocks, at most kMaxRingReloadBlocks and at most one block per SM. Its
  // blocks may wait for the resolver, whose release may need a kernel of its own to run (the copy into
  // the cell, a driver memset of a 0xFF fill): one 256-thread block per SM leaves every SM room for it
  // (a 16-SM MIG slice would otherwise be filled by 128 waiting blocks). Progress does not need
  // residency (every block waits only for the resolver).
  unsigned RingReloadBlocks(size_t nbytes) const;
  static constexpr unsigned kMaxRingReloadBlocks = 128;
  // The waiting reload's grid is the copy's own (CopyBlocks, not capped to one block per SM): the op
  // ring uses RingReload for such sizes only (on the H200, up to 2 MiB), a copy with a memop wait above.
  bool RingReloadFullGrid(size_t nbytes) const { return RingReloadBlocks(nbytes) == CopyBlocks(nbytes); }
  // jaxvmm_revoke(word, expect, result).
  Status Revoke(CUstream s, CUdeviceptr word, uint64_t expect, CUdeviceptr result) const;

 private:
  // cuLaunchKernel; with `early` and the compute_90 module loaded, cuLaunchKernelEx with
  // CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION instead (captured as a programmatic edge from
  // the node before).
  Status Launch(CUfunction f, CUstream s, void** params, const char* stage, unsigned blocks = 1, unsigned threads = 1,
                bool early = false) const;
  const Backend backend_;
  bool tried_ = false;
  std::string why_;
  CUmodule module_ = nullptr;
  CUfunction take_offload_ = nullptr, take_reload_ = nullptr, revoke_ = nullptr, cell_copy_ = nullptr;
  CUfunction publish_ = nullptr, copy_ = nullptr, ring_reload_ = nullptr;
  std::atomic<bool> warmed_{false};
  unsigned sms_ = 0;  // the device's SM count (0: unknown; the grid is then kMaxRingReloadBlocks at most)
  bool sm90_ = false;  // the compute_90 module is loaded
};

}  // namespace jaxvmm
