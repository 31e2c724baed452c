#include "debug_stacks.h"

#include <dirent.h>
#include <errno.h>
#include <execinfo.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

namespace jaxvmm {
namespace {

// One dump at a time. g_turn names the thread whose stack is wanted now. Its handler claims the turn
// (g_turn: tid -> -tid) before writing and hands it back done (g_done = tid); a thread answering after
// its turn passed (its signal was blocked, or it was in the kernel) finds another tid there and writes
// nothing, so its frames never land under the next thread's header. The dumper ends a turn that timed
// out by taking it back (tid -> 0); if the handler claimed it first, the dumper waits for it to finish.
std::mutex g_mu;
std::atomic<int> g_fd{-1};
std::atomic<long> g_turn{0};
std::atomic<long> g_done{0};

void OnSignal(int) {
  const int saved = errno;  // the interrupted code may read errno after the handler
  const long me = syscall(SYS_gettid);
  long expect = me;
  if (g_turn.compare_exchange_strong(expect, -me)) {
    void* frames[64];
    const int n = backtrace(frames, 64);
    const int fd = g_fd.load();
    if (fd >= 0) backtrace_symbols_fd(frames, n, fd);
    g_done.store(me);
  }
  errno = saved;
}

int Signal() { return SIGRTMIN + 7; }  // glibc keeps the first few real-time signals for itself

std::vector<long> Threads() {
  std::vector<long> tids;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') tids.push_back(std::strtol(e->d_name, nullptr, 10));
    closedir(d);
  }
  return tids;
}

std::string ThreadName(long tid) {
  char path[64], name[64] = {0};
  std::snprintf(path, sizeof(path), "/proc/self/task/%ld/comm", tid);
  if (FILE* f = std::fopen(path, "r")) {
    if (!std::fgets(name, sizeof(name), f)) name[0] = 0;
    std::fclose(f);
  }
  std::string s(name);
  if (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

}  // namespace

int DumpThreadStacks(int fd, int per_thread_ms) {
  std::lock_guard<std::mutex> lock(g_mu);
  void* warm[4];
  backtrace(warm, 4);  // the first call loads the unwinder (not async-signal-safe): do it here
  struct sigaction sa {}, old {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  if (sigaction(Signal(), &sa, &old) != 0) return 0;
  g_fd.store(fd);
  const long self = syscall(SYS_gettid);
  int answered = 0;
  for (long tid : Threads()) {
    char head[160];
    const int len = std::snprintf(head, sizeof(head), "\nthread %ld (%s)%s\n", tid, ThreadName(tid).c_str(),
                                  tid == self ? " [the dumping thread]" : "");
    if (write(fd, head, static_cast<size_t>(len)) < 0) break;
    g_done.store(0);
    g_turn.store(tid);
    if (syscall(SYS_tgkill, getpid(), tid, Signal()) != 0) {
      g_turn.store(0);
      continue;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(per_thread_ms);
    while (g_done.load() != tid && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    long expect = tid;
    if (!g_turn.compare_exchange_strong(expect, 0)) {  // the handler claimed the turn: it is writing
      const auto writing = std::chrono::steady_clock::now() + std::chrono::seconds(2);  // (its unwinder may be stuck)
      while (g_done.load() != tid && std::chrono::steady_clock::now() < writing) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    g_turn.store(0);
    if (g_done.load() == tid) {
      ++answered;
    } else {
      const char* no = "  (no answer: signal masked or the thread is stuck in the kernel)\n";
      if (write(fd, no, std::strlen(no)) < 0) break;
    }
  }
  // A late answer finds no turn and prints nothing; keep the handler (the signal's default action would
  // end the process), drop the fd.
  g_fd.store(-1);
  return answered;
}

}  // namespace jaxvmm
