#include "ledger.h"

#include <chrono>
#include <cstdio>
#include <thread>

#include "vmm.h"

namespace jaxvmm {

// ---------------------------------------------------------------- async errors

void AsyncErrors::Record(CUstream stream, const Status& st) { pending_.emplace_back(stream, st); }

Status AsyncErrors::TakeFor(CUstream stream) {
  for (auto it = pending_.begin(); it != pending_.end(); ++it)
    if (it->first == stream) {
      Status st = it->second;
      pending_.erase(it);
      return st;
    }
  return Status();
}

Status AsyncErrors::TakeAny() {
  if (pending_.empty()) return Status();
  Status st = pending_.front().second;
  pending_.erase(pending_.begin());
  return st;
}

// ---------------------------------------------------------------- the ledger

Ledger::Ledger(Backend b, int device, uint64_t engine_key, HostStore& host, StagingArea& staging)
    : backend_(b), device_(device), host_(host), staging_(staging), tickets_(engine_key) {}

Ledger::~Ledger() {
  ScopedContext ctx(backend_, device_);
  const DriverTable& d = Driver(backend_);
  const char* what = "ledger teardown";
  tickets_.ForEach([&](Ticket& t) {
    host_.Free(t.host);
    if (t.d2h_done) GiveBack(what, Entry::kEventDestroy, [&] { return d.EventDestroy(t.d2h_done); });
    if (t.resident) staging_.Return(&t.resident, nullptr);
  });
  for (CUevent e : event_pool_) GiveBack(what, Entry::kEventDestroy, [&] { return d.EventDestroy(e); });
}

void Ledger::Retire(const Held& h, const std::shared_ptr<Ticket>& t) {
  Retired r;
  if (!tickets(h).MaybeFree(t, &r)) return;
  if (r.d2h_done) event_pool_.push_back(r.d2h_done);
  host_.Free(r.host);
  // Every reader of the device copy has completed (its op's completion dropped the pin), so the cell
  // is free once the copy that filled it is (its last recorded free event).
  if (r.resident) staging_.Return(&r.resident, nullptr);
}

void Ledger::DropTicket(const Held& h, uint64_t token) {
  std::string why;
  std::shared_ptr<Ticket> t = tickets(h).Find(token, &why);
  if (!t) return;
  t->dropped = true;
  if (t->claimed_by != 0) stale_ = true;  // a graph-mode reload cell may hold it as a guess
  ++counts_.drops;
  Retire(h, t);
}

void Ledger::Report(CUstream stream, const Status& st) {
  std::fprintf(stderr, "%s\n", st.ToString().c_str());
  Held h = Lock();
  errors_.Record(stream, st);
  ++counts_.errors;
}

Status Ledger::TakeFor(CUstream stream) {
  Held h = Lock();
  return errors_.TakeFor(stream);
}

Status Ledger::TakeAny() {
  Held h = Lock();
  return errors_.TakeAny();
}

uint64_t Ledger::ArmToken() {
  Held h = Lock();
  const uint64_t token = tickets_.ReserveToken();
  armed_.insert(token);  // before the device can take it (WaitUntilServed)
  return token;
}

void Ledger::WaitUntilServed(uint64_t token) {
  if (token == 0) return;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (;;) {
    {
      Held h = Lock();
      std::string why;
      std::shared_ptr<Ticket> a = tickets_.Find(token, &why);
      // No ticket yet for an armed token (its round's filled not served), or its D2H not enqueued yet.
      const bool pending = a ? !a->enqueued : armed_.count(token) > 0;
      if (!pending) return;
    }
    if (std::chrono::steady_clock::now() > deadline) return;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

bool Ledger::TakeStale() {
  Held h = Lock();
  const bool was = stale_;
  stale_ = false;
  return was;
}

Status Ledger::GetEvent(CUevent* out) {
  {
    Held h = Lock();
    if (!event_pool_.empty()) {
      *out = event_pool_.back();
      event_pool_.pop_back();
      return Status();
    }
  }
  return Call(-1, "event", Entry::kEventCreate, [&] { return Driver(backend_).EventCreate(out, CU_EVENT_DISABLE_TIMING); });
}

Status Ledger::CheckTicket(uint64_t token, const ArrayMeta& meta, bool reserve) {
  WaitUntilServed(token);  // a graph-mode round that made this token may not be served yet
  Held h = Lock();
  std::string why;
  auto t = tickets_.Find(token, &why);
  if (!t) return Status(Code::kInvalidArgument, why);
  if (t->reserved && !t->kept)
    return Status(Code::kInvalidArgument, TokenStr(token) + " was already reloaded (a ticket can be reloaded once)");
  if (t->meta.nbytes != meta.nbytes || t->meta.signature != meta.signature)
    return Status(Code::kInvalidArgument, TokenStr(token) + " does not match the shape/dtype of the reload");
  if (reserve && !t->kept) t->reserved = true;  // the eager reload that follows is the one allowed reload
  return Status();
}

Status Ledger::Keep(uint64_t token) {
  WaitUntilServed(token);
  Held h = Lock();
  std::string why;
  auto t = tickets_.Find(token, &why);
  if (!t) return Status(Code::kInvalidArgument, why);
  t->kept = true;
  t->reserved = false;
  return Status();
}

void Ledger::Unreserve(uint64_t token) {
  Held h = Lock();
  std::string why;
  if (auto t = tickets_.Find(token, &why)) t->reserved = false;
}

std::vector<std::pair<uint64_t, uint64_t>> Ledger::Unclaimed() {
  Held h = Lock();
  std::vector<std::pair<uint64_t, uint64_t>> out;
  tickets_.ForEach([&](const Ticket& t) {
    if (!t.consumed && !t.reserved && !t.dropped && t.claimed_by == 0) out.emplace_back(t.token, t.offload_seq);
  });
  return out;
}

}  // namespace jaxvmm
