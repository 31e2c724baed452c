#include "worker.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <thread>

#include "config.h"
#include "vmm.h"

namespace jaxvmm {

Worker::Worker(std::string name, Backend b, int device)
    : name_(std::move(name)), backend_(b), device_(device), thread_([this] { Run(); }) {}

Worker::~Worker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Worker::Post(std::function<void()> task) {
  PostAfter(nullptr, [t = std::move(task)](const Status&) { t(); });
}

void Worker::PostAfter(CUevent event, std::function<void(const Status&)> task) {
  Enqueue(Queued{event, nullptr, 0, std::move(task)});
}

void Worker::PostWhen(const std::atomic<uint64_t>* word, uint64_t value, CUevent watch, std::function<void(const Status&)> task) {
  Enqueue(Queued{watch, word, value, std::move(task)});
}

void Worker::Enqueue(Queued q) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(q));
    wake = sleeping_;  // a busy worker finds the entry on its own: no futex wake on the poster's thread
  }
  if (wake) cv_.notify_one();
}

int Worker::SpinMicros() {
  return static_cast<int>(std::clamp<int64_t>(EngineConfig::Get(Setting::kWorkerSpinUs), 0, 100000));
}

Status Worker::WaitFor(const Queued& q) const {
  // Spins first (yielding: a copy or kernel about to finish), then naps of 10, 20, ... kMaxNapMicros
  // µs: a far-off event (XLA's thread runs ahead of the device by a whole step) costs a wake-up per nap.
  // A query that fails is retried for kErrorPatience: only an error that persists (a failed context)
  // lets the task run before the event, so a passing error never has it act on work not done yet.
  // A word is read without the driver; its watch event is queried once a millisecond, for errors only.
  const DriverTable& d = Driver(backend_);
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto spin_until = start + std::chrono::microseconds(SpinMicros());
  auto next_watch = start + std::chrono::milliseconds(1);
  std::optional<Clock::time_point> failing;  // since when the query has been failing
  int nap = 10;
  for (;;) {
    bool queried = false;
    CUresult r = CUDA_SUCCESS;
    if (q.word) {
      if (q.word->load(std::memory_order_acquire) == q.value) return Status();
      if (q.event && Clock::now() >= next_watch) {
        next_watch = Clock::now() + std::chrono::milliseconds(1);
        r = d.EventQuery(q.event);  // its completion says nothing about the word: errors only
        queried = true;
      }
    } else {
      r = d.EventQuery(q.event);
      if (r == CUDA_SUCCESS) return Status();
      queried = true;
    }
    if (queried && (r == CUDA_SUCCESS || r == CUDA_ERROR_NOT_READY)) {
      failing.reset();
    } else if (queried) {
      if (!failing) failing = Clock::now();
      if (Clock::now() - *failing > kErrorPatience) return Status::Driver(r, Entry::kEventQuery).At(-1, name_.c_str());
    }
    if (Clock::now() < spin_until) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(nap));
    nap = std::min(nap * 2, kMaxNapMicros);
  }
}

void Worker::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
}

void Worker::Run() {
  ScopedContext ctx(backend_, device_);  // the device's primary context, for every task
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    sleeping_ = true;
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    sleeping_ = false;
    if (queue_.empty()) break;  // stop requested and drained
    Queued e = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    e.task(e.event || e.word ? WaitFor(e) : Status());
    lock.lock();
    busy_ = false;
    if (queue_.empty()) idle_cv_.notify_all();
  }
  idle_cv_.notify_all();
}

}  // namespace jaxvmm
