// Worker: one thread, one FIFO of tasks. Host functions enqueued on CUDA streams only Post() here (no
// driver call ever runs inside a host function); the task runs on the worker's thread with the
// device's context current. Workers never touch Python.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "driver.h"

namespace jaxvmm {

class Worker {
 public:
  Worker(std::string name, Backend b, int device);
  ~Worker();  // drains the queue, then joins
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void Post(std::function<void()> task);  // never blocks on the task; safe from host functions
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
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  bool busy_ = false;
  std::thread thread_;
};

}  // namespace jaxvmm
