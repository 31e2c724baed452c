// Fault injection and live-object counters for the driver seam.
//
// Every table returned by Driver(backend) is this wrapper over the raw table: each entry counts its
// calls, may fail on demand, and successful VMM calls update live counts of physical handles,
// reservations and mappings. With nothing armed the cost is two relaxed atomic operations.
#pragma once

#include <cstdint>
#include <vector>

#include "driver.h"
#include "stat_fields.h"

namespace jaxvmm {

struct DriverCounters {
  int64_t live_handles = 0;       // cuMemCreate/cuMemImportFromShareableHandle minus cuMemRelease
  int64_t live_reservations = 0;  // cuMemAddressReserve minus cuMemAddressFree
  int64_t live_mappings = 0;      // cuMemMap minus cuMemUnmap
  int64_t injected = 0;           // failures returned by armed rules
  std::vector<int64_t> calls;     // per Entry, every call including injected failures
};

// driver_counters() keys (and calls: per entry).
inline constexpr StatField<DriverCounters> kDriverCountersFields[] = {
    {"live_handles", &DriverCounters::live_handles},
    {"live_reservations", &DriverCounters::live_reservations},
    {"live_mappings", &DriverCounters::live_mappings},
    {"injected", &DriverCounters::injected},
};

// Fail calls of `entry` on backend `b` with `error`: skip the first `nth - 1` calls, then fail `times`
// calls (times < 0: every later call, until cleared). Several rules may be armed at once.
void ArmFault(Backend b, Entry entry, int64_t nth, int64_t times, CUresult error);
void ClearFaults(Backend b);
DriverCounters ReadCounters(Backend b);

}  // namespace jaxvmm
