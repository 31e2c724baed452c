#include "graph_kernels.h"

#include "graph_kernels_ptx.h"
#include "vmm.h"

namespace jaxvmm {

GraphKernels::~GraphKernels() { Unload(); }

Status GraphKernels::Load(int device) {
  if (tried_) return module_ ? Status() : Status(Code::kUnavailable, why_);
  tried_ = true;
  const DriverTable& d = Driver(backend_);
  CUdevice dev;
  int sms = 0;
  int major = 0;
  if (d.DeviceGet(&dev, device) == CUDA_SUCCESS) {
    if (d.DeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) == CUDA_SUCCESS && sms > 0)
      sms_ = static_cast<unsigned>(sms);
    if (d.DeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev) != CUDA_SUCCESS) major = 0;
  }
  // sm_90 and later: the compute_90 module, whose round kernels can be launched early. Otherwise the
  // compute_80 one (its kernels have no griddepcontrol).
  sm90_ = major >= 9;
  const char* stage = "graph kernels";
  Status st = Call(-1, stage, Entry::kModuleLoadData,
                   [&] { return d.ModuleLoadData(&module_, sm90_ ? kGraphKernelsPtx90 : kGraphKernelsPtx); });
  struct Want {
    const char* name;
    CUfunction* f;
  };
  for (Want w : {Want{"jaxvmm_take_offload", &take_offload_}, Want{"jaxvmm_take_reload", &take_reload_},
                 Want{"jaxvmm_revoke", &revoke_}, Want{"jaxvmm_cell_copy", &cell_copy_},
                 Want{"jaxvmm_publish", &publish_}, Want{"jaxvmm_copy", &copy_},
                 Want{"jaxvmm_ring_reload", &ring_reload_}}) {
    if (!st.ok()) break;
    st = Call(-1, stage, Entry::kModuleGetFunction, [&] { return d.ModuleGetFunction(w.f, module_, w.name); });
  }
  if (!st.ok()) {
    if (module_) d.ModuleUnload(module_);
    module_ = nullptr;
    sm90_ = false;
    why_ = st.ToString();
  }
  return st;
}

void GraphKernels::Unload() {
  warmed_.store(false, std::memory_order_release);
  if (module_) Driver(backend_).ModuleUnload(module_);
  module_ = nullptr;
}

Status GraphKernels::Launch(CUfunction f, CUstream s, void** params, const char* stage, unsigned blocks, unsigned threads,
                            bool early) const {
  const DriverTable& d = Driver(backend_);
  // Early only with the compute_90 module: its round kernels wait for the kernel before them.
  if (!(early && sm90_))
    return Call(-1, stage, Entry::kLaunchKernel, [&] { return d.LaunchKernel(f, blocks, 1, 1, threads, 1, 1, 0, s, params, nullptr); });
  CUlaunchAttribute attr{};
  attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attr.value.programmaticStreamSerializationAllowed = 1;
  CUlaunchConfig cfg{};
  cfg.gridDimX = blocks;
  cfg.gridDimY = cfg.gridDimZ = 1;
  cfg.blockDimX = threads;
  cfg.blockDimY = cfg.blockDimZ = 1;
  cfg.sharedMemBytes = 0;
  cfg.hStream = s;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return Call(-1, stage, Entry::kLaunchKernelEx, [&] { return d.LaunchKernelEx(&cfg, f, params, nullptr); });
}

Status GraphKernels::TakeOffload(CUstream s, CUdeviceptr cells, CUdeviceptr token_out, CUdeviceptr knock) const {
  void* p[] = {&cells, &token_out, &knock};
  return Launch(take_offload_, s, p, "offload (capture)");
}

Status GraphKernels::TakeReload(CUstream s, CUdeviceptr cells, CUdeviceptr token_in, CUdeviceptr probe, CUdeviceptr request,
                                CUdeviceptr go) const {
  void* p[] = {&cells, &token_in, &probe, &request, &go};
  return Launch(take_reload_, s, p, "reload (capture)");
}

unsigned GraphKernels::CopyBlocks(size_t nbytes) {
  const size_t per_block = size_t{kCopyThreads} * 16 * 4;
  const size_t b = (nbytes + per_block - 1) / per_block;
  return static_cast<unsigned>(b < 1 ? 1 : b > kMaxCopyBlocks ? kMaxCopyBlocks : b);
}

Status GraphKernels::CellCopy(CUstream s, CUdeviceptr cells, CUdeviceptr other, size_t nbytes, bool out) const {
  unsigned long long n = nbytes, o = out ? 1 : 0;
  void* p[] = {&cells, &other, &n, &o};
  return Launch(cell_copy_, s, p, out ? "reload (capture)" : "offload (capture)", CopyBlocks(nbytes), kCopyThreads,
                /*early=*/true);
}

Status GraphKernels::Publish(CUstream s, CUdeviceptr cells, const char* stage) const {
  void* p[] = {&cells};
  return Launch(publish_, s, p, stage, 1, 1, /*early=*/true);
}

Status GraphKernels::Copy(CUstream s, CUdeviceptr dst, CUdeviceptr src, size_t nbytes, CUdeviceptr word, uint64_t value,
                          const char* stage) const {
  unsigned long long n = nbytes, v = value;
  void* p[] = {&dst, &src, &n, &word, &v};
  return Launch(copy_, s, p, stage, CopyBlocks(nbytes), kCopyThreads);
}

Status GraphKernels::RingReload(CUstream s, CUdeviceptr dst, CUdeviceptr src, size_t nbytes, CUdeviceptr token_in, uint64_t tag,
                                CUdeviceptr probe, CUdeviceptr seen, uint64_t seq, CUdeviceptr ready) const {
  unsigned long long n = nbytes, t = tag, q = seq;
  void* p[] = {&dst, &src, &n, &token_in, &t, &probe, &seen, &q, &ready};
  return Launch(ring_reload_, s, p, "reload", RingReloadBlocks(nbytes), kCopyThreads);
}

unsigned GraphKernels::RingReloadBlocks(size_t nbytes) const {
  unsigned b = CopyBlocks(nbytes);
  if (b > kMaxRingReloadBlocks) b = kMaxRingReloadBlocks;
  return sms_ && b > sms_ ? sms_ : b;
}

Status GraphKernels::Revoke(CUstream s, CUdeviceptr word, uint64_t expect, CUdeviceptr result) const {
  unsigned long long e = expect;
  void* p[] = {&word, &e, &result};
  return Launch(revoke_, s, p, "graph revoke");
}

}  // namespace jaxvmm
