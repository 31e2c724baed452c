// Side-by-side latency of raw driver call sequences and the Slot operations built on them, measured
// in one process with the same sizes, so bench/vmm_ops.py can print honest ratios.
#pragma once

#include <map>
#include <string>

#include "driver.h"
#include "status.h"

namespace jaxvmm {

// Median microseconds per operation over `iters` cycles. Keys: raw_reserve, raw_create, raw_map,
// raw_access, raw_unmap, raw_release, raw_free, raw_setup (reserve+create+map+access), raw_remap
// (create+map+access), raw_drop (unmap+release), and slot_create, slot_release, slot_remap,
// slot_close (of a released slot: compare with raw_free). A failure undoes what it left behind.
Status BenchOps(Backend b, int device, size_t nbytes, int iters, std::map<std::string, double>* out);

}  // namespace jaxvmm
