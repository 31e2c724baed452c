// Graph mode's device words (DESIGN.md, "Graph mode"): the layout the grant and copy kernels share
// with the engine (ffi/kernels/graph_kernels.cu, `Cells`) and with the POSIX backend's host versions
// of those kernels (driver_posix.cc). Plain data at the bottom of the include graph, beside driver.h.
#pragma once

#include <cstdint>

namespace jaxvmm {

// At most this many cells per channel (jaxvmm.configure(graph_cells=K), validated in Python).
inline constexpr int kMaxCells = 4;
// At most this many spare cells per offload channel (the graph_spares setting, validated in Python).
inline constexpr int kMaxSpares = 64;

// The words the device takes grants from, in device memory (cuMemAlloc), one line per
// channel. The poller writes them only with cuStreamWriteValue64 on a copy stream, ordered after the
// copy that makes the grant true; the device (or jaxvmm_revoke) takes grants back with an atomic.
struct DeviceWords {
  uint64_t grant[kMaxCells];  // offload: cell i's armed token (0: none); reload: the token cell i holds
  uint64_t cell[kMaxCells];   // the cells' addresses (written at the channel's first initialize; an offload
                              // cell's when the poller re-arms it with a spare, a large call site's on a page
                              // trade, each before the grant that follows)
  uint64_t flag[kMaxCells];   // &filled[i] / &done[i] (idem)
  uint64_t ncells;            // K (idem)
  uint64_t next;              // offload: the cell the next take scans first (the device's round robin)
  uint64_t ptr;               // the cell the round took (take kernel -> copy kernel)
  uint64_t publish;           // that cell's flag (the publish kernel writes 1 there)
  uint64_t stable;            // 1: no cell address changes after the first initialize (no spares, no page trades),
                              // so a take may use the addresses it loaded before taking its grant (constant)
  uint64_t pad[15];
};
static_assert(sizeof(DeviceWords) == 256, "the layout of Cells in graph_kernels.cu");

}  // namespace jaxvmm
