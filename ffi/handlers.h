// The XLA FFI handlers, listed without exposing XLA types (module.cc must not see XLA headers).
#pragma once

#include <string>
#include <vector>

namespace jaxvmm {

struct HandlerEntry {
  std::string name;      // target name: jaxvmm_offload, jaxvmm_reload, jaxvmm_prefetch
  std::string platform;  // "CUDA" or "cpu"
  void* fn;              // XLA_FFI_Handler* of the execute stage (no traits)
  // CUDA offload/reload only (else null): the same execute stage marked kCmdBufferCompatible, and the
  // initialize stage that prepares the call site's graph-mode channel. Registered together.
  void* graph_fn = nullptr;
  void* initialize = nullptr;
};

std::vector<HandlerEntry> Handlers();

// The FFI API version the handlers were compiled against, "major.minor".
std::string FfiApiVersion();

}  // namespace jaxvmm
