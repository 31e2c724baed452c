// Capture and replay of engine work without XLA: a stream of jaxvmm's own, captured into a graph and
// launched N times, on either backend. Tests use it to show that what a handler enqueues under capture
// stays correct when replayed with no further handler call (what XLA's command buffers do).
#pragma once

#include <cstdint>

#include "driver.h"
#include "status.h"

namespace jaxvmm {

Status ReplayStreamCreate(Backend b, int device, uint64_t* stream);
Status ReplayStreamDestroy(Backend b, int device, uint64_t stream);
Status ReplayStreamSynchronize(Backend b, int device, uint64_t stream);
Status ReplayBeginCapture(Backend b, int device, uint64_t stream);
// Ends the capture and instantiates the graph; *exec is the graph to launch.
Status ReplayEndCapture(Backend b, int device, uint64_t stream, uint64_t* exec);
Status ReplayLaunch(Backend b, int device, uint64_t exec, uint64_t stream);
Status ReplayDestroy(Backend b, int device, uint64_t exec);

}  // namespace jaxvmm
