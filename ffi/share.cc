#include "share.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <string>

namespace jaxvmm {
namespace {
std::atomic<int64_t> g_exports{0}, g_imports{0}, g_imported_slots{0}, g_views{0}, g_channel_fds{0};

Status Os(const char* what, int err) {
  return Status(err == EMFILE || err == ENFILE ? Code::kDriver : Code::kOutOfMemory,
                std::string(what) + ": " + std::strerror(err));
}
}  // namespace

void CountExport() { g_exports.fetch_add(1); }
void CountImport(int64_t delta_slots) {
  if (delta_slots > 0) g_imports.fetch_add(1);
  g_imported_slots.fetch_add(delta_slots);
}
void CountView(int64_t delta) { g_views.fetch_add(delta); }

ShareStats ReadShareStats() {
  return ShareStats{g_exports.load(), g_imports.load(), g_imported_slots.load(), g_views.load(),
                    g_channel_fds.load()};
}

ExportChannel::~ExportChannel() {
  if (page_ != nullptr) munmap(page_, kChannelBytes);
  if (fd_ >= 0) {
    close(fd_);
    g_channel_fds.fetch_sub(1);
  }
}

Status ExportChannel::Open(int64_t slot) {
  if (open()) return Status();
  int fd = memfd_create("jaxvmm-channel", MFD_CLOEXEC);
  if (fd < 0) return Os("memfd_create (generation channel)", errno);
  if (ftruncate(fd, kChannelBytes) != 0) {
    int err = errno;
    close(fd);
    return Os("ftruncate (generation channel)", err);
  }
  void* p = mmap(nullptr, kChannelBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    close(fd);
    return Os("mmap (generation channel)", err);
  }
  g_channel_fds.fetch_add(1);
  fd_ = fd;
  page_ = new (p) ChannelPage{};
  page_->slot = static_cast<uint64_t>(slot);
  page_->pid = static_cast<int64_t>(getpid());
  page_->generation.store(0);
  page_->closed.store(0);
  page_->magic = kChannelMagic;
  return Status();
}

void ExportChannel::Publish(uint64_t generation) {
  if (page_ != nullptr) page_->generation.store(generation, std::memory_order_release);
}

void ExportChannel::MarkClosed() {
  if (page_ == nullptr) return;
  page_->generation.store(0, std::memory_order_release);
  page_->closed.store(1, std::memory_order_release);
}

int ExportChannel::Dup(Status* st) const {
  if (fd_ < 0) {
    *st = Status(Code::kInternal, "the slot has no generation channel");
    return -1;
  }
  int fd = fcntl(fd_, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) *st = Os("dup (generation channel)", errno);
  return fd;
}

}  // namespace jaxvmm
