// Graph mode's reload rounds (graph_reload.h). DESIGN.md, "Graph mode".
#include "graph_reload.h"

namespace jaxvmm {

bool ReloadRounds::Serve(Channel& c) {
  ChannelWords& w = *c.w;
  const DriverTable& d = Driver(g_.backend);
  bool busy = false;
  for (int i = 0; i < c.ncells; ++i) {
    if (w.done[i].load(std::memory_order_acquire) != 1) continue;
    // The device copied cell i out. Its round was granted by the host (cell.ticket), or the device
    // took grant[i] itself (cell.loaded, the prefetched ticket, is what it copied).
    w.done[i].store(0, std::memory_order_relaxed);
    busy = true;
    Cell& cell = c.cells[i];
    bool device = false;
    {
      Held h = g_.ledger.Lock();
      std::shared_ptr<Ticket> t = std::move(cell.ticket);
      cell.ticket.reset();
      if (!t && cell.loaded) {
        t = std::move(cell.loaded);
        cell.loaded.reset();
        if (t->claimed_by == c.Claim()) t->claimed_by = 0;
        MarkReloaded(*t);
        device = true;
      }
      if (t) {
        ++g_.ledger.counts(h).reloads;  // a ticket's bytes reached XLA's buffer (a 0xFF round had no ticket)
        t->pins -= 1;
        g_.ledger.Retire(h, t);
      }
    }
    if (device) {
      ++g_.stats.grants_device;
      ++g_.stats.hits;
    } else {
      ++g_.stats.grants_host;
    }
    cell.round = Channel::Round::kIdle;
    c.last_use = std::chrono::steady_clock::now();
    ++c.rounds;
    ++g_.stats.reload_rounds;
  }
  if (busy) PrefetchInto(c);
  if (c.waiting || w.request.load(std::memory_order_acquire) == 1) {
    // The device found no cell whose grant names its token and waits for go: the host decides. A
    // `done` that came in since this pass read it belongs to the previous round: serve it first.
    for (int i = 0; i < c.ncells; ++i)
      if (w.done[i].load(std::memory_order_acquire) == 1) return true;
    if (!c.waiting) w.request.store(0, std::memory_order_relaxed);
    c.waiting = true;
    busy = true;
    const uint64_t token = w.probe.load(std::memory_order_acquire);
    std::string why;
    std::shared_ptr<Ticket> a;
    {
      Held h = g_.ledger.Lock();
      a = FindForRound(h, c, token, &why);
      if (a && !a->enqueued) return busy;  // its offload's `filled` is served on the next pass
      // A token an offload round handed out whose `filled` is not served yet has no ticket yet.
      if (!a && g_.ledger.Armed(h, token)) return busy;
    }
    // The cell: the one that holds `a` already (its grant was not written yet when the device looked),
    // else an idle mapped one, else any the device is not using (its guess is dropped). The device is
    // in this round, so it takes no other grant of the channel until go.
    int j = -1;
    for (int i = 0; i < c.ncells && j < 0; ++i)
      if (a && c.cells[i].loaded == a) j = i;
    for (int pass = 0; pass < 3 && j < 0; ++pass)
      for (int i = 0; i < c.ncells && j < 0; ++i) {
        const Cell& cell = c.cells[i];
        if (cell.round == Channel::Round::kGranted) continue;
        if (pass == 0 ? (cell.mapped && !cell.loaded) : pass == 1 ? cell.mapped : true) j = i;
      }
    if (j < 0) return busy;
    if (!(a && c.trades && cells_.TakeHeldPages(c, j, a)) && !cells_.MapCell(c, j)) return busy;
    Cell& cell = c.cells[j];
    Source src;
    bool hit = false;
    {
      Held h = g_.ledger.Lock();
      hit = TakeForRound(h, c, j, a, &src);
    }
    cell.ticket = a;
    c.waiting = false;
    cell.round = Channel::Round::kGranted;
    cell.host_grant = true;
    c.last_use = std::chrono::steady_clock::now();
    // On gfix, after every copy into the cell (a prefetch and its grant write): clear grant[j] (the
    // host decides what the cell holds now), put the bytes in, then go.
    Status st;
    if (cell.stream && cell.stream != g_.gfix)
      st = Call(-1, "reload (graph)", Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(g_.gfix, cell.event, 0); });
    if (st.ok()) st = WriteDeviceWord(g_.backend, g_.gfix, c.Grant(j), 0, "reload (graph)");
    if (st.ok()) st = Call(-1, "reload (graph)", Entry::kEventRecord, [&] { return d.EventRecord(cell.event, g_.gfix); });
    if (st.ok()) cell.stream = g_.gfix;
    if (!st.ok()) {
      // grant[j] may still name a prefetched token: wait for every copy, then clear it in order.
      d.StreamSynchronize(g_.gh2d);
      d.StreamSynchronize(g_.gfix);
      st = WriteDeviceWord(g_.backend, g_.gfix, c.Grant(j), 0, "reload (graph)");
      if (st.ok()) d.StreamSynchronize(g_.gfix);
      cell.stream = nullptr;
      if (!st.ok()) g_.ledger.Report(c.stream, st);
    }
    if (hit) {
      ++g_.stats.hits;
      cells_.Go(c, j);
      return busy;
    }
    ++g_.stats.misses;
    if (!a) {
      g_.ledger.Report(c.stream, Status(Code::kInvalidArgument, "reload (graph-mode call site " + std::to_string(c.site) + "): " + why +
                                                            "; the output was filled with 0xFF bytes"));
      FillInvalid(c, j);
      cells_.Go(c, j);
      return busy;
    }
    // The bytes may still be in the offload cell the round left them in (the backward's first reloads
    // name the forward's last offloads): a device-to-device copy then, not a wait for their D2H and an
    // H2D. XLA's stream waits in this round until go, written on gfix behind the copy, so no round
    // refills that cell before the copy has read it (where XLA keeps the recorded order: CellHolding).
    Cell* from = src.resident ? nullptr : CellHolding(a, c.cell_size, c.stream);
    if (from) {
      src = Source();
      src.resident = from->addr;  // complete: XLA's stream ran the round that filled it
    }
    st = g_.transfers.CopyTicket(g_.gfix, src, cell.addr, c.meta.nbytes, g_.round_host.bounce(), "reload (graph)");
    if (st.ok()) st = Call(-1, "reload (graph)", Entry::kEventRecord, [&] { return d.EventRecord(cell.event, g_.gfix); });
    cell.stream = g_.gfix;
    cells_.WatchLentRead(src, a, cell.event);
    if (from) {
      from->read_into = &cell;  // its pages stay until cell j's copy has ended
      if (st.ok()) ++g_.stats.cell_reads;
    }
    if (!st.ok()) {
      g_.ledger.Report(c.stream, Status(st.code(), st.ToString() + " (graph-mode reload of " + TokenStr(token) + " failed; the output was filled with 0xFF bytes)"));
      FillInvalid(c, j);
    } else if (StageHeldGuesses(c, j)) {
      // go must follow the staged copies too (they read offload cells that XLA's stream may refill once
      // it goes on; CellHolding found them only where XLA keeps the recorded order): cell j's event
      // again, behind them, so that Go writes go on gfix.
      st = Call(-1, "reload (graph)", Entry::kEventRecord, [&] { return d.EventRecord(cell.event, g_.gfix); });
      if (!st.ok()) d.StreamSynchronize(g_.gfix);  // then go may be written at once
    }
    cells_.Go(c, j);
  }
  return busy;
}

std::shared_ptr<Ticket> ReloadRounds::FindForRound(const Held& h, const Channel& c, uint64_t token, std::string* why) {
  // Caller holds the ledger's lock (h). The ticket a reload round's probed token names, if it is one this call site can
  // reload (same size and signature).
  std::shared_ptr<Ticket> a = g_.ledger.tickets(h).Find(token, why);
  if (a && (a->meta.nbytes != c.meta.nbytes || a->meta.signature != c.meta.signature)) {
    *why = TokenStr(token) + " holds " + std::to_string(a->meta.nbytes) + " bytes of another shape/dtype than the reload expects (" +
           std::to_string(c.meta.nbytes) + " bytes)";
    return nullptr;
  }
  return a;
}

bool ReloadRounds::TakeForRound(const Held& h, Channel& c, int i, const std::shared_ptr<Ticket>& a, Source* src) {
  // Caller holds the ledger's lock (h). The round consumes `a` (null: a bad token) in cell i: a hit when it is the
  // prediction cell i already holds (its pin passes to the round), else cell i's prediction is dropped
  // and *src says where the correction copies from.
  Cell& cell = c.cells[i];
  const bool hit = a && a == cell.loaded;
  if (a) {
    MarkReloaded(*a);
    if (hit) {
      if (a->claimed_by == c.Claim()) a->claimed_by = 0;
      cell.loaded.reset();
    } else {
      if (a->claimed_by != 0) g_.ledger.MarkStale(h);  // another cell holds it as a guess
      a->pins += 1;
      bool guessed = false;
      for (int j = 0; j < c.ncells; ++j) guessed |= c.cells[j].loaded != nullptr;
      if (guessed) g_.ledger.tickets(h).Learn(a, c.meta.signature);
      cells_.Unload(h, c, i);
      *src = cells_.RoundSourceOf(*a);
    }
  } else {
    cells_.Unload(h, c, i);
  }
  return hit;
}

void ReloadRounds::PrefetchInto(Channel& c) {
  // A round of the channel ended: fill each idle cell with a ticket a next round will most likely name
  // (the next predictions, each claimed by the channel so the next cell gets the one after), so their
  // grants need no copy on the device's path. Cells other than the one just freed are mapped only
  // within the budget as it is (no other channel's cell is returned for a guess).
  // Only a ticket whose bytes can be copied without waiting on XLA's streams: a graph round's (its D2H
  // on gd2h only follows its own round), or a ring-path one whose D2H already finished. A ring-path
  // D2H waits for an event of XLA's stream; a ticket offloaded *after* this channel's next round (the
  // next program, enqueued behind this one) would hold the cell, and the next round's request waits
  // for the cell's copies: the device would wait for itself.
  auto usable = [&](const Ticket& t) {
    return t.graph_round || t.on_host || g_.transfers.D2hDone(t);
  };
  for (int i = 0; i < c.ncells; ++i) {
    Cell& cell = c.cells[i];
    if (cell.round != Channel::Round::kIdle || cell.loaded) continue;
    if (cells_.CopyPending(cell, g_.gh2d)) continue;  // a correction/0xFF still runs
    if (!cell.mapped) {
      {
        Held h = g_.ledger.Lock();
        if (!g_.ledger.tickets(h).Predict(c.meta, usable)) return;  // nothing to guess: no pages for it
      }
      if (!cells_.MapCell(c, i, /*evict=*/false)) continue;
    }
    Source src;
    {
      Held h = g_.ledger.Lock();
      std::shared_ptr<Ticket> t = g_.ledger.tickets(h).Predict(c.meta, usable);
      if (!t) return;
      t->claimed_by = c.Claim();
      t->pins += 1;
      cell.loaded = t;
      src = cells_.RoundSourceOf(*t);
    }
    if (!LoadGuess(c, i, src, g_.gh2d, "reload prefetch (graph)")) return;
  }
}

bool ReloadRounds::LoadGuess(Channel& c, int i, const Source& src, CUstream s, const char* stage, bool* copied) {
  const DriverTable& d = Driver(g_.backend);
  Cell& cell = c.cells[i];
  Status st = g_.transfers.CopyTicket(s, src, cell.addr, c.meta.nbytes, g_.round_host.bounce(), stage);
  if (copied) *copied = st.ok();
  bool armed = false;
  if (st.ok()) {
    // The device's grant: grant[i] names the token only once its bytes are in the cell (stream
    // order, and the write's default memory barrier makes the copy visible first).
    st = WriteDeviceWord(g_.backend, s, c.Grant(i), cell.loaded->token, stage);
    armed = st.ok();
  }
  if (st.ok()) st = Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(cell.event, s); });
  cell.stream = s;
  cells_.WatchLentRead(src, cell.loaded, cell.event);
  if (armed) {
    cell.round = Channel::Round::kArmed;
    cell.host_grant = false;
    cell.grant_stream = s;  // a revoke runs behind the grant's write
  }
  if (st.ok()) return true;
  d.StreamSynchronize(s);
  cell.stream = nullptr;  // nothing runs on the cell any more
  if (!armed) {
    Held h = g_.ledger.Lock();
    cells_.Unload(h, c, i);  // a hint: the request copies what it needs
  }
  return false;
}

Cell* ReloadRounds::CellHolding(const std::shared_ptr<Ticket>& t, size_t cell_size, CUstream stream) {
  // Small call sites only (no spares, no page trades): their cells' bytes change only
  // when a round fills them or their pages go, both of which clear or replace `holds`. And only call
  // sites whose rounds run on `stream` (XLA's, where the waiting round is): their next round cannot
  // start before that round's go. That is stream order, which XLA does not keep under CONCURRENT
  // command-buffer scheduling (an offload round with no data from the waiting reload may run beside
  // it and refill the cell): then no offload cell is read.
  if (!g_.xla_in_order) return nullptr;
  Cell* found = nullptr;
  g_.channels.ForEach([&](Channel& o) {
    if (found || o.kind != ChannelKind::kOffload || o.cell_size != cell_size || !o.spares.empty() || o.trades) return;
    if (o.stream != stream) return;  // another stream's rounds could run beside the waiting one
    for (int i = 0; i < o.ncells && !found; ++i) {
      Cell& cell = o.cells[i];
      // filled[i] set: a later round refilled the cell and is not served yet (`holds` is behind).
      if (cell.mapped && cell.holds.lock() == t && o.w->filled[i].load(std::memory_order_acquire) == 0) found = &cell;
    }
  });
  return found;
}

bool ReloadRounds::StageHeldGuesses(Channel& c, int busy) {
  // Like PrefetchInto, but only for guesses an offload cell still holds, and on gfix
  // ahead of the waiting round's go (the backward's second reload then finds its bytes at once instead
  // of waiting for the prefetch its first reload's end starts). A guess that is not on the device is
  // left to PrefetchInto.
  bool staged = false;
  for (int k = 0; k < c.ncells; ++k) {
    Cell& cell = c.cells[k];
    if (k == busy || cell.round != Channel::Round::kIdle || cell.loaded) continue;
    if (cells_.CopyPending(cell, g_.gfix)) continue;  // a prefetch on gh2d still runs
    auto next = [&](const Held& h, Cell** from) {
      std::shared_ptr<Ticket> t = g_.ledger.tickets(h).Predict(c.meta, [](const Ticket& x) { return x.graph_round; });
      return t && (*from = CellHolding(t, c.cell_size, c.stream)) ? t : nullptr;
    };
    std::shared_ptr<Ticket> t;
    Cell* from = nullptr;
    if (!cell.mapped) {  // pages for a guess there is (within the budget as it is)
      {
        Held h = g_.ledger.Lock();
        if (!next(h, &from)) return staged;
      }
      if (!cells_.MapCell(c, k, /*evict=*/false)) continue;
    }
    {
      Held h = g_.ledger.Lock();
      if (!(t = next(h, &from))) return staged;
      t->claimed_by = c.Claim();
      t->pins += 1;
      cell.loaded = t;
    }
    Source src;
    src.resident = from->addr;
    staged = true;  // (a copy may have been enqueued even when it failed)
    from->read_into = &cell;
    bool copied = false;
    const bool ok = LoadGuess(c, k, src, g_.gfix, "reload guess (graph)", &copied);
    if (copied) ++g_.stats.cell_reads;
    if (!ok) return staged;
  }
  return staged;
}

void ReloadRounds::FillInvalid(Channel& c, int i) {
  const DriverTable& d = Driver(g_.backend);
  Cell& cell = c.cells[i];
  Status st;
  if (cell.stream && cell.stream != g_.gfix)
    st = Call(-1, "reload (graph)", Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(g_.gfix, cell.event, 0); });
  if (st.ok()) st = Call(-1, "reload (graph)", Entry::kMemsetD8Async, [&] { return d.MemsetD8Async(cell.addr, 0xFF, c.meta.nbytes, g_.gfix); });
  if (st.ok()) st = Call(-1, "reload (graph)", Entry::kEventRecord, [&] { return d.EventRecord(cell.event, g_.gfix); });
  cell.stream = g_.gfix;
  if (!st.ok()) {
    d.StreamSynchronize(g_.gfix);
    d.StreamSynchronize(g_.gh2d);
    cell.stream = nullptr;
    g_.ledger.Report(c.stream, st);
  }
}

void ReloadRounds::DropStaleGuesses() {
  // A consumed ticket a cell still holds as its guess stays pinned (live, its
  // host block held) until the cell goes idle: take the guess back now. Its grant is revoked first (it
  // names the token); a revoke the device won leaves a live round, served as usual.
  if (!g_.ledger.TakeStale()) return;
  ScopedContext ctx(g_.backend, g_.device);  // Synchronize calls this from a user thread
  g_.channels.ForEach([&](Channel& c) {
    if (c.kind != ChannelKind::kReload) return;
    for (int i = 0; i < c.ncells; ++i) {
      Cell& cell = c.cells[i];
      bool stale = false;
      {
        Held h = g_.ledger.Lock();
        stale = cell.loaded && (cell.loaded->consumed || cell.loaded->dropped);
      }
      if (stale && cell.round == Channel::Round::kArmed) (void)cells_.Revoke(c, i);  // unloads on success
    }
  });
}

}  // namespace jaxvmm
