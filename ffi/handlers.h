// The XLA FFI handlers, listed without exposing XLA types (module.cc must not see XLA headers).
#pragma once

#include <string>
#include <vector>

namespace jaxvmm {

struct HandlerEntry {
  std::string name;      // target name: jaxvmm_offload, jaxvmm_reload, jaxvmm_prefetch
  std::string platform;  // "CUDA" or "cpu"
  void* fn;              // XLA_FFI_Handler*
};

std::vector<HandlerEntry> Handlers();

// The FFI API version the handlers were compiled against, "major.minor".
std::string FfiApiVersion();

}  // namespace jaxvmm
