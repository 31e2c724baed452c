// Worker: one thread, one FIFO of tasks, each run with the device's context current. A task may come
// with an event to wait for first (PostAfter): the worker polls it (cuEventQuery) in FIFO order, as a
// stream of event waits and host functions would, for a fraction of the poster's host time (nothing
// but the event record it already made). It polls rather than blocks in cuEventSynchronize: XLA's
// thread can spin inside cuGraphLaunch holding a driver lock while the device waits for a worker's
// task, and a blocking wait could need that lock (DESIGN.md, "Why the workers poll"). No stream host
// function is used. Workers never touch Python.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "driver.h"
#include "status.h"

namespace jaxvmm {

class Worker {
 public:
  Worker(std::string name, Backend b, int device);
  ~Worker();  // drains the queue, then joins
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void Post(std::function<void()> task);  // never blocks on the task
  // Runs `task` once `event` (recorded by the caller before this call) has completed: after every task
  // posted before, the worker polls the event (a few spins, then sleeps of growing length up to
  // kMaxNapMicros), then runs the task with the poll's status (not OK: the query kept failing for
  // kErrorPatience, a failed context; the task still runs, so its bookkeeping is done). Never blocks
  // the caller on the task or the event.
  void PostAfter(CUevent event, std::function<void(const Status&)> task);
  // Runs `task` once `*word == value` (a pinned word the device writes, e.g. a kernel's store after
  // it read what the task needs): after every task posted before, the worker polls the word (plain
  // loads, no driver call), spinning then napping as PostAfter does. `watch` (an event the caller
  // recorded for the same op, may be null) is queried about once a millisecond for a failed context
  // only: its completion means nothing here (it may name an earlier point), but an error that lasts
  // kErrorPatience runs the task with it, since the device will never write the word.
  void PostWhen(const std::atomic<uint64_t>* word, uint64_t value, CUevent watch, std::function<void(const Status&)> task);
  static constexpr int kMaxNapMicros = 200;
  // How long a poll spins (yielding) before its first nap: the worker_spin_us setting (JAXVMM_DEBUG_WORKER_SPIN_US), default 50 µs.
  static int SpinMicros();
  static constexpr std::chrono::milliseconds kErrorPatience{1000};
  // Blocks until every task posted before this call has run.
  void Drain();
  const std::string& name() const { return name_; }

 private:
  void Run();

  const std::string name_;
  const Backend backend_;
  const int device_;
  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  struct Queued {
    CUevent event = nullptr;  // polled until complete before the task runs (null: none), or with `word`: watched for errors
    const std::atomic<uint64_t>* word = nullptr;  // PostWhen: polled until it holds `value`
    uint64_t value = 0;
    std::function<void(const Status&)> task;
  };
  void Enqueue(Queued q);
  Status WaitFor(const Queued& q) const;  // the worker's poll of one entry's event or word
  std::deque<Queued> queue_;
  bool sleeping_ = false;  // the thread waits on cv_ for an entry: a poster must notify
  bool stop_ = false;
  bool busy_ = false;
  std::thread thread_;
};

}  // namespace jaxvmm
