#include "graph_kernels.h"

#include "graph_kernels_ptx.h"
#include "vmm.h"

namespace jaxvmm {

GraphKernels::~GraphKernels() { Unload(); }

Status GraphKernels::Load() {
  if (tried_) return module_ ? Status() : Status(Code::kUnavailable, why_);
  tried_ = true;
  const DriverTable& d = Driver(backend_);
  const char* stage = "graph kernels";
  Status st = Call(-1, stage, Entry::kModuleLoadData, [&] { return d.ModuleLoadData(&module_, kGraphKernelsPtx); });
  struct Want {
    const char* name;
    CUfunction* f;
  };
  for (Want w : {Want{"jaxvmm_take_offload", &take_offload_}, Want{"jaxvmm_take_reload", &take_reload_},
                 Want{"jaxvmm_revoke", &revoke_}}) {
    if (!st.ok()) break;
    st = Call(-1, stage, Entry::kModuleGetFunction, [&] { return d.ModuleGetFunction(w.f, module_, w.name); });
  }
  if (!st.ok()) {
    if (module_) d.ModuleUnload(module_);
    module_ = nullptr;
    why_ = st.ToString();
  }
  return st;
}

void GraphKernels::Unload() {
  if (module_) Driver(backend_).ModuleUnload(module_);
  module_ = nullptr;
}

Status GraphKernels::Launch(CUfunction f, CUstream s, void** params, const char* stage) const {
  const DriverTable& d = Driver(backend_);
  return Call(-1, stage, Entry::kLaunchKernel, [&] { return d.LaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, params, nullptr); });
}

Status GraphKernels::TakeOffload(CUstream s, CUdeviceptr arm, CUdeviceptr token_out, CUdeviceptr knock) const {
  void* p[] = {&arm, &token_out, &knock};
  return Launch(take_offload_, s, p, "offload (capture)");
}

Status GraphKernels::TakeReload(CUstream s, CUdeviceptr token_in, CUdeviceptr ready, CUdeviceptr probe, CUdeviceptr request,
                                CUdeviceptr go) const {
  void* p[] = {&token_in, &ready, &probe, &request, &go};
  return Launch(take_reload_, s, p, "reload (capture)");
}

Status GraphKernels::Revoke(CUstream s, CUdeviceptr word, uint64_t expect, CUdeviceptr result) const {
  unsigned long long e = expect;
  void* p[] = {&word, &e, &result};
  return Launch(revoke_, s, p, "graph revoke");
}

}  // namespace jaxvmm
