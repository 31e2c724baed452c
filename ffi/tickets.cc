#include "tickets.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "config.h"

namespace jaxvmm {
namespace {

uint64_t Salt() {
  static const uint64_t salt = std::random_device{}() | (uint64_t{std::random_device{}()} << 32);
  return salt;
}

// The check word mixes a per-process salt with the engine's (backend, device), so a token is valid
// only on the engine that issued it: tickets of another device or process are refused, not misread.
uint32_t Check(uint32_t number, uint64_t engine_key) {
  uint64_t z = number ^ Salt() ^ (engine_key * 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return static_cast<uint32_t>(z ^ (z >> 31)) | 1u;  // never 0, so no valid token is 0
}

}  // namespace

uint64_t MakeToken(uint32_t number, uint64_t key) { return number | (uint64_t{Check(number, key)} << 32); }

bool TokenValid(uint64_t token, uint64_t key) {
  const uint32_t number = static_cast<uint32_t>(token);
  return number != 0 && (token >> 32) == Check(number, key);
}

std::string TokenStr(uint64_t token) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "ticket %u", static_cast<unsigned>(token & 0xffffffffULL));
  return buf;
}

uint64_t TicketTable::ReserveToken() {
  // 2^32 - 1 numbers; skipping the live ones terminates because fewer than that are ever live.
  uint64_t token = 0;
  do {
    if (next_ == 0) next_ = 1;
    token = MakeToken(next_++, key_);
  } while (by_token_.count(token));
  return token;
}

std::shared_ptr<Ticket> TicketTable::Create(const ArrayMeta& meta) { return Create(meta, ReserveToken()); }

std::shared_ptr<Ticket> TicketTable::Create(const ArrayMeta& meta, uint64_t token) {
  if (token == 0 || by_token_.count(token)) return nullptr;
  auto t = std::make_shared<Ticket>();
  t->meta = meta;
  t->token = token;
  by_token_[t->token] = t;
  order_.push_back(t);
  return t;
}

std::shared_ptr<Ticket> TicketTable::Find(uint64_t token, std::string* why) const {
  if (!TokenValid(token, key_)) {
    *why = "the token is not a jaxvmm ticket of this device (forged, corrupted, or from another device or process)";
    return nullptr;
  }
  auto it = by_token_.find(token);
  if (it == by_token_.end()) {
    bool reloaded = std::find(recently_reloaded_.begin(), recently_reloaded_.end(), token) != recently_reloaded_.end();
    *why = TokenStr(token) + (reloaded ? " was already reloaded (a ticket can be reloaded once)"
                                       : " is gone (reloaded earlier, dropped, or from another device)");
    return nullptr;
  }
  if (it->second->consumed) {
    *why = TokenStr(token) + " was already reloaded (a ticket can be reloaded once)";
    return nullptr;
  }
  return it->second;
}

std::shared_ptr<Ticket> TicketTable::Predict(const ArrayMeta& meta, const std::function<bool(const Ticket&)>& usable) const {
  // The predict setting off (a debug switch): every reload is corrected by the resolver.
  if (EngineConfig::Get(Setting::kPredict) == 0) return nullptr;
  // Training reloads in reverse offload order (LIFO); a miss that hit the other end of the queue flips
  // the guess for that signature (Learn). Only tickets whose D2H is enqueued can be copied from.
  auto fits = [&](const std::shared_ptr<Ticket>& t) {
    return t->enqueued && !t->consumed && !t->dropped && t->claimed_by == 0 && t->meta.nbytes == meta.nbytes &&
           t->meta.signature == meta.signature && (!usable || usable(*t));
  };
  if (!fifo_.count(meta.signature)) {
    for (auto it = order_.rbegin(); it != order_.rend(); ++it)
      if (fits(*it)) return *it;
  } else {
    for (auto& t : order_)
      if (fits(t)) return t;
  }
  return nullptr;
}

void TicketTable::Learn(const std::shared_ptr<Ticket>& actual, int64_t signature) {
  std::shared_ptr<Ticket> oldest, newest;
  for (auto& t : order_)
    if (!t->dropped && t->meta.signature == signature && (!t->consumed || t == actual)) {
      if (!oldest) oldest = t;
      newest = t;
    }
  // Learned per signature: one array's reload order says nothing about another's.
  if (actual == oldest && actual != newest) fifo_.insert(signature);
  if (actual == newest && actual != oldest) fifo_.erase(signature);
}

bool TicketTable::MaybeFree(const std::shared_ptr<Ticket>& t, Retired* out) {
  if (t->freed || !(t->consumed || t->dropped) || t->pins > 0 || !t->on_host) return false;
  t->freed = true;
  if (t->consumed) {
    recently_reloaded_.push_back(t->token);
    if (recently_reloaded_.size() > 256) recently_reloaded_.pop_front();
  }
  out->host = t->host;
  out->d2h_done = t->d2h_done;
  out->resident = t->resident;
  t->host = HostBlock();
  t->d2h_done = nullptr;
  t->resident = StagingLease();
  std::shared_ptr<Ticket> keep = t;  // `t` may be the map's own reference
  by_token_.erase(keep->token);
  order_.erase(std::remove(order_.begin(), order_.end(), keep), order_.end());
  return true;
}

int64_t TicketTable::host_bytes() const {
  int64_t n = 0;
  for (auto& [token, t] : by_token_) n += static_cast<int64_t>(t->meta.nbytes);
  return n;
}

}  // namespace jaxvmm
