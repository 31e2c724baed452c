// Process-wide settings: one table (config.cc) of every setting the core reads, set from Python
// through one entry (lib.set_setting, module.cc) and read by the engine's parts and the driver seam's
// cpu model when they need them. Plain atomics: set under the GIL, read by any thread. No part of the
// core reads a JAXVMM_* environment variable: jaxvmm/_config.py declares every setting once (name,
// environment variable, type, default, range, doc), parses the environment at import, validates
// jaxvmm.configure() and pushes every value, defaults included, before anything else runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace jaxvmm {

// The settings the core reads, by the names jaxvmm/_config.py declares them under (config.cc, kRows).
enum class Setting : int {
  kHostPoolLimit,     // bytes: cap on the pinned bytes of each host pool
  kHostStore,         // choice: the store new offloads draw from ("pinned", "host_numa": HostStoreKind)
  kHostPoolChunk,     // bytes pinned per driver allocation (rounded up to HostPool::kAlign)
  kPrefetchDepth,     // staging cells per array size and direction copies may use at once
  kStagingBudget,     // bytes: cap on mapped staging bytes per engine
  kStagingIdleMs,     // milliseconds without an acquire before the staging pages go back
  kKeepResident,      // newest offloaded tickets that keep their staging cell (a device copy) after the D2H
  kCopyChunk,         // bytes: D2H/H2D copies go in pieces of at most this many (0: one copy)
  kGraphCells,        // graph mode: staging cells per channel (1..kMaxCells)
  kGraphSpares,       // graph mode: spare cells per offload channel (0..kMaxSpares)
  kGraphSpareBudget,  // graph mode: bytes mapped spares may hold at once per engine (0: no cap)
  kGraphHold,         // choice: which graph-mode offload cells are held ("spares", "large": GraphHold)
  kTrace,             // 0/1: log every lifecycle driver call (vmm.h, Call)
  kPredict,           // 0/1: predict which ticket a reload holds (tickets.cc)
  kWorkerSpinUs,      // microseconds a worker spins on an op's event or word before it naps
  kRingProfile,       // 0/1: time each part of the uncaptured handlers (read when an engine starts)
  kPosixAsync,        // cpu platform: streams on threads of their own (N > 1: random delays up to N us)
  kPosixLinkUs,       // cpu platform, async streams: each pinned <-> device copy takes N us more
  kPosixDtodUs,       // cpu platform, async streams: each side-stream device-to-device copy waits N us
  kCount,
};

struct EngineConfig {
  // The value in force (a choice as its index among the setting's choices).
  static int64_t Get(Setting s);
  // The setting named `name` (jaxvmm/_config.py's key); false when the table has none.
  static bool Find(std::string_view name, Setting* out);
  // Sets a number; false (nothing set) for a choice setting. Values are validated in Python first
  // (jaxvmm/_config.py's ranges); the reads below clamp to what the core can hold.
  static bool Set(Setting s, int64_t value);
  // Sets a choice by name; false (nothing set) for a number setting or a name not among its choices.
  static bool SetChoice(Setting s, std::string_view name);
  // A choice setting's name for `index`; nullptr for a number setting (or an index out of range).
  static const char* ChoiceName(Setting s, int64_t index);

  // Typed reads of the table, for the parts that use them.
  // How many of the newest offloaded tickets keep their staging cell (a device copy) after the D2H,
  // so that their reloads copy device to device instead of waiting for an H2D. Read at each offload.
  static int KeepResident();
  // Graph mode: staging cells per channel (1..kMaxCells), so consecutive rounds of
  // one call site overlap their copies. Read when a channel is first prepared.
  static int GraphCells();
  // Graph mode: spare cells per offload channel (0..kMaxSpares). An offload cell
  // whose D2H is still queued is re-armed with a free spare at once, so a scan's forward runs ahead of
  // PCIe; the queued bytes stay in the lent cell, and a reload of them copies device to device until a
  // later lend reuses the spare. Read when a channel is first prepared.
  static int GraphSpares();
  // Graph mode: device memory that mapped spare cells may hold at once, over every
  // offload channel of an engine (0: no cap but the staging budget). A lend that would pass it finds
  // no spare (the cell is held or armed behind its D2H instead), so the forward's newest activations
  // stay on the device only as far as the user lets them. Read at each lend.
  static size_t GraphSpareBudget();
  // Spare cells an offload channel prepared now reserves (VA only): graph_spares when set, else
  // kMaxSpares when a spare budget is set (the budget, not a count, then bounds them), else none.
  static int GraphSparesPerChannel();
  // Graph mode: which offload cells are *held* after their round (no grant out, their
  // bytes readable device to device) instead of armed behind their D2H. kSpares: only when every spare
  // of the channel is lent (channels with graph_spares), until a spare is free or the D2H is done.
  // kLarge (the default): also the one cell of a call site whose cell is 32 MiB or more (kLargeCellBytes),
  // until its next round knocks, so the backward's first reload, of the forward's last offload, copies it
  // device to device instead of waiting for its D2H and an H2D. Read at each offload round.
  // (The order of the setting's choices in config.cc.)
  enum class GraphHold { kSpares = 0, kLarge = 1 };
  static GraphHold GraphHoldPolicy();
  // D2H and H2D copies between a staging cell and a host block are issued in pieces of at most this
  // many bytes (0: one copy), so that other copies on the copy engines (the other direction, XLA's
  // D2D snapshots) interleave with a large one instead of queueing behind all of it.
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
