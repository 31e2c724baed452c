// Diagnostics for hangs on machines without a debugger: every thread's native stack, printed by the
// thread itself from a signal handler. Plain POSIX; nothing else in jaxvmm depends on it.
#pragma once

#include <string>

namespace jaxvmm {

// Writes "thread TID (NAME)" and that thread's return addresses (backtrace_symbols_fd: "object(symbol+off)
// [addr]") for every thread of this process to `fd`. A thread that does not answer within
// `per_thread_ms` (its signal masked, or stuck in the kernel) is listed without a stack. Returns how many
// threads answered. Meant for a process that is about to be killed (a watchdog): the signal interrupts
// whatever each thread was doing, so a blocking call may return EINTR to its caller.
int DumpThreadStacks(int fd, int per_thread_ms = 300);

}  // namespace jaxvmm
