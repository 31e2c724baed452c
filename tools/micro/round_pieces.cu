// Pieces of a graph-mode round, each as its own kernel, for tools/micro/round_pieces.py: which of the
// round's steps costs what on the device (not part of jaxvmm; compiled to PTX by that script's header).
typedef unsigned long long u64;
struct W {
  u64 grant, ready, arrive, blocks, ptr, pad[3];
};

__device__ __forceinline__ void copy16(char* dst, const char* src, u64 n) {
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;
  const u64 nv = n / 16;
  uint4* d = (uint4*)dst;
  const uint4* s = (const uint4*)src;
  u64 i = tid;
  for (; i + 3 * stride < nv; i += 4 * stride) {
    const uint4 a = s[i], b = s[i + stride], e = s[i + 2 * stride], f = s[i + 3 * stride];
    d[i] = a; d[i + stride] = b; d[i + 2 * stride] = e; d[i + 3 * stride] = f;
  }
  for (; i < nv; i += stride) d[i] = s[i];
}

__device__ __forceinline__ void finish(W* w, volatile u64* flag, int mode) {
  // mode 0: nothing; 1: count blocks, last resets; 2: + gpu fence publish to host; 3: + sys fences
  if (mode == 0) return;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const u64 done = atomicAdd(&w->blocks, 1ull);
    if (done == gridDim.x - 1) {
      w->blocks = 0; w->arrive = 0; w->ready = 0; w->grant = 1;
      if (mode >= 3) __threadfence_system();
      if (mode >= 2) *flag = 1;
      if (mode >= 3) __threadfence_system();
    }
  }
}

extern "C" __global__ void k_empty() {}
extern "C" __global__ void k_copy(W* w, u64 src, u64 dst, u64 n, volatile u64* flag, int mode) {
  copy16((char*)dst, (const char*)src, n);
  finish(w, flag, mode);
}
// one-thread take: exchange the grant, fence, store ptr
extern "C" __global__ void k_take(W* w, u64 dst) {
  u64 t = atomicExch(&w->grant, 0ull);
  __threadfence();
  w->ptr = dst + (t == 0 ? 0 : 0);
  w->grant = 1;
}
// fused: taker handshake then copy; pre: loads before the take; spin: plain spins first
extern "C" __global__ void k_fused(W* w, u64 src, u64 dst, u64 n, volatile u64* flag, int mode, int variant) {
  __shared__ u64 cell;
  if (variant == 2) {  // taker is block 0 (no arrive atomic)
    if (threadIdx.x == 0) {
      u64 p;
      if (blockIdx.x == 0) { u64 t = atomicExch(&w->grant, 0ull); __threadfence(); p = dst + (t == 7 ? 1 : 0); atomicExch(&w->ready, p); }
      else { while ((p = *(volatile u64*)&w->ready) == 0) {} __threadfence(); }
      cell = p;
    }
  } else if (variant == 3) {  // no handshake at all: every block reads the armed grant itself
    if (threadIdx.x == 0) { u64 t = *(volatile u64*)&w->grant; cell = dst + (t == 7 ? 1 : 0); }
  } else {
    if (threadIdx.x == 0) {
      u64 p;
      if (atomicAdd(&w->arrive, 1ull) == 0) { u64 t = atomicExch(&w->grant, 0ull); __threadfence(); p = dst + (t == 7 ? 1 : 0); atomicExch(&w->ready, p); }
      else { while ((p = *(volatile u64*)&w->ready) == 0) {} __threadfence(); }
      cell = p;
    }
  }
  __syncthreads();
  copy16((char*)cell, (const char*)src, n);
  finish(w, flag, mode);
}
