// The graph-mode grant kernels: a module loaded at run time from checked-in PTX (graph_kernels_ptx.h,
// made by tools/gen_ptx.sh from ffi/kernels/graph_kernels.cu), so building jaxvmm needs no CUDA
// toolkit. Each launch is one thread, capturable (XLA's capture records it as a kernel node).
//
// Load it outside any capture (the engine does at its first initialize stage); Unload only after every
// stream that may still run one of its kernels is synchronized. A driver that cannot load it (no PTX
// JIT, too old for the PTX ISA) leaves the engine on the host-granted protocol.
#pragma once

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

  // Loads the module in the current context. Failure is remembered (why()) and not retried.
  Status Load();
  bool loaded() const { return module_ != nullptr; }
  bool tried() const { return tried_; }
  const std::string& why() const { return why_; }  // why it did not load ("" when it did)
  void Unload();

  // jaxvmm_take_offload(arm, token_out, knock); see graph_kernels.cu.
  Status TakeOffload(CUstream s, CUdeviceptr arm, CUdeviceptr token_out, CUdeviceptr knock) const;
  // jaxvmm_take_reload(token_in, ready, probe, request, go).
  Status TakeReload(CUstream s, CUdeviceptr token_in, CUdeviceptr ready, CUdeviceptr probe, CUdeviceptr request,
                    CUdeviceptr go) const;
  // jaxvmm_revoke(word, expect, result).
  Status Revoke(CUstream s, CUdeviceptr word, uint64_t expect, CUdeviceptr result) const;

 private:
  Status Launch(CUfunction f, CUstream s, void** params, const char* stage) const;
  const Backend backend_;
  bool tried_ = false;
  std::string why_;
  CUmodule module_ = nullptr;
  CUfunction take_offload_ = nullptr, take_reload_ = nullptr, revoke_ = nullptr;
};

}  // namespace jaxvmm
