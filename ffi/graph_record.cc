// Graph-mode recording: the initialize stage's one-time setup of a channel and the device work its
// captured rounds record. DESIGN.md, "Graph mode".
#include "graph_record.h"

#include <cstdio>

#include "config.h"
#include "registry.h"
#include "slot.h"
#include "staging.h"
#include "vmm.h"

namespace jaxvmm {

// ---------------------------------------------------------------- the initialize stage

Status GraphRecorder::PrepareKernels(CUstream setup, Channel& c) {
  // Once per engine, outside any capture. Failure (no PTX JIT, a driver older than the PTX ISA, a
  // launch that fails) is not retried: what a capture would record is decided here.
  if (kernels_.tried()) return ready_;
  Status st = kernels_.Load(device_);
  // Before any round of this engine can wait on the device: under lazy module loading (the CUDA
  // default) a kernel's first launch may wait for the whole device to drain while holding the
  // context's lock. Launched first under a capture (mu_ held) or by a revocation (the poller) while
  // another channel's round waits for the poller, that wait never ends. Nothing of this engine waits
  // on the device yet, so the loads end.
  if (st.ok()) st = WarmKernels(setup, c);
  if (st.ok()) {
    kernels_.MarkWarmed();  // from here on the op ring copies with jaxvmm_copy too
    stats_.kernels = true;
    return ready_;
  }
  stats_.kernels_error = st.ToString();
  ready_ = st.Append(
      " (graph mode records its rounds with these kernels: no call site can be captured into a command buffer on "
      "this device; turn command buffers off with XLA_FLAGS=--xla_gpu_enable_command_buffer= , or graph mode with "
      "JAXVMM_GRAPH=0)");
  std::fprintf(stderr, "%s\n", ready_.ToString().c_str());
  return ready_;
}

Status GraphRecorder::ReserveCells(CUstream setup, Channel& c, const ArrayMeta& meta, ChannelKind kind) {
  // The cells' VAs, reserved once. K is fixed from here on: the recorded kernels read it from the
  // channel's device words.
  Location loc{CU_MEM_LOCATION_TYPE_DEVICE, device_};
  size_t g = 0;
  JAXVMM_RETURN_IF_ERROR(Granularity(backend_, device_, loc, &g));
  SlotSpec spec;
  spec.backend = backend_;
  spec.device = device_;
  spec.location = loc;
  spec.nbytes = (meta.nbytes + g - 1) / g * g;
  if (spec.nbytes > StagingArea::Budget())
    return Status(Code::kOutOfMemory, "a graph-mode cell of " + std::to_string(spec.nbytes) + " bytes does not fit the staging budget of " +
                                          std::to_string(StagingArea::Budget()) +
                                          " bytes (jaxvmm.configure(staging_budget=...) or JAXVMM_STAGING_BUDGET)");
  spec.map_on_create = false;
  spec.internal = true;
  c.cell_size = spec.nbytes;
  // More than one cell only below kLargeCellBytes (Channel::Large): a second cell of a large activation
  // costs as much device memory as the activation (what offloading is meant to free), and a large
  // activation comes with enough compute per iteration to hide the previous round's copy.
  const int k = !c.Large() ? EngineConfig::GraphCells() : 1;
  Status st;
  for (int made = 0; made < k && st.ok(); ++made) {
    Cell& cell = c.cells[made];
    st = ReservePages(spec, &cell);
    if (st.ok() && !cell.event)
      st = Call(cell.slot_id, "graph channel", Entry::kEventCreate, [&] { return Driver(backend_).EventCreate(&cell.event, CU_EVENT_DISABLE_TIMING); });
  }
  c.trades = c.Large() && EngineConfig::GraphHoldPolicy() == EngineConfig::GraphHold::kLarge;
  if (st.ok() && kind == ChannelKind::kOffload) {
    // Spare cells (VA only; pages when lent): as many as the slots allow, up to graph_spares (or
    // kMaxSpares under a spare budget). (A channel with spares records its rounds as kernels even with
    // one cell: the cell's address is read from the device words, where a lend changes it.)
    for (int n = EngineConfig::GraphSparesPerChannel(); n > 0; --n) {
      Spare sp;
      if (!ReservePages(spec, &sp).ok()) break;
      c.spares.push_back(std::move(sp));
    }
  }
  if (st.ok()) {
    c.ncells = k;
    st = SetUpCells(setup, c);
  }
  if (!st.ok()) {
    for (Cell& cell : c.cells) {
      if (cell.slot_id >= 0) (void)Registry::Get().Close(cell.slot_id);
      cell.slot_id = -1;
      cell.addr = 0;
    }
    for (Spare& sp : c.spares) (void)Registry::Get().Close(sp.slot_id);
    c.spares.clear();
    c.ncells = 0;
    return st;
  }
  stats_.spares += static_cast<int64_t>(c.spares.size());
  stats_.cells += k;
  return Status();
}

Status GraphRecorder::ReservePages(const SlotSpec& spec, CellPages* p) {
  // An internal slot's VA for a cell or a spare (no pages yet: spec.map_on_create is false).
  int64_t id = -1;
  JAXVMM_RETURN_IF_ERROR(Registry::Get().Create(spec, &id));
  std::shared_ptr<Slot> slot;
  Status st = Registry::Get().Lookup(id, &slot);
  if (!st.ok()) {
    (void)Registry::Get().Close(id);
    return st;
  }
  p->slot_id = id;
  p->addr = slot->address();
  return Status();
}

Status GraphRecorder::SetUpCells(CUstream setup, Channel& c) {
  // Outside any capture. The constant part of the channel's device words, on `setup` (it never
  // waits on XLA's streams), synchronized before any round can read them.
  const char* stage = "graph channel";
  Status st = WriteDevice(setup, c.Word(offsetof(DeviceWords, ncells)), static_cast<uint64_t>(c.ncells), stage);
  if (st.ok()) st = WriteDevice(setup, c.Word(offsetof(DeviceWords, stable)), static_cast<uint64_t>(!c.AddressesMove()), stage);
  for (int i = 0; i < c.ncells && st.ok(); ++i) {
    st = WriteDevice(setup, c.CellWord(i), c.cells[i].addr, stage);
    if (st.ok())
      st = WriteDevice(setup, c.Word(offsetof(DeviceWords, flag) + sizeof(uint64_t) * i),
                       WordAddr(c.kind == ChannelKind::kOffload ? c.w->filled[i] : c.w->done[i]), stage);
  }
  Status sync = Call(-1, stage, Entry::kStreamSynchronize, [&] { return Driver(backend_).StreamSynchronize(setup); });
  return st.ok() ? sync : st;
}

Status GraphRecorder::WarmKernels(CUstream setup, Channel& c) {
  // `c` is a channel no round has used (nothing of the engine was captured yet), its words all 0.
  // Each kernel runs once on `setup` with arguments that make it return at once, leaving the words at 0:
  // with one cell (its "cell" the pinned word scratch[0], its flag `filled[0]`) whose grant[0] = 1,
  // take_offload takes the grant and writes the token into grant[0]; take_reload finds grant[0] naming
  // the token it reads from grant[0] and takes it; the copy kernel copies the cell into `probe` and
  // the publish kernel writes filled[0]; revoke finds grant[0] empty.
  const DriverTable& d = Driver(backend_);
  const char* stage = "graph kernels (warm-up)";
  ChannelWords& w = *c.w;
  const CUdeviceptr g0 = c.Grant(0);
  const CUdeviceptr ncells = c.Word(offsetof(DeviceWords, ncells)), cell0 = c.Word(offsetof(DeviceWords, cell)),
                    flag0 = c.Word(offsetof(DeviceWords, flag));
  Status st = WriteDevice(setup, ncells, 1, stage);
  if (st.ok()) st = WriteDevice(setup, cell0, WordAddr(w.scratch[0]), stage);
  if (st.ok()) st = WriteDevice(setup, flag0, WordAddr(w.filled[0]), stage);
  if (st.ok()) st = WriteDevice(setup, g0, 1, stage);
  if (st.ok()) st = kernels_.TakeOffload(setup, c.dw, g0, WordAddr(w.knock));
  if (st.ok()) st = kernels_.TakeReload(setup, c.dw, g0, WordAddr(w.probe), WordAddr(w.request), WordAddr(w.go));
  // Launched as rounds launch them (early, where the module can), so the warm-up also tries that launch.
  if (st.ok()) st = kernels_.CellCopy(setup, c.dw, WordAddr(w.probe), sizeof(uint64_t), /*out=*/true);
  if (st.ok()) st = kernels_.Publish(setup, c.dw, stage);
  if (st.ok()) st = kernels_.Revoke(setup, g0, 0, WordAddr(w.result));
  // The op ring's copy: filled[0] (1 by now) into scratch[1], and a value with both 32-bit halves set
  // into scratch[2].
  constexpr uint64_t kWarmToken = 0x0000000900000007ull;
  const CUdeviceptr dst = WordAddr(w.scratch[1]), token = WordAddr(w.scratch[2]);
  if (st.ok()) st = kernels_.Copy(setup, dst, WordAddr(w.filled[0]), sizeof(uint64_t), token, kWarmToken, stage);
  // The op ring's reload, both ways, scratch[1] into `go` and the token (in scratch[2]) into `probe`: a
  // hit (the tag is that token) publishing seq 5 in done[0], then a miss (tag 1) publishing seq 6 in
  // done[1], whose wait for ready >= 6 passes at once (scratch[2] stands for the ready word: it holds
  // the token, far above 6), so a kernel that waits where it must not cannot hang the warm-up.
  constexpr uint64_t kWarmSeq = 5;
  if (st.ok())
    st = kernels_.RingReload(setup, WordAddr(w.go), dst, sizeof(uint64_t), token, kWarmToken, WordAddr(w.probe), WordAddr(w.done[0]),
                             kWarmSeq, token);
  if (st.ok())
    st = kernels_.RingReload(setup, WordAddr(w.go), dst, sizeof(uint64_t), token, 1, WordAddr(w.probe), WordAddr(w.done[1]),
                             kWarmSeq + 1, token);
  Status sync = Call(-1, stage, Entry::kStreamSynchronize, [&] { return d.StreamSynchronize(setup); });
  if (st.ok()) st = sync;
  if (st.ok() && (w.knock.load() || w.request.load() || w.result.load() || w.filled[0].load() != 1 || w.scratch[1].load() != 1 ||
                  w.scratch[2].load() != kWarmToken || w.go.load() != 1 || w.probe.load() != kWarmToken ||
                  w.done[0].load() != kWarmSeq || w.done[1].load() != kWarmSeq + 1))
    st = Status(Code::kInternal, "graph-mode grant kernels misbehaved in their warm-up (a word was left set, or a copy did not land)");
  for (auto* word : {&w.knock, &w.probe, &w.request, &w.go, &w.result, &w.filled[0], &w.done[0], &w.done[1], &w.scratch[0],
                     &w.scratch[1], &w.scratch[2]})
    word->store(0, std::memory_order_relaxed);
  // Leave the device words as a new channel's (SetUpCells writes the constants).
  for (CUdeviceptr word : {g0, ncells, cell0, flag0, c.Word(offsetof(DeviceWords, next)), c.Word(offsetof(DeviceWords, ptr)),
                           c.Word(offsetof(DeviceWords, publish))})
    (void)WriteDevice(setup, word, 0, stage);
  d.StreamSynchronize(setup);
  if (!st.ok()) st = Status(st.code(), st.ToString() + " (warm-up of the grant kernels at the engine's first initialize stage)");
  return st;
}

// ---------------------------------------------------------------- the execute stage, under capture

Status GraphRecorder::RecordCopyAndPublish(CUstream stream, Channel& c, CUdeviceptr other, size_t nbytes, bool out,
                                           const char* stage) {
  if (c.FixedCell()) {
    // One cell whose address never changes (JAXVMM_GRAPH_CELLS=1, no spares, no trades): a memcpy
    // that names it, as before K cells, then a write of its flag.
    const DriverTable& d = Driver(backend_);
    const CUdeviceptr cell = c.cells[0].addr;
    const CUdeviceptr to = out ? other : cell, from = out ? cell : other;
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kMemcpyDtoDAsync, [&] { return d.MemcpyDtoDAsync(to, from, nbytes, stream); }));
    const CUdeviceptr flag = WordAddr(out ? c.w->done[0] : c.w->filled[0]);
    return Call(-1, stage, Entry::kStreamWriteValue64, [&] { return d.StreamWriteValue64(stream, flag, 1, 0); });
  }
  // On sm_90 and later the copy and the publish are launched early, each waiting on the device for
  // the kernel before it (programmatic edges in the captured graph), so neither pays a full launch
  // after the kernel before it has drained.
  JAXVMM_RETURN_IF_ERROR(kernels_.CellCopy(stream, c.dw, other, nbytes, out));
  JAXVMM_RETURN_IF_ERROR(kernels_.Publish(stream, c.dw, stage));
  if (kernels_.can_launch_early()) ++stats_.early_captures;
  return Status();
}

Status GraphRecorder::RecordOffload(CUstream stream, Channel& c, CUdeviceptr src, size_t nbytes, CUdeviceptr token_out) {
  // Take a cell's grant (its address into the channel's `ptr`), copy x into that cell, publish the
  // cell's filled word.
  JAXVMM_RETURN_IF_ERROR(kernels_.TakeOffload(stream, c.dw, token_out, WordAddr(c.w->knock)));
  return RecordCopyAndPublish(stream, c, src, nbytes, /*out=*/false, "offload (capture)");
}

Status GraphRecorder::RecordReload(CUstream stream, Channel& c, CUdeviceptr token_in, CUdeviceptr dst, size_t nbytes) {
  ChannelWords& w = *c.w;
  JAXVMM_RETURN_IF_ERROR(kernels_.TakeReload(stream, c.dw, token_in, WordAddr(w.probe), WordAddr(w.request), WordAddr(w.go)));
  return RecordCopyAndPublish(stream, c, dst, nbytes, /*out=*/true, "reload (capture)");
}

Status GraphRecorder::RecordPrefetch(CUstream stream, CUdeviceptr token_in, CUdeviceptr token_out) {
  return Call(-1, "prefetch (capture)", Entry::kMemcpyAsync,
              [&] { return Driver(backend_).MemcpyAsync(token_out, token_in, sizeof(uint64_t), stream); });
}

}  // namespace jaxvmm
