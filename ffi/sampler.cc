#include "sampler.h"

#include <chrono>

#include "registry.h"
#include "slot.h"
#include "vmm.h"

namespace jaxvmm {
namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

MemorySampler::MemorySampler(Backend b, int device, size_t capacity, int64_t interval_ns)
    : backend_(b), device_(device), interval_ns_(interval_ns), ring_(capacity) {}

Status MemorySampler::Start(Backend b, int device, size_t capacity, int64_t interval_ns,
                            std::unique_ptr<MemorySampler>* out) {
  if (capacity < 1) return Status(Code::kInvalidArgument, "memory sampler: capacity must be >= 1");
  if (interval_ns < 1000) return Status(Code::kInvalidArgument, "memory sampler: interval must be >= 1 us");
  JAXVMM_RETURN_IF_ERROR(CheckCapability(b, device, Location{CU_MEM_LOCATION_TYPE_DEVICE, device}));
  std::unique_ptr<MemorySampler> s(new MemorySampler(b, device, capacity, interval_ns));
  s->mapped_ = Registry::Get().MappedGauge(b, device, /*internal_only=*/false);
  s->internal_ = Registry::Get().MappedGauge(b, device, /*internal_only=*/true);
  s->start_ns_ = NowNs();
  {
    ScopedContext ctx(b, device);
    JAXVMM_RETURN_IF_ERROR(ctx.status());
    MemorySample first;
    if (!s->Sample(&first)) {
      size_t free_b = 0, total = 0;
      CUresult r = Driver(b).MemGetInfo(&free_b, &total);
      return Status::Driver(r, Entry::kMemGetInfo).At(-1, "memory sampler");
    }
    s->Record(first);
  }
  s->thread_ = std::thread([p = s.get()] { p->Run(); });
  *out = std::move(s);
  return Status();
}

MemorySampler::~MemorySampler() { Stop(); }

void MemorySampler::Stop() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

bool MemorySampler::Sample(MemorySample* s) {
  s->mapped = mapped_->value();
  s->internal = internal_->value();
  if (backend_ == Backend::kCuda) {
    size_t free_b = 0, total = 0;
    if (Driver(backend_).MemGetInfo(&free_b, &total) != CUDA_SUCCESS) return false;
    s->used = static_cast<int64_t>(total - free_b);
    total_.store(static_cast<int64_t>(total), std::memory_order_relaxed);
  } else {
    s->used = s->mapped;
  }
  s->t_ns = NowNs() - start_ns_;
  return true;
}

void MemorySampler::Record(const MemorySample& s) {
  std::lock_guard<std::mutex> lock(mu_);
  ring_[next_] = s;
  next_ = (next_ + 1) % ring_.size();
  if (summary_.taken == 0) {
    summary_.first = s;
    summary_.peak = s;
  } else if (s.used > summary_.peak.used) {
    summary_.peak = s;
  }
  summary_.peak_mapped = std::max(summary_.peak_mapped, s.mapped);
  ++summary_.taken;
  summary_.kept = std::min<int64_t>(summary_.taken, static_cast<int64_t>(ring_.size()));
  summary_.elapsed_ns = s.t_ns;
}

void MemorySampler::Run() {
  ScopedContext ctx(backend_, device_);
  const auto interval = std::chrono::nanoseconds(interval_ns_);
  auto next = std::chrono::steady_clock::now() + interval;
  while (!stop_.load(std::memory_order_relaxed)) {
    std::this_thread::sleep_until(next);
    next += interval;
    auto now = std::chrono::steady_clock::now();
    if (next < now) next = now + interval;  // fell behind (a slow driver call): no burst to catch up
    MemorySample s;
    if (ctx.status().ok() && Sample(&s)) {
      Record(s);
    } else {
      std::lock_guard<std::mutex> lock(mu_);
      ++summary_.errors;
    }
  }
  // One last sample at stop: the timeline ends at the moment the caller stopped it.
  MemorySample s;
  if (ctx.status().ok() && Sample(&s)) Record(s);
}

MemorySamplerSummary MemorySampler::Summary() const {
  std::lock_guard<std::mutex> lock(mu_);
  MemorySamplerSummary s = summary_;
  s.total = total_.load(std::memory_order_relaxed);
  return s;
}

std::vector<MemorySample> MemorySampler::Series() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<MemorySample> out;
  size_t kept = static_cast<size_t>(summary_.kept);
  out.reserve(kept);
  size_t start = kept < ring_.size() ? 0 : next_;
  for (size_t i = 0; i < kept; ++i) out.push_back(ring_[(start + i) % ring_.size()]);
  return out;
}

}  // namespace jaxvmm
