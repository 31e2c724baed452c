// Graph mode's offload rounds (graph_offload.h). DESIGN.md, "Graph mode".
#include "graph_offload.h"

#include "config.h"

namespace jaxvmm {

bool OffloadRounds::Serve(Channel& c) {
  ChannelWords& w = *c.w;
  bool busy = ServeHeld(c);
  for (int i = 0; i < c.ncells; ++i) {
    if (w.filled[i].load(std::memory_order_acquire) != 1) continue;
    // The device took cell i's grant_token, copied x into the cell and handed the token out: make its
    // ticket, D2H the cell into it on gd2h, and pre-arm the cell again right behind that copy.
    w.filled[i].store(0, std::memory_order_relaxed);
    busy = true;
    Cell& cell = c.cells[i];
    const uint64_t token = cell.grant_token;
    cell.grant_token = 0;
    cell.round = Channel::Round::kIdle;
    c.last_use = std::chrono::steady_clock::now();
    ++c.rounds;
    ++g_.stats.offload_rounds;
    ++(cell.host_grant ? g_.stats.grants_host : g_.stats.grants_device);
    Status st;
    std::shared_ptr<Ticket> t = MakeRoundTicket(c, token, &st);
    cell.holds = t;  // the round's bytes (none to name when its ticket could not be made)
    if (t) st = CopyOutOfCell(c, i, t);
    if (t && st.ok()) cell.draining = t;  // Arm may lend the cell to it (spares)
    // Failed: the token the device handed out names no ticket; its reload fills 0xFF and reports too.
    if (!st.ok()) RecordOffloadError(c, st);
  }
  if (busy) ArmIdleCells(c);
  // `knock` is a level the device holds while it waits with no grant. An armed grant answers it (its
  // write may still be on its way behind a D2H); with none, map an idle cell and arm it.
  bool armed = false;
  for (int i = 0; i < c.ncells; ++i) armed |= c.cells[i].round == Channel::Round::kArmed;
  if (armed) c.waiting = false;  // a knock seen earlier is answered by that grant
  if (!armed && (c.waiting || w.knock.load(std::memory_order_acquire) == 1)) {
    c.waiting = true;
    busy = true;
    int pick = -1;
    for (int i = 0; i < c.ncells; ++i) {
      if (c.cells[i].round != Channel::Round::kIdle) continue;
      if (pick < 0 || (c.cells[i].mapped && !c.cells[pick].mapped)) pick = i;
    }
    if (pick < 0) return busy;  // every cell is under a live round (its filled comes first) or held (ServeHeld arms it)
    if (!cells_.MapCell(c, pick)) return busy;  // no room in the staging budget yet: the next pass retries
    if (Arm(c, pick, /*host=*/true)) {
      c.waiting = false;
      c.last_use = std::chrono::steady_clock::now();
      ArmIdleCells(c);  // and the channel's other cells: the rounds after this one find their grants
    }
  }
  return busy;
}

std::shared_ptr<Ticket> OffloadRounds::MakeRoundTicket(const Channel& c, uint64_t token, Status* st) {
  // A graph-mode offload round's ticket, with its host block (its D2H completion is a gd2h sequence
  // number), for the reserved token the device took. Null, and *st says why, when it cannot be made.
  HostBlock host;
  *st = g_.round_host.Allocate(c.meta.nbytes, &host).At(-1, "offload (graph)");
  Held h = g_.ledger.Lock();
  g_.ledger.Disarm(h, token);  // from now on its ticket (or its absence) speaks for it
  std::shared_ptr<Ticket> t;
  if (st->ok()) {
    t = g_.ledger.tickets(h).Create(c.meta, token);
    if (!t) *st = Status(Code::kInternal, TokenStr(token) + " was taken by another ticket before its round ended");
  }
  if (t) {
    t->offload_seq = g_.ledger.issued(h);
    t->host = host;
    t->graph_round = true;
    ++g_.ledger.counts(h).offloads;
  } else if (host.ptr) {
    g_.host_store.Free(host);
  }
  return t;
}

Status OffloadRounds::CopyOutOfCell(Channel& c, int i, const std::shared_ptr<Ticket>& t) {
  // The round's bytes, D2H out of cell i into t's host block on gd2h: t is reloadable once that is
  // enqueued. A failure drops t (its bytes never reached the host: a reload of it fails).
  const DriverTable& d = Driver(g_.backend);
  const char* stage = "offload (graph)";
  Cell& cell = c.cells[i];
  // Pageable memory goes through the bounce buffers (their D2H waits for copies already on gd2h,
  // which waits for nothing of XLA's): the bytes are on the host when it returns.
  Status st = t->host.pageable ? g_.round_host.bounce().ToHost(g_.gd2h, t->host.ptr, cell.addr, c.meta.nbytes, stage)
                               : g_.transfers.CopyToHost(g_.gd2h, t->host, cell.addr, c.meta.nbytes, stage);
  const uint64_t seq = gd2h_issued_ + 1;  // gd2h runs in order: its word passing seq means this D2H is done
  if (st.ok()) st = WriteDeviceWord(g_.backend, g_.gd2h, g_.transfers.graph_clock_address(), seq, stage);
  if (st.ok()) {
    gd2h_issued_ = seq;
    t->d2h_seq = seq;
  }
  if (st.ok()) st = Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(cell.event, g_.gd2h); });
  cell.stream = g_.gd2h;
  Held h = g_.ledger.Lock();
  if (st.ok()) {
    t->enqueued = true;
    round_d2h_.push_back(t);
  } else {
    d.StreamSynchronize(g_.gd2h);
    t->on_host = t->dropped = true;
    g_.ledger.Retire(h, t);
  }
  return st;
}

void OffloadRounds::RecordOffloadError(const Channel& c, const Status& st) {
  g_.ledger.Report(c.stream, Status(st.code(), st.ToString() + " (graph-mode offload of call site " + std::to_string(c.site) + ")"));
}

bool OffloadRounds::ReapOffloads() {
  if (round_d2h_.empty()) return false;
  bool busy = false;
  Held h = g_.ledger.Lock();
  for (auto it = round_d2h_.begin(); it != round_d2h_.end();) {
    Ticket& t = **it;
    if (!g_.transfers.D2hDone(t)) {
      ++it;
      continue;
    }
    t.on_host = true;
    g_.ledger.Retire(h, *it);
    it = round_d2h_.erase(it);
    busy = true;
  }
  return busy;
}

bool OffloadRounds::Arm(Channel& c, int i, bool host, bool settled) {
  // Every copy out of an offload cell runs on gd2h, so a write on gd2h is ordered after the last one.
  // gd2h/gh2d never wait on XLA's streams (unlike the op ring's d2h/h2d): a grant written there
  // cannot queue behind work that waits for the very round the grant releases.
  Cell& cell = c.cells[i];
  // PCIe is behind the device: as many graph D2Hs are queued as the channel has cells, so the next round
  // of this cell would wait for its D2H. Swap in a free spare instead (its pages hold no copy, so garm
  // has none to follow). A shorter queue is what K cells absorb: no spare is taken for it.
  // With every spare lent, the cell is held instead (Round::kHeld): armed behind its D2H, at the end of
  // the queue, its bytes would be out of reach of the reloads that come first (the backward's first
  // layers) until the whole queue has drained.
  const bool behind = gd2h_issued_ - g_.transfers.graph_clock()->load(std::memory_order_acquire) >= static_cast<uint64_t>(c.ncells);
  bool lent = false;
  if (cell.draining && !c.spares.empty() && behind && !g_.transfers.D2hDone(*cell.draining)) {
    lent = cells_.Lend(c, i);
    if (!lent) {
      Hold(c, i, host, /*until_knock=*/false);
      return false;
    }
  }
  // The one cell of a large call site is held until its next round knocks (GraphHold::kLarge): after
  // the forward's last round no round comes, and the backward's first reload, of exactly these bytes,
  // copies them device to device instead of waiting for the D2H and an H2D of a large array. A knock
  // costs the next round a poller round trip, small beside the compute that makes such an array.
  if (!lent && cell.draining && HoldsUntilKnock(c)) {
    Hold(c, i, host, /*until_knock=*/true);
    return false;
  }
  // gd2h orders the grant after the cell's D2H; new pages (a lend) or a settled cell (no copy out of
  // it pending: its D2H done, its event complete) need no order, and garm does not queue the grant
  // behind other cells' D2Hs.
  if (!lent && !settled && (!cell.draining || g_.transfers.D2hDone(*cell.draining)))
    settled = !cells_.CopyPending(cell);
  cell.draining.reset();
  CUstream s = lent || settled ? g_.garm : g_.gd2h;
  const uint64_t token = g_.ledger.ArmToken();  // armed before the device can take it (WaitUntilServed)
  Status st = WriteDeviceWord(g_.backend, s, c.Grant(i), token, "offload grant (graph)");
  if (!st.ok()) {
    // A retry may write its grant on gd2h: the new address (on garm) must be in place before it.
    if (lent) Driver(g_.backend).StreamSynchronize(g_.garm);
    {
      Held h = g_.ledger.Lock();
      g_.ledger.Disarm(h, token);
    }
    g_.ledger.Report(c.stream, Status(st.code(), st.ToString() + " (graph-mode grant of call site " + std::to_string(c.site) + "; retrying)"));
    return false;
  }
  cell.grant_token = token;
  cell.host_grant = host;
  cell.grant_stream = s;
  cell.round = Channel::Round::kArmed;
  return true;
}

bool OffloadRounds::HoldsUntilKnock(const Channel& c) {
  return EngineConfig::GraphHoldPolicy() == EngineConfig::GraphHold::kLarge && c.ncells == 1 && c.Large();
}

void OffloadRounds::Hold(Channel& c, int i, bool host, bool until_knock) {
  // Cell i keeps its draining ticket's bytes, readable device to device, until
  // ServeHeld arms it (or lets it go idle: the ticket consumed or dropped).
  Cell& cell = c.cells[i];
  cell.until_knock = until_knock;
  {
    Held h = g_.ledger.Lock();
    cell.draining->lent_cell = cell.addr;
  }
  cell.host_grant = host;
  cell.round = Channel::Round::kHeld;
  ++g_.stats.holds;
}

bool OffloadRounds::ServeHeld(Channel& c) {
  // A held cell is armed once a mapped spare is free to take its bytes (Lend moves
  // them, and the ticket's lent_cell, into the spare: the newest bytes stay readable, in place of the
  // oldest a spare kept), or else once its D2H is done and no copy reads it (on garm: no copy of its
  // is pending). No new spare is mapped here: that is tried once, when the cell is armed after its
  // round, not on every pass. A cell held until a knock waits for one first (the device holds `knock`
  // while its round waits; c.waiting once a pass saw it), or goes idle unarmed once nothing can read its
  // bytes (below).
  bool busy = false;
  const bool knocked = c.waiting || c.w->knock.load(std::memory_order_acquire) == 1;
  for (int i = 0; i < c.ncells; ++i) {
    Cell& cell = c.cells[i];
    if (cell.round != Channel::Round::kHeld) continue;
    if (cell.until_knock && !knocked) {
      // Nothing reads its bytes any more (the ticket was reloaded elsewhere and is not kept, or it was
      // dropped) once its D2H is done: the cell goes idle, unarmed (no busy: nothing arms it before a
      // knock), so that the partner call site's next round takes its pages (TakeIdlePages) instead of
      // mapping its own. (A scan's first backward iteration runs uncaptured and reloads the forward's
      // last offload through the op ring: that cell stayed held, and the reload call site's first
      // round mapped a second cell beside it.)
      if (!g_.transfers.D2hDone(*cell.draining)) continue;  // (no ledger lock for that: the clock's word)
      Held h = g_.ledger.Lock();
      if (cell.draining->consumed || cell.draining->dropped) (void)cells_.Unhold(h, cell);
      continue;
    }
    const bool host = cell.host_grant || cell.until_knock;  // a grant that answers a knock is the host's
    if (cells_.Lend(c, i, /*may_map=*/false)) {
      cell.round = Channel::Round::kIdle;
      cell.until_knock = false;
    } else {
      Held h = g_.ledger.Lock();
      if (!g_.transfers.D2hDone(*cell.draining) || !cells_.Unhold(h, cell)) continue;
    }
    busy = true;
    (void)Arm(c, i, host, /*settled=*/true);
  }
  return busy;
}

void OffloadRounds::ArmIdleCells(Channel& c) {
  // A round of the channel ended: every idle cell gets a grant behind its own D2H, so the next K rounds
  // find one each. Cells without pages are mapped only within the budget as it is: a channel whose K
  // cells do not fit runs on fewer (a round that finds none armed knocks, as with one cell).
  for (int i = 0; i < c.ncells; ++i) {
    Cell& cell = c.cells[i];
    if (cell.round != Channel::Round::kIdle) continue;
    if (!cell.mapped && !cells_.MapCell(c, i, /*evict=*/false)) continue;
    Arm(c, i, /*host=*/false);
  }
}

}  // namespace jaxvmm
