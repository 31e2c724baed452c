#include "fault.h"

#include <atomic>
#include <mutex>

namespace jaxvmm {
namespace {

struct Rule {
  Entry entry;
  int64_t skip;
  int64_t remaining;  // < 0: forever
  CUresult error;
};

struct FaultState {
  std::atomic<int> armed{0};
  std::mutex mu;
  std::vector<Rule> rules;
  std::atomic<int64_t> calls[kEntryCount] = {};
  std::atomic<int64_t> live_handles{0}, live_reservations{0}, live_mappings{0}, injected{0};

  bool ShouldFail(Entry e, CUresult* out) {
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = rules.begin(); it != rules.end(); ++it) {
      if (it->entry != e) continue;
      if (it->skip > 0) {
        --it->skip;
        continue;
      }
      *out = it->error;
      if (it->remaining > 0 && --it->remaining == 0) {
        rules.erase(it);
        armed.store(static_cast<int>(rules.size()), std::memory_order_relaxed);
      }
      injected.fetch_add(1, std::memory_order_relaxed);
      return true;
    }
    return false;
  }
};

FaultState g_state[kBackendCount];

template <Entry E>
void Account(FaultState& st) {
  constexpr auto r = std::memory_order_relaxed;
  if constexpr (E == Entry::kMemCreate || E == Entry::kMemImportFromShareableHandle) st.live_handles.fetch_add(1, r);
  if constexpr (E == Entry::kMemRelease) st.live_handles.fetch_sub(1, r);
  if constexpr (E == Entry::kMemAddressReserve) st.live_reservations.fetch_add(1, r);
  if constexpr (E == Entry::kMemAddressFree) st.live_reservations.fetch_sub(1, r);
  if constexpr (E == Entry::kMemMap) st.live_mappings.fetch_add(1, r);
  if constexpr (E == Entry::kMemUnmap) st.live_mappings.fetch_sub(1, r);
}

template <int B, Entry E, typename Fn>
struct Trampoline;

template <int B, Entry E, typename... A>
struct Trampoline<B, E, CUresult(CUDAAPI*)(A...)> {
  static CUresult CUDAAPI Call(A... args) {
    FaultState& st = g_state[B];
    st.calls[static_cast<int>(E)].fetch_add(1, std::memory_order_relaxed);
    CUresult injected;
    if (st.armed.load(std::memory_order_relaxed) != 0 && st.ShouldFail(E, &injected)) return injected;
    const DriverTable& raw = RawDriver(static_cast<Backend>(B));
    auto fn = reinterpret_cast<CUresult(CUDAAPI*)(A...)>(reinterpret_cast<void* const*>(&raw)[static_cast<int>(E)]);
    if (fn == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fn(args...);
    if (r == CUDA_SUCCESS) Account<E>(st);
    return r;
  }
};

template <int B>
DriverTable MakeWrapper() {
  DriverTable t;
#define X(member, version) \
  t.member = &Trampoline<B, Entry::k##member, JAXVMM_PFN(member, version)>::Call;
  JAXVMM_DRIVER_ENTRIES(X)
#undef X
  return t;
}

}  // namespace

const DriverTable& Driver(Backend b) {
  static const DriverTable cuda = MakeWrapper<static_cast<int>(Backend::kCuda)>();
  static const DriverTable posix = MakeWrapper<static_cast<int>(Backend::kPosix)>();
  return b == Backend::kCuda ? cuda : posix;
}

void ArmFault(Backend b, Entry entry, int64_t nth, int64_t times, CUresult error) {
  FaultState& st = g_state[static_cast<int>(b)];
  std::lock_guard<std::mutex> lock(st.mu);
  st.rules.push_back(Rule{entry, nth > 1 ? nth - 1 : 0, times == 0 ? 1 : times, error});
  st.armed.store(static_cast<int>(st.rules.size()), std::memory_order_relaxed);
}

void ClearFaults(Backend b) {
  FaultState& st = g_state[static_cast<int>(b)];
  std::lock_guard<std::mutex> lock(st.mu);
  st.rules.clear();
  st.armed.store(0, std::memory_order_relaxed);
}

DriverCounters ReadCounters(Backend b) {
  FaultState& st = g_state[static_cast<int>(b)];
  DriverCounters c;
  c.live_handles = st.live_handles.load();
  c.live_reservations = st.live_reservations.load();
  c.live_mappings = st.live_mappings.load();
  c.injected = st.injected.load();
  c.calls.resize(kEntryCount);
  for (int i = 0; i < kEntryCount; ++i) c.calls[i] = st.calls[i].load();
  return c;
}

}  // namespace jaxvmm
