// Graph-mode grant kernels (DESIGN.md, "Graph mode"). One thread each; recorded into the captured
// round like any other node. The PTX of this file is checked in as ffi/graph_kernels_ptx.h
// (tools/gen_ptx.sh), loaded at run time with cuModuleLoadData: no CUDA toolkit is needed to build
// jaxvmm. driver_posix.cc implements the same kernels as host functions with the same memory-ordering
// contract.
//
// Words: `arm` and `ready` are device memory (cuMemAlloc), written by the poller only with
// cuStreamWriteValue64 on its copy streams (ordered after the copy that makes the grant true) and
// taken back by the device or by jaxvmm_revoke with an atomic. knock/probe/request/go/result are
// pinned host words the poller reads.
typedef unsigned long long u64;

__device__ __forceinline__ void backoff(unsigned* ns) {
  __nanosleep(*ns);
  if (*ns < 2048) *ns *= 2;
}

// Offload round: take the pre-armed grant (arm holds the round's token, 0: none). Without one, knock
// (a level the device holds while it waits) until the poller arms.
extern "C" __global__ void jaxvmm_take_offload(u64* arm, unsigned* token_out, volatile u64* knock) {
  u64 t = atomicExch(arm, 0ull);
  if (t == 0) {
    *knock = 1;
    __threadfence_system();
    unsigned ns = 32;
    for (;;) {
      if (*(volatile u64*)arm != 0 && (t = atomicExch(arm, 0ull)) != 0) break;
      backoff(&ns);
    }
    *knock = 0;
    __threadfence_system();
  }
  __threadfence();
  token_out[0] = (unsigned)t;
  token_out[1] = (unsigned)(t >> 32);
}

// Reload round: if `ready` names the probed token, the cell already holds its bytes (the poller wrote
// ready after the prefetch copy): consume the grant and go on. Else publish the probe, request and
// wait for go (the poller corrects the cell, or fills it with 0xFF).
extern "C" __global__ void jaxvmm_take_reload(const unsigned* token_in, u64* ready, volatile u64* probe,
                                              volatile u64* request, volatile u64* go) {
  const u64 t = (u64)token_in[0] | ((u64)token_in[1] << 32);
  if (t != 0 && atomicCAS(ready, t, 0ull) == t) {
    __threadfence();
    return;
  }
  *probe = t;
  __threadfence_system();
  *request = 1;
  __threadfence_system();
  unsigned ns = 32;
  while (*go != 1) backoff(&ns);
  *go = 0;
  __threadfence_system();
}

// Revocation (poller, on the stream that wrote the grant, so it runs after that write): take the
// grant back if it is still there. expect != 0: only if word == expect. *result = what was there
// (nonzero: revoked; 0: the device took it, its round is live).
extern "C" __global__ void jaxvmm_revoke(u64* word, u64 expect, volatile u64* result) {
  const u64 old = expect ? atomicCAS(word, expect, 0ull) : atomicExch(word, 0ull);
  *result = expect ? (old == expect ? old : 0ull) : old;
  __threadfence_system();
}
