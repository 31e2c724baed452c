// Process-wide engine settings (jaxvmm.configure / environment), read by the engine's parts when they
// need them. Plain atomics: set from Python (under the GIL), read by any thread.
#pragma once

#include <cstddef>

namespace jaxvmm {

struct EngineConfig {
  // How many of the newest offloaded tickets keep their staging cell (a device copy) after the D2H,
  // so that their reloads copy device to device instead of waiting for an H2D. Default 0.
  static void SetKeepResident(int n);
  static int KeepResident();
  // Graph mode: staging cells per channel (1..kMaxCells, default 2), so consecutive rounds of one call
  // site overlap their copies. Read when a channel is first prepared.
  static void SetGraphCells(int k);
  static int GraphCells();
  // Graph mode: spare cells per offload channel (0..kMaxSpares, default 0). An offload cell whose D2H is
  // still queued is re-armed with a free spare at once, so a scan's forward runs ahead of PCIe; the
  // queued bytes stay in the lent cell, and a reload of them copies device to device until a later lend
  // reuses the spare. Read when a channel is first prepared.
  static void SetGraphSpares(int n);
  static int GraphSpares();
  // Graph mode: device memory that mapped spare cells may hold at once, over every offload channel of an
  // engine (0: no cap but the staging budget; default 0). A lend that would pass it finds no spare (the
  // cell is held or armed behind its D2H instead), so the forward's newest activations stay on the
  // device only as far as the user lets them. Read at each lend.
  static void SetGraphSpareBudget(size_t bytes);
  static size_t GraphSpareBudget();
  // Spare cells an offload channel prepared now reserves (VA only): graph_spares when set, else
  // kMaxSpares when a spare budget is set (the budget, not a count, then bounds them), else none.
  static int GraphSparesPerChannel();
  // Graph mode: which offload cells are *held* after their round (no grant out, their bytes readable
  // device to device) instead of armed behind their D2H. kSpares: only when every spare of the channel
  // is lent (channels with graph_spares), until a spare is free or the D2H is done. kLarge (the
  // default): also the one cell of a call site whose cell is 32 MiB or more (kLargeCellBytes), until its
  // next round knocks, so the backward's first reload, of the forward's last offload, copies it device
  // to device instead of waiting for its D2H and an H2D. Read at each offload round.
  enum class GraphHold { kSpares = 0, kLarge = 1 };
  static void SetGraphHold(GraphHold h);
  static GraphHold GraphHoldPolicy();
  // D2H and H2D copies between a staging cell and a host block are issued in pieces of at most this
  // many bytes (0: one copy), so that other copies on the copy engines (the other direction, XLA's
  // D2D snapshots) interleave with a large one instead of queueing behind all of it. Default 64 MiB.
  static void SetCopyChunk(size_t bytes);
  static size_t CopyChunk();
  // Whether XLA runs the commands of a command buffer in the order it recorded them: not when XLA_FLAGS
  // sets --xla_gpu_command_buffer_scheduling_mode=CONCURRENT, or the deprecated
  // --xla_gpu_graph_enable_concurrent_region (commands with no data between them are then parallel
  // branches of one graph; LHS, the default, and SERIALIZE keep the order). Parses XLA_FLAGS (or the
  // file it names) as XLA does when its backend starts, the last setting winning; the engine asks once,
  // when it is made. A mode set per program through compiler options is not seen.
  static bool XlaKeepsCommandOrder();
};

}  // namespace jaxvmm
