// Memory sampler: a thread that records device memory in use as a timeline, so that "what the device
// held at its fullest" is one moment's total, not a sum of separately measured peaks.
//
// Every `interval` the thread reads the driver's used bytes (cuMemGetInfo: total - free, every
// allocation of the process and of any other on the device) and, at the same moment, jaxvmm's mapped
// bytes on that device (all slots, and jaxvmm's internal ones: staging and graph-mode cells). Samples go
// into a ring preallocated at Start (the newest `capacity` are kept); the peak of the used bytes, with
// the mapped bytes at that sample, is tracked over every sample taken, so it is exact even after the
// ring wrapped. The thread never touches Python.
//
// POSIX backend (jax cpu): there is no device memory to ask a driver about; `used` is jaxvmm's mapped
// bytes on that device and nothing else.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "driver.h"
#include "stat_fields.h"
#include "status.h"

namespace jaxvmm {

class ByteGauge;

struct MemorySample {
  int64_t t_ns = 0;      // steady clock, since the sampler started
  int64_t used = 0;      // driver: total - free (POSIX: = mapped)
  int64_t mapped = 0;    // jaxvmm's mapped bytes on the device (every slot)
  int64_t internal = 0;  // of which jaxvmm's own (staging + graph-mode cells)
};

struct MemorySamplerSummary {
  int64_t taken = 0;   // samples taken (may exceed the ring's capacity)
  int64_t kept = 0;    // samples in the ring
  int64_t errors = 0;  // driver reads that failed (not recorded)
  int64_t total = 0;   // device memory (driver total; POSIX: 0)
  MemorySample first, peak;  // the first sample, and the one with the most `used`
  int64_t peak_mapped = 0;   // the most `mapped` of any sample
  int64_t elapsed_ns = 0;
};

// MemorySampler.summary() keys (and first, peak: samples).
inline constexpr StatField<MemorySamplerSummary> kSamplerSummaryFields[] = {
    {"taken", &MemorySamplerSummary::taken},
    {"kept", &MemorySamplerSummary::kept},
    {"errors", &MemorySamplerSummary::errors},
    {"total", &MemorySamplerSummary::total},
    {"peak_mapped", &MemorySamplerSummary::peak_mapped},
    {"elapsed_ns", &MemorySamplerSummary::elapsed_ns},
};

class MemorySampler {
 public:
  // Starts sampling (b, device) every `interval_ns` into a ring of `capacity` samples. The first sample
  // is taken before Start returns.
  static Status Start(Backend b, int device, size_t capacity, int64_t interval_ns,
                      std::unique_ptr<MemorySampler>* out);
  ~MemorySampler();  // stops the thread
  MemorySampler(const MemorySampler&) = delete;
  MemorySampler& operator=(const MemorySampler&) = delete;

  void Stop();  // idempotent; the samples stay readable
  MemorySamplerSummary Summary() const;
  std::vector<MemorySample> Series() const;  // oldest first

 private:
  MemorySampler(Backend b, int device, size_t capacity, int64_t interval_ns);
  bool Sample(MemorySample* s);  // false: the driver read failed
  void Record(const MemorySample& s);
  void Run();

  const Backend backend_;
  const int device_;
  const int64_t interval_ns_;
  const ByteGauge* mapped_ = nullptr;
  const ByteGauge* internal_ = nullptr;
  int64_t start_ns_ = 0;
  std::atomic<int64_t> total_{0};

  mutable std::mutex mu_;  // guards the ring and the summary; the sampler holds it only to record
  std::vector<MemorySample> ring_;
  size_t next_ = 0;
  MemorySamplerSummary summary_;

  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: started once the state above exists
};

}  // namespace jaxvmm
