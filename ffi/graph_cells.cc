// Graph mode's cells: their pages, spares, grants and what they hold (graph_cells.h). DESIGN.md,
// "Graph mode".
#include "graph_cells.h"

#include <algorithm>
#include <cstdio>

#include "config.h"
#include "registry.h"
#include "vmm.h"

namespace jaxvmm {

GraphShared::GraphShared(Backend b, int device, Ledger& ledger, HostStore& host, StagingArea& staging, Transfers& transfers,
                         GraphKernels& kernels)
    : backend(b), device(device), xla_in_order(EngineConfig::XlaKeepsCommandOrder()), ledger(ledger), host_store(host),
      staging(staging), transfers(transfers), kernels(kernels), channels(b, device), round_host(b, device, host) {}

// ---------------------------------------------------------------- pages

bool GraphCells::CopyPending(const Cell& cell, CUstream except) const {
  return cell.stream && cell.stream != except && Driver(g_.backend).EventQuery(cell.event) != CUDA_SUCCESS;
}

bool GraphCells::ReadByD2h(Cell& cell) {
  if (cell.d2h_reads && g_.transfers.ClockReached(cell.d2h_reads)) cell.d2h_reads = 0;
  return cell.d2h_reads != 0;
}

bool GraphCells::MapCell(Channel& c, int i, bool evict) {
  Cell& cell = c.cells[i];
  if (cell.mapped) return true;
  if (c.trades && TakeIdlePages(c, i)) return true;  // the other direction's idle pages: no new ones
  if (!g_.staging.Charge(c.cell_size)) {
    if (!evict) return false;
    ReleaseIdleCells(/*now=*/true);  // other channels' idle cells first
    if (!g_.staging.Charge(c.cell_size)) return false;
  }
  Status st = Registry::Get().Remap(cell.slot_id);
  if (st.code() == Code::kOutOfMemory && evict) {  // (a cell armed ahead, with no round waiting, just waits)
    // The device is full (XLA's buffers, other processes). A round may be waiting for this cell on the
    // device, and the memory it needs may be freed only by that very program: waiting could be
    // forever. Other channels' idle cells first, then host pages at the same VA (the copies into and
    // out of the cell cross PCIe; the pages go back when the channel is idle, as device pages do).
    ReleaseIdleCells(/*now=*/true, /*device_only=*/true);
    st = Registry::Get().Remap(cell.slot_id);
    Location host;
    if (st.code() == Code::kOutOfMemory && HostNumaLocation(g_.backend, g_.device, &host).ok()) {
      Status hs = Registry::Get().RemapAt(cell.slot_id, host);
      if (hs.ok()) {
        std::fprintf(stderr, "jaxvmm: graph-mode cell of call site %lld (%zu bytes) mapped with host pages: the device is out of memory (%s)\n",
                     static_cast<long long>(c.site), c.cell_size, st.ToString().c_str());
        cell.host_pages = true;
        ++g_.stats.host_cells;
        st = hs;
      }
    }
  }
  if (!st.ok()) {
    g_.staging.Uncharge(c.cell_size);
    if (evict && c.map_failures++ == 0) g_.ledger.Report(c.stream, Status(st.code(), st.ToString() + " (graph-mode cell; retrying)"));
    return false;
  }
  c.map_failures = 0;
  Mapped(c, &cell);
  return true;
}

void GraphCells::Mapped(const Channel& c, CellPages* p) {
  p->mapped = true;
  g_.stats.mapped_bytes += static_cast<int64_t>(c.cell_size);
  ++g_.stats.pages_mapped;
}

void GraphCells::UnmapCell(Channel& c, int i) {
  c.cells[i].holds.reset();  // new pages hold nobody's bytes
  UnmapPages(c, &c.cells[i], "graph-mode cell kept");
}

void GraphCells::UnmapPages(Channel& c, CellPages* p, const char* kept) {
  // A cell's or a spare's pages back to the driver, uncharged from the budget.
  if (!p->mapped) return;
  Status st = Registry::Get().Release(p->slot_id);
  if (!st.ok()) {
    std::fprintf(stderr, "%s (%s)\n", st.ToString().c_str(), kept);
    return;
  }
  p->mapped = false;
  p->host_pages = false;
  g_.staging.Uncharge(c.cell_size);
  g_.stats.mapped_bytes -= static_cast<int64_t>(c.cell_size);
  ++g_.stats.pages_returned;
}

size_t GraphCells::ReleaseIdleCells(bool now, bool device_only) {
  const auto t = std::chrono::steady_clock::now();
  const auto idle = std::chrono::milliseconds(StagingArea::IdleMillis());
  size_t released = 0;
  g_.channels.ForEach([&](Channel& c) {
    if (!now && t - c.last_use < idle) return;
    // Free spares first, also a waiting channel's own: nothing waits for a spare, and the round that
    // waits may need exactly the room (or the device pages) its free spares hold.
    for (Spare& sp : c.spares) {
      if (!sp.mapped || sp.lent || (device_only && sp.host_pages)) continue;
      {
        Held h = g_.ledger.Lock();
        if (!Forget(h, sp)) continue;  // a reload still copies the bytes it keeps
      }
      UnmapSpare(c, sp);
      if (!sp.mapped) released += c.cell_size;
    }
    if (c.waiting) return;
    for (int i = 0; i < c.ncells; ++i) {
      Cell& cell = c.cells[i];
      if (!cell.mapped || cell.round == Channel::Round::kGranted || (device_only && cell.host_pages)) continue;
      if (ReadByD2h(cell)) continue;  // a D2H still reads its pages (their guess stays armed)
      if (cell.read_into && CopyPending(*cell.read_into)) continue;  // a reload's copy still reads them
      cell.read_into = nullptr;
      if (cell.round == Channel::Round::kArmed && !Revoke(c, i)) continue;  // the device took the grant: its round is live
      if (CopyPending(cell)) continue;  // a copy still uses it (a held cell's D2H)
      {
        Held h = g_.ledger.Lock();
        if (!Unhold(h, cell)) continue;  // a reload's copy still reads its bytes
        Unload(h, c, i);
      }
      UnmapCell(c, i);
      if (!cell.mapped) released += c.cell_size;
    }
  });
  return released;
}

bool GraphCells::TradePages(Channel& c, int i, Channel& p, int k) {
  // No grant is out on either cell, so the device reads neither address word until
  // the poller grants again, after this (the words are written and garm synchronized first). The VA
  // goes with the pages, so nothing is unmapped and the budget's charge stays as it is.
  Cell& a = c.cells[i];
  Cell& b = p.cells[k];
  const DriverTable& d = Driver(g_.backend);
  auto words = [&] {
    Status st = WriteDeviceWord(g_.backend, g_.garm, c.CellWord(i), a.addr, "graph page trade");
    if (st.ok()) st = WriteDeviceWord(g_.backend, g_.garm, p.CellWord(k), b.addr, "graph page trade");
    Status sync = Call(-1, "graph page trade", Entry::kStreamSynchronize, [&] { return d.StreamSynchronize(g_.garm); });
    return st.ok() ? sync : st;
  };
  std::swap(static_cast<CellPages&>(a), static_cast<CellPages&>(b));
  Status st = words();
  if (!st.ok()) {
    std::swap(static_cast<CellPages&>(a), static_cast<CellPages&>(b));
    Status back = words();
    g_.ledger.Report(c.stream, Status(st.code(), st.ToString() + (back.ok() ? " (graph-mode cells keep their pages)" : " (graph-mode cell addresses may be stale)")));
    return false;
  }
  a.stream = b.stream = nullptr;  // neither has a copy pending (the callers checked)
  ++g_.stats.trades;
  return true;
}

bool GraphCells::Partners(const Channel& a, const Channel& b) {
  return a.trades && b.trades && a.kind != b.kind && a.cell_size == b.cell_size;
}

bool GraphCells::TakeIdlePages(Channel& c, int i) {
  // A forward's first round takes the pages the previous backward's reloads used,
  // and the other way around, so a pair of large call sites keeps one cell of device memory between
  // them, not one each.
  Channel* from = nullptr;
  int k = -1;
  g_.channels.ForEach([&](Channel& p) {
    if (from || !Partners(c, p)) return;
    for (int j = 0; j < p.ncells; ++j) {
      Cell& cell = p.cells[j];
      // Host pages (the device had no memory) go back when idle, so that the next mapping tries the
      // device again: passing them on would keep them in use for good.
      if (!cell.mapped || cell.host_pages || cell.round != Channel::Round::kIdle || cell.loaded || cell.ticket || cell.draining) continue;
      if (CopyPending(cell) || ReadByD2h(cell)) continue;  // a copy into or out of it still runs
      from = &p;
      k = j;
      return;
    }
  });
  return from && TradePages(c, i, *from, k);
}

bool GraphCells::TakeHeldPages(Channel& c, int j, const std::shared_ptr<Ticket>& a) {
  // Reload cell j (no round on it, nothing loaded, no copy pending) and the offload
  // cell that holds `a` (the forward's last round of a large call site) exchange their pages: the
  // bytes stay where the offload left them, and the reload copies nothing before its round.
  // a's D2H may still run (the forward's last D2H, when the backward's head is short): the round only
  // reads the pages too, and writing them later is harmless when the round consumes `a` (nothing reads
  // its host copy then), but they must not be unmapped under the copy: the cell keeps them until the
  // D2H clock passes a's D2H (Cell::d2h_reads). A kept ticket (a jax.vjp or jax.linearize function's,
  // which Python may call again) is not consumed: the next prefetch or correction into the pages
  // would end up in its host copy, so it trades only once its D2H is done. Before, such a reload
  // mapped a cell of new pages and copied device to device, and that second cell stayed mapped
  // through the step.
  Cell& mine = c.cells[j];
  if (mine.loaded || mine.ticket || mine.round == Channel::Round::kGranted) return false;
  if (CopyPending(mine) || ReadByD2h(mine)) return false;
  Channel* from = nullptr;
  int k = -1;
  uint64_t d2h_reads = 0;
  {
    Held h = g_.ledger.Lock();
    if (!a->lent_cell || a->lent_readers > 0) return false;
    if (!g_.transfers.D2hDone(*a)) {
      if (!a->d2h_seq || a->kept) return false;  // only the graph clock tells when the copy is done
      d2h_reads = a->d2h_seq;
    }
    g_.channels.ForEach([&](Channel& p) {
      if (from || !Partners(c, p)) return;
      for (int i = 0; i < p.ncells; ++i)
        if (p.cells[i].round == Channel::Round::kHeld && p.cells[i].draining == a && p.cells[i].addr == a->lent_cell) {
          from = &p;
          k = i;
          return;
        }
    });
  }
  if (!from) return false;
  Cell& held = from->cells[k];
  if (held.host_pages) return false;  // copied into the reload's own cell instead (see TakeIdlePages)
  // Its last copy is the D2H (done by the clock, or followed by d2h_reads; the event recorded behind it
  // may lag); anything else still running on it keeps it.
  if (CopyPending(held, g_.gd2h)) return false;
  if (!TradePages(c, j, *from, k)) return false;
  mine.d2h_reads = d2h_reads;
  {
    Held h = g_.ledger.Lock();
    a->lent_cell = 0;  // the bytes are this cell's now; the offload cell has others
    // As if prefetched: the request finds its ticket loaded (a hit, no copy), its pin passes to the round.
    // Another cell that guessed it (its prefetch copied from the held cell) holds a stale guess now.
    if (a->claimed_by != 0 && a->claimed_by != c.Claim()) g_.ledger.MarkStale(h);
    a->claimed_by = c.Claim();
    a->pins += 1;
    mine.loaded = a;
  }
  held.draining.reset();
  held.until_knock = false;
  held.round = Channel::Round::kIdle;
  return true;
}

// ---------------------------------------------------------------- spares

bool GraphCells::Lend(Channel& c, int i, bool may_map) {
  // Cell i's pages (with the bytes its D2H still reads) go to a free spare, lent
  // to the ticket until that D2H is done; the cell takes the spare's pages and VA, and the device word
  // naming cell i's address changes on garm, where the grant that follows is written.
  Cell& cell = c.cells[i];
  // A free spare, in this order: a mapped one that keeps no ticket's bytes; the mapped one freed longest
  // ago (the backward reads the newest offloads first), never one a reload still reads; a new mapping.
  // So the spares mapped are as many as were lent at once (the D2H backlog), not graph_spares.
  Spare* sp = nullptr;
  {
    Held h = g_.ledger.Lock();
    for (Spare& x : c.spares) {
      if (x.lent || !x.mapped) continue;
      const std::shared_ptr<Ticket> k = x.kept.lock();
      if (!k) {
        sp = &x;
        break;
      }
      if (k->lent_readers == 0 && (!sp || x.returned < sp->returned)) sp = &x;
    }
    if (sp && !Forget(h, *sp)) sp = nullptr;
  }
  if (!sp && may_map)
    for (Spare& x : c.spares)
      if (!x.lent && !x.mapped) {
        if (MapSpare(c, x)) sp = &x;
        break;  // one mapping attempt per lend: the budget (or the device) has no room for more
      }
  if (!sp) return false;
  Status st = WriteDeviceWord(g_.backend, g_.garm, c.CellWord(i), sp->addr, "offload grant (graph)");
  if (!st.ok()) {
    Driver(g_.backend).StreamSynchronize(g_.garm);
    return false;
  }
  std::swap(static_cast<CellPages&>(cell), static_cast<CellPages&>(*sp));  // both mapped
  sp->lent = std::move(cell.draining);
  {
    Held h = g_.ledger.Lock();
    sp->lent->lent_cell = sp->addr;
  }
  cell.stream = nullptr;  // its pages now are the spare's: no copy into or out of them is pending
  ++g_.stats.lends;
  return true;
}

bool GraphCells::ReturnSpares() {
  // A lent spare is free again once its ticket's D2H is done. It keeps the bytes
  // (the ticket's lent_cell still names it, so a reload reads them device to device) until a lend
  // reuses it or its pages go back; both skip it while a copy out of it still runs (lent_readers).
  bool busy = false;
  g_.channels.ForEach([&](Channel& c) {
    for (Spare& sp : c.spares) {
      if (!sp.lent || !g_.transfers.D2hDone(*sp.lent)) continue;
      Held h = g_.ledger.Lock();
      sp.kept = std::move(sp.lent);
      sp.lent.reset();
      sp.returned = ++return_clock_;
      busy = true;
    }
  });
  return busy;
}

bool GraphCells::MapSpare(Channel& c, Spare& sp) {
  // Device pages within the spare budget and the staging budget, or none: a spare is an optimization,
  // never waited for.
  if (sp.mapped) return true;
  const size_t cap = EngineConfig::GraphSpareBudget();
  const auto bytes = static_cast<int64_t>(c.cell_size);
  if (cap > 0 && static_cast<size_t>(g_.stats.spare_bytes + bytes) > cap) return false;
  if (!g_.staging.Charge(c.cell_size)) return false;
  if (!Registry::Get().Remap(sp.slot_id).ok()) {
    g_.staging.Uncharge(c.cell_size);
    return false;
  }
  Mapped(c, &sp);
  g_.stats.spare_bytes += bytes;
  g_.stats.spare_bytes_peak = std::max(g_.stats.spare_bytes_peak, g_.stats.spare_bytes);
  return true;
}

void GraphCells::UnmapSpare(Channel& c, Spare& sp) {
  if (!sp.mapped) return;
  UnmapPages(c, &sp, "graph-mode spare cell kept");
  if (!sp.mapped) g_.stats.spare_bytes -= static_cast<int64_t>(c.cell_size);
}

bool GraphCells::Forget(const Held& h, Spare& sp) {
  // Caller holds the ledger's lock (h).
  (void)h;
  const std::shared_ptr<Ticket> k = sp.kept.lock();
  if (k && k->lent_readers > 0) return false;
  if (k && k->lent_cell == sp.addr) k->lent_cell = 0;
  sp.kept.reset();
  return true;
}

// ---------------------------------------------------------------- grants

void GraphCells::Go(Channel& c, int i) {
  // The device may go on once every copy into cell i has finished: at once when the last one already
  // has, else by a write ordered after it on its stream.
  const DriverTable& d = Driver(g_.backend);
  Cell& cell = c.cells[i];
  std::atomic<uint64_t>& go = c.w->go;
  const uint64_t value = static_cast<uint64_t>(i) + 1;
  if (CopyPending(cell)) {
    Status st = Call(-1, "graph grant", Entry::kStreamWriteValue64, [&] { return d.StreamWriteValue64(cell.stream, WordAddr(go), value, 0); });
    if (st.ok()) return;
    d.StreamSynchronize(cell.stream);
  }
  go.store(value, std::memory_order_seq_cst);
}

bool GraphCells::Revoke(Channel& c, int i) {
  // Takes cell i's armed grant back on the stream that wrote it (so after that
  // write), waits for the kernel, and reads what it found. Only a grant taken back lets the cell go.
  Cell& cell = c.cells[i];
  if (cell.round != Channel::Round::kArmed) return cell.round == Channel::Round::kIdle;
  ScopedContext ctx(g_.backend, g_.device);  // trim() calls this from a user thread
  const DriverTable& d = Driver(g_.backend);
  const bool offload = c.kind == ChannelKind::kOffload;
  CUstream s = cell.grant_stream ? cell.grant_stream : offload ? g_.gd2h : g_.gh2d;
  const uint64_t expect = offload ? 0 : (cell.loaded ? cell.loaded->token : 0);
  c.w->result.store(0, std::memory_order_relaxed);
  Status st = g_.kernels.Revoke(s, c.Grant(i), expect, WordAddr(c.w->result));
  if (st.ok()) st = Call(-1, "graph revoke", Entry::kStreamSynchronize, [&] { return d.StreamSynchronize(s); });
  if (!st.ok()) {
    std::fprintf(stderr, "%s (graph-mode grant kept)\n", st.ToString().c_str());
    return false;
  }
  if (c.w->result.load(std::memory_order_acquire) == 0) {
    // The device took it first: the round is live (its filled/done comes), the cell stays.
    ++g_.stats.revokes_lost;
    cell.round = Channel::Round::kGranted;
    return false;
  }
  ++g_.stats.revokes;
  cell.round = Channel::Round::kIdle;
  {
    Held h = g_.ledger.Lock();
    if (offload) g_.ledger.Disarm(h, cell.grant_token);
    else Unload(h, c, i);
  }
  cell.grant_token = 0;  // a reserved number never used: no ticket was made for it
  return true;
}

// ---------------------------------------------------------------- what a cell holds

void GraphCells::Unload(const Held& h, Channel& c, int i) {
  // Caller holds the ledger's lock (h). The guess's pin outlives the cell's last copy (its prefetch reads the
  // ticket's host block or device copy): while that copy may still run, the pin waits in unpin_after_.
  Cell& cell = c.cells[i];
  if (!cell.loaded) return;
  if (cell.loaded->claimed_by == c.Claim()) cell.loaded->claimed_by = 0;
  if (cell.stream && cell.event && Driver(g_.backend).EventQuery(cell.event) == CUDA_ERROR_NOT_READY) {
    unpin_after_.emplace_back(cell.event, std::move(cell.loaded));
    cell.loaded.reset();
    return;
  }
  cell.loaded->pins -= 1;
  g_.ledger.Retire(h, cell.loaded);
  cell.loaded.reset();
}

bool GraphCells::Unhold(const Held& h, Cell& cell) {
  // Caller holds the ledger's lock (h). A held cell's bytes stop being readable, unless a copy
  // out of the cell still runs (false).
  (void)h;
  if (cell.round != Channel::Round::kHeld) return true;
  if (cell.draining->lent_readers > 0) return false;
  if (cell.draining->lent_cell == cell.addr) cell.draining->lent_cell = 0;
  // The cell no longer stands for that ticket: a later Arm must not hold it again for the ticket (its
  // pages may be returned and the cell mapped anew, with other bytes).
  cell.draining.reset();
  cell.until_knock = false;
  cell.round = Channel::Round::kIdle;
  return true;
}

// ---------------------------------------------------------------- copies that read a ticket's bytes

Source GraphCells::RoundSourceOf(Ticket& t) {
  Source src = SourceOf(t);
  if (!src.resident && t.lent_cell) {
    src.resident = t.lent_cell;  // complete: the round finished before its cell was lent
    src.lent = true;
    ++t.lent_readers;  // the caller watches the copy (WatchLentRead)
    ++g_.stats.lent_reads;
    if (g_.transfers.D2hDone(t)) ++g_.stats.kept_reads;
  }
  return src;
}

void GraphCells::WatchLentRead(const Source& src, const std::shared_ptr<Ticket>& t, CUevent ev) {
  // RoundSourceOf counted the reader; ev (recorded behind its copy, or on a stream
  // synchronized since) tells when it has ended. A reload cell's event is only recorded again behind
  // later copies into that cell, each ordered after the one before, so a later record is later still.
  if (src.lent) lent_reading_.emplace_back(ev, t);
}

bool GraphCells::ReleaseLentReads() {
  if (lent_reading_.empty()) return false;
  const DriverTable& d = Driver(g_.backend);
  bool busy = false;
  Held h = g_.ledger.Lock();
  for (auto it = lent_reading_.begin(); it != lent_reading_.end();) {
    if (d.EventQuery(it->first) == CUDA_ERROR_NOT_READY) {
      ++it;
      continue;
    }
    it->second->lent_readers -= 1;
    it = lent_reading_.erase(it);
    busy = true;
  }
  return busy;
}

void GraphCells::ReleaseUnpins(bool all) {
  // Pins of unloaded guesses whose cell's copy has ended since (all: the
  // streams were synchronized).
  if (unpin_after_.empty()) return;
  ScopedContext ctx(g_.backend, g_.device);  // Synchronize calls this from a user thread
  const DriverTable& d = Driver(g_.backend);
  Held h = g_.ledger.Lock();
  for (auto it = unpin_after_.begin(); it != unpin_after_.end();) {
    if (!all && d.EventQuery(it->first) == CUDA_ERROR_NOT_READY) {
      ++it;
      continue;
    }
    it->second->pins -= 1;
    g_.ledger.Retire(h, it->second);
    it = unpin_after_.erase(it);
  }
}

// ---------------------------------------------------------------- teardown

void GraphCells::ReturnAll() {
  const DriverTable& d = Driver(g_.backend);
  {
    Held h = g_.ledger.Lock();
    for (auto& [ev, t] : lent_reading_) t->lent_readers -= 1;  // every copy has ended (streams synchronized)
    lent_reading_.clear();
  }
  g_.channels.ForEach([&](Channel& c) {
    for (int i = 0; i < kMaxCells; ++i) {
      Cell& cell = c.cells[i];
      {
        Held h = g_.ledger.Lock();
        (void)Unhold(h, cell);
        Unload(h, c, i);
        if (cell.ticket) {  // a reload round the poller granted
          cell.ticket->pins -= 1;
          g_.ledger.Retire(h, cell.ticket);
          cell.ticket.reset();
        }
      }
      UnmapCell(c, i);
      if (cell.slot_id >= 0) (void)Registry::Get().Close(cell.slot_id);
      cell.slot_id = -1;
      if (cell.event) d.EventDestroy(cell.event);
      cell.event = nullptr;
      cell.draining.reset();
      cell.d2h_reads = 0;
    }
    for (Spare& sp : c.spares) {
      {
        Held h = g_.ledger.Lock();
        if (sp.lent) sp.lent->lent_cell = 0;
        sp.lent.reset();
        (void)Forget(h, sp);  // no copy out of it is left
      }
      UnmapSpare(c, sp);
      if (sp.slot_id >= 0) (void)Registry::Get().Close(sp.slot_id);
      sp.slot_id = -1;
    }
  });
  ReleaseUnpins(/*all=*/true);  // every stream was synchronized
}

}  // namespace jaxvmm
