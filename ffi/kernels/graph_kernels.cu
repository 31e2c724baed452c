// Graph-mode kernels (DESIGN.md, "Graph mode"). Recorded into the captured round like any other node.
// The PTX of this file is checked in as ffi/graph_kernels_ptx.h (tools/gen_ptx.sh), loaded at run time
// with cuModuleLoadData: no CUDA toolkit is needed to build jaxvmm. driver_posix.cc implements the same
// kernels as host functions with the same memory-ordering contract.
//
// A channel has K cells (a ring). Its words in device memory (`Cells`; graph_words.h, DeviceWords: the same layout)
// hold one grant per cell (offload: the armed token; reload: the token whose bytes the cell holds),
// the cells' addresses and the pinned words each cell's round publishes (filled/done), all written by
// the poller only with cuStreamWriteValue64 on its copy streams, ordered after the copy that makes the
// grant true, and taken back by the device or by jaxvmm_revoke with an atomic.
//
// A round (K > 1) is three nodes: the one-thread take kernel picks the cell whose grant it took and
// leaves its address in `ptr` (and its flag in `publish`); jaxvmm_cell_copy copies into or out of
// `*ptr`; the one-thread jaxvmm_publish writes the flag.
// knock/probe/request/go/result are pinned host words the poller reads.
typedef unsigned long long u64;

#define JAXVMM_MAX_CELLS 4

struct Cells {
  u64 grant[JAXVMM_MAX_CELLS];  // offload: armed token (0: none); reload: the token the cell holds
  u64 cell[JAXVMM_MAX_CELLS];   // the cells' addresses (an offload cell's changes when the poller lends it)
  u64 flag[JAXVMM_MAX_CELLS];   // the pinned filled/done word of each cell (constant)
  u64 ncells;                   // K (constant)
  u64 next;                     // offload: where the next scan starts (round robin)
  u64 ptr;                      // the chosen cell's address (take kernel -> copy kernel)
  u64 publish;                  // the chosen cell's flag word
  u64 stable;                   // 1: no cell address ever changes (no spares, no page trades; constant)
  u64 pad[15];
};
static_assert(sizeof(Cells) == 256, "Cells layout (graph_words.h)");

// Programmatic dependent launch (sm_90 and later; tools/gen_ptx.sh builds a compute_90 module with
// these and a compute_80 one without). A round's copy and publish kernels are launched early
// (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, graph_kernels.cc): their blocks may be
// scheduled once every block of the kernel before them has run pdl_trigger() (or exited), and
// pdl_wait() returns once that kernel has completed and its memory operations are performed and
// visible: what the kernel boundary gave before, without the launch latency of the next kernel.
// Without an early launch (compute_80, or a launch without the attribute) both do nothing.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void backoff(unsigned* ns) {
  __nanosleep(*ns);
  if (*ns < 2048) *ns *= 2;
}

// A ticket token into XLA's 8-byte token buffer, which is only 4-byte aligned: two 32-bit halves.
__device__ __forceinline__ void store_token(unsigned* out, u64 t) {
  out[0] = (unsigned)t;
  out[1] = (unsigned)(t >> 32);
}

// What a take reads whatever grant it gets, loaded before its atomic so that their round trips overlap
// it (a take is one thread: each dependent load is a round trip to L2): the cells' addresses and flag
// words. A flag word never changes; a cell's address does when the poller lends an offload cell or
// trades a large call site's pages (before the grant that names the new address), so those channels
// (`stable` == 0) read it again after taking the grant.
struct CellWords {
  u64 stable, cell[JAXVMM_MAX_CELLS], flag[JAXVMM_MAX_CELLS];
};

__device__ __forceinline__ void load_cell_words(Cells* c, CellWords* w) {
  w->stable = *(volatile u64*)&c->stable;
#pragma unroll
  for (int j = 0; j < JAXVMM_MAX_CELLS; ++j) {
    w->cell[j] = *(volatile u64*)&c->cell[j];
    w->flag[j] = *(volatile u64*)&c->flag[j];
  }
}

// Entry i of a register array without indexing it (a dynamic index would put the array in local memory).
__device__ __forceinline__ u64 pick(const u64* a, u64 i) {
  u64 v = a[0];
#pragma unroll
  for (int j = 1; j < JAXVMM_MAX_CELLS; ++j)
    if (i == (u64)j) v = a[j];
  return v;
}

// After the fence that follows taking cell i's grant: its address into `ptr`, its flag into `publish`.
__device__ __forceinline__ u64 choose(Cells* c, u64 i, const CellWords& w) {
  const u64 p = w.stable ? pick(w.cell, i) : *(volatile u64*)&c->cell[i];
  c->ptr = p;
  c->publish = pick(w.flag, i);
  return p;
}

// Offload round: take a pre-armed grant, scanning the K cells from `next` (the cell armed longest
// ago first: in steady state the one armed, so that cell is tried with the atomic at once, one round
// trip, and the others after a read). Without one, knock (a level the device holds while it waits)
// until the poller arms. Returns the chosen cell's address.
__device__ __forceinline__ u64 take_offload(Cells* c, unsigned* token_out, volatile u64* knock) {
  const u64 k = *(volatile u64*)&c->ncells, start = *(volatile u64*)&c->next;
  CellWords cw;
  load_cell_words(c, &cw);
  u64 i = start;
  u64 t = atomicExch(&c->grant[start], 0ull);  // exchanging 0 for 0 is harmless
  for (u64 j = 1; j < k && t == 0; ++j) {
    i = (start + j) % k;
    if (*(volatile u64*)&c->grant[i] != 0) t = atomicExch(&c->grant[i], 0ull);
  }
  if (t == 0) {
    *knock = 1;
    __threadfence_system();
    unsigned ns = 32;
    for (;;) {
      for (u64 j = 0; j < k && t == 0; ++j) {
        i = (start + j) % k;
        if (*(volatile u64*)&c->grant[i] != 0) t = atomicExch(&c->grant[i], 0ull);
      }
      if (t != 0) break;
      backoff(&ns);
    }
    *knock = 0;
    __threadfence_system();
  }
  pdl_trigger();  // the round's copy may be scheduled now (it waits for this kernel's end)
  __threadfence();
  c->next = (i + 1) % k;
  store_token(token_out, t);
  return choose(c, i, cw);
}

extern "C" __global__ void jaxvmm_take_offload(Cells* c, unsigned* token_out, volatile u64* knock) {
  (void)take_offload(c, token_out, knock);
}

// Reload round: if a cell's grant names the probed token, that cell already holds its bytes (the
// poller wrote the grant after the prefetch copy): consume it and go on. Else publish the probe,
// request and wait for go = 1 + the cell the poller put the bytes in (or filled with 0xFF).
__device__ __forceinline__ u64 take_reload(Cells* c, const unsigned* token_in, volatile u64* probe, volatile u64* request,
                                            volatile u64* go) {
  const u64 t = (u64)token_in[0] | ((u64)token_in[1] << 32);
  const u64 k = *(volatile u64*)&c->ncells;
  u64 grants[JAXVMM_MAX_CELLS];
#pragma unroll
  for (int j = 0; j < JAXVMM_MAX_CELLS; ++j) grants[j] = *(volatile u64*)&c->grant[j];
  CellWords cw;
  load_cell_words(c, &cw);
  if (t != 0) {
    // The cell whose grant the loads above saw naming t first (one atomic, usually the only one), then
    // every cell (a grant written since those loads).
#pragma unroll
    for (int j = 0; j < JAXVMM_MAX_CELLS; ++j)
      if ((u64)j < k && grants[j] == t && atomicCAS(&c->grant[j], t, 0ull) == t) {
        pdl_trigger();
        __threadfence();
        return choose(c, j, cw);
      }
    for (u64 i = 0; i < k; ++i) {
      if (atomicCAS(&c->grant[i], t, 0ull) == t) {
        pdl_trigger();
        __threadfence();
        return choose(c, i, cw);
      }
    }
  }
  *probe = t;
  __threadfence_system();
  *request = 1;
  __threadfence_system();
  unsigned ns = 32;
  u64 g;
  while ((g = *go) == 0) backoff(&ns);
  pdl_trigger();  // only once the host has answered: an early copy's blocks never wait beside a take that waits
  *go = 0;
  __threadfence_system();
  return choose(c, g - 1, cw);
}

extern "C" __global__ void jaxvmm_take_reload(Cells* c, const unsigned* token_in, volatile u64* probe,
                                              volatile u64* request, volatile u64* go) {
  (void)take_reload(c, token_in, probe, request, go);
}

// Revocation (poller, on the stream that wrote the grant, so it runs after that write): take the
// grant back if it is still there. expect != 0: only if word == expect. *result = what was there
// (nonzero: revoked; 0: the device took it, its round is live).
extern "C" __global__ void jaxvmm_revoke(u64* word, u64 expect, volatile u64* result) {
  const u64 old = expect ? atomicCAS(word, expect, 0ull) : atomicExch(word, 0ull);
  *result = expect ? (old == expect ? old : 0ull) : old;
  __threadfence_system();
}

// Units [i, nv) of a grid-stride copy (this thread's, from unit i on): four loads in flight per thread
// before their stores, then one at a time.
template <typename V>
__device__ __forceinline__ void copy_units(V* d, const V* s, u64 i, u64 nv, u64 stride) {
  for (; i + 3 * stride < nv; i += 4 * stride) {
    const V a = s[i], b = s[i + stride], e = s[i + 2 * stride], f = s[i + 3 * stride];
    d[i] = a;
    d[i + stride] = b;
    d[i + 2 * stride] = e;
    d[i + 3 * stride] = f;
  }
  for (; i < nv; i += stride) d[i] = s[i];
}

// Grid-stride copy of n bytes in units of V, after a head of bytes that aligns dst to sizeof(V)
// (src is aligned alike: the caller checked dst ^ src), and a tail of bytes.
template <typename V>
__device__ __forceinline__ void copy_as(char* dst, const char* src, u64 n) {
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  const u64 w = sizeof(V);
  u64 head = (w - ((u64)dst & (w - 1))) & (w - 1);
  if (head > n) head = n;
  for (u64 i = tid; i < head; i += stride) dst[i] = src[i];
  const u64 nv = (n - head) / w;
  copy_units((V*)(dst + head), (const V*)(src + head), tid, nv, stride);
  for (u64 j = head + nv * w + tid; j < n; j += stride) dst[j] = src[j];
}

// The copy between a cell and XLA's buffer `other`: out == 0: cell <- other (offload); out != 0:
// other <- cell (reload). Any byte count and alignment (16-byte units when dst and src agree mod 16).
__device__ __forceinline__ void copy_cell(char* cell, u64 other, u64 n, u64 out) {
  char* dst = out ? (char*)other : cell;
  const char* src = out ? (const char*)cell : (const char*)other;
  const u64 mis = (u64)dst ^ (u64)src;
  if ((mis & 15) == 0) copy_as<uint4>(dst, src, n);
  else if ((mis & 7) == 0) copy_as<uint2>(dst, src, n);
  else if ((mis & 3) == 0) copy_as<unsigned>(dst, src, n);
  else if ((mis & 1) == 0) copy_as<unsigned short>(dst, src, n);
  else copy_as<unsigned char>(dst, src, n);
}

// The copy of an offload round into the cell `get_cell()` returns (every thread calls it): the copy's
// first loads do not depend on the cell, so every thread issues them before it and holds them in
// registers (a 1 MiB round's whole source), and the source's read latency overlaps finding the cell
// (the load of `ptr` the take kernel wrote). A cell
// is a slot's start (aligned to the VMM granularity), so the unit V is set by the source's alignment alone.
template <typename V, typename GetCell>
__device__ __forceinline__ void offload_prefetched(GetCell get_cell, const char* src, u64 n) {
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  const u64 w = sizeof(V), nv = n / w;
  const V* s = (const V*)src;
  V r[4];
#pragma unroll
  for (int u = 0; u < 4; ++u)
    if (tid + u * stride < nv) r[u] = s[tid + u * stride];
  char* cell = get_cell();
  if ((u64)cell & 15) {  // never (see above); correct all the same
    copy_cell(cell, (u64)src, n, 0);
    return;
  }
  V* d = (V*)cell;
#pragma unroll
  for (int u = 0; u < 4; ++u)
    if (tid + u * stride < nv) d[tid + u * stride] = r[u];
  copy_units(d, s, tid + 4 * stride, nv, stride);
  for (u64 j = nv * w + tid; j < n; j += stride) cell[j] = src[j];
}

template <typename GetCell>
__device__ __forceinline__ void offload_into(GetCell get_cell, u64 src, u64 n) {
  const char* s = (const char*)src;
  if ((src & 15) == 0) offload_prefetched<uint4>(get_cell, s, n);
  else if ((src & 7) == 0) offload_prefetched<uint2>(get_cell, s, n);
  else if ((src & 3) == 0) offload_prefetched<unsigned>(get_cell, s, n);
  else if ((src & 1) == 0) offload_prefetched<unsigned short>(get_cell, s, n);
  else offload_prefetched<unsigned char>(get_cell, s, n);
}

// A round's copy: copies into or out of the cell the take kernel chose. It publishes nothing: the next
// node (jaxvmm_publish) does, after the kernel boundary, which orders every block's stores before it
// without the fences and block count a grid-wide "last block" needs (measured on the H200: ~1.8 us of a
// ~4.6 us 1 MiB round that published from its last block; tools/micro/round_pieces.py at e047c8e).
// Launched early (sm_90): it may start while the take kernel ends, so it reads `ptr` and touches the
// cell only after pdl_wait(). An offload's first loads of XLA's buffer may come before it: the take
// kernel started after everything before it on XLA's stream had completed, and this grid starts after
// the take started.
extern "C" __global__ void jaxvmm_cell_copy(Cells* c, u64 other, u64 n, u64 out) {
  pdl_trigger();  // the publish node may be scheduled (one thread; it waits for this grid's end)
  auto cell = [&] {
    pdl_wait();
    return (char*)*(volatile u64*)&c->ptr;
  };
  if (out) copy_cell(cell(), other, n, 1);
  else offload_into(cell, other, n);  // the source's loads in flight while `ptr` is read
}

// A round's last node: one thread writes 1 into the chosen cell's filled/done word.
// The copy before it is a finished kernel of the same stream, so its bytes are visible device-wide
// (the poller's D2H or the XLA reader that follows) before the poller can see the flag.
// Launched early (sm_90): pdl_wait() returns once the copy has completed and its stores are performed,
// as the kernel boundary did.
extern "C" __global__ void jaxvmm_publish(Cells* c) {
  pdl_wait();
  *(volatile u64*)*(volatile u64*)&c->publish = 1;
}

// The op ring's copy (the offloads and reloads XLA's host thread enqueues, outside any capture): n
// bytes from src to dst, and with `word` != 0 one thread also writes `value` there as two 32-bit
// halves (an offload's token into XLA's 4-byte aligned output). One launch instead of a
// cuMemcpyDtoDAsync and a token copy: on the H200 a launch costs the handler less host time than
// either (ffi/DESIGN.md, "Offload and reload").
extern "C" __global__ void jaxvmm_copy(u64 dst, u64 src, u64 n, unsigned* word, u64 value) {
  if (word && blockIdx.x == 0 && threadIdx.x == 0) store_token(word, value);
  copy_cell((char*)dst, src, n, 0);
}

// The op ring's reload (ffi/DESIGN.md, "Offload and reload"): the copy out of the staging cell `src`
// into XLA's buffer `dst`, and the wait that makes it the right ticket's bytes, in one launch instead
// of a probe copy, a stream memop wait and a copy. Each block's thread 0 reads the token XLA's stream
// holds and publishes it to the resolver (probe, then seen = seq: the resolver polls seen, a plain
// load of pinned memory): block 0 always, every block that is about to wait (the stores are the same,
// so the resolver never depends on a block that may not be resident while others wait). A token equal
// to the predicted `tag` (!= 0) is a hit: the prefetch is in the cell (XLA's stream waited for its
// event before this launch) and the copy goes on at once. Anything else waits until the resolver has
// put the right bytes (or 0xFF) in the cell and written ready >= seq on its stream, behind that copy.
// Launched with at most one block per SM (GraphKernels::RingReloadBlocks): while its blocks wait, every
// SM keeps room for a kernel the release may depend on.
extern "C" __global__ void jaxvmm_ring_reload(u64 dst, u64 src, u64 n, const unsigned* token_in, u64 tag,
                                              volatile u64* probe, volatile u64* seen, u64 seq, volatile u64* ready) {
  if (threadIdx.x == 0) {
    const u64 t = (u64)token_in[0] | ((u64)token_in[1] << 32);
    const bool hit = tag != 0 && t == tag;
    if (blockIdx.x == 0 || !hit) {
      *probe = t;
      __threadfence_system();
      *seen = seq;
      __threadfence_system();
    }
    if (!hit) {
      unsigned ns = 32;
      while (*ready < seq) backoff(&ns);
      __threadfence_system();
    }
  }
  __syncthreads();
  copy_cell((char*)src, dst, n, 1);
}
