// Graph mode's reload rounds, as the poller serves them (DESIGN.md, "Graph mode"): the next
// predictions copied into idle reload cells ahead of their rounds (prefetches on gh2d, each with its
// grant), and a round that found no cell holding its token (a request): the cell chosen, its bytes put
// in on gfix (from an offload cell that still holds them, device to device, else from the host; 0xFF
// for a bad token), then go.
//
// No lock of its own: every call is made with GraphMode::mu_ held.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "graph_cells.h"

namespace jaxvmm {

class ReloadRounds {
 public:
  ReloadRounds(GraphShared& g, GraphCells& cells) : g_(g), cells_(cells) {}
  ReloadRounds(const ReloadRounds&) = delete;
  ReloadRounds& operator=(const ReloadRounds&) = delete;

  // One poller pass over reload channel c: its finished rounds (done) and a waiting one (request).
  // True when there was work.
  bool Serve(Channel& c);
  void DropStaleGuesses();  // reload cells whose guess another reload consumed: revoke and unload

 private:
  using Held = Ledger::Held;
  // Caller holds the ledger lock too (h). The ticket a reload round's token names, if this call site
  // can reload it; the round consumes `a` in cell i (true: a hit, the cell holds it already).
  std::shared_ptr<Ticket> FindForRound(const Held& h, const Channel& c, uint64_t token, std::string* why);
  bool TakeForRound(const Held& h, Channel& c, int i, const std::shared_ptr<Ticket>& a, Source* src);
  // The next predictions into the channel's idle reload cells, each with its grant.
  void PrefetchInto(Channel& c);
  // Reload cell i's guess (cell.loaded, claimed and pinned) from `src` on `s`: the copy, its grant and
  // the cell's event behind them. False on failure: `s` synchronized, the guess unloaded unless its
  // grant is out. *copied: the copy was enqueued.
  bool LoadGuess(Channel& c, int i, const Source& src, CUstream s, const char* stage, bool* copied = nullptr);
  // A small offload call site's cell, of a site whose rounds run on `stream`, that still holds t's bytes
  // (Cell::holds: no later round refilled it, its pages stayed), if any. Only while XLA's stream waits
  // for a reload's go may it be read.
  Cell* CellHolding(const std::shared_ptr<Ticket>& t, size_t cell_size, CUstream stream);
  // Reload channel c, whose round in cell `busy` waits for go: its other idle, empty cells take the next
  // guesses whose bytes are still in offload cells, copied device to device on gfix; true when a copy
  // was enqueued (go must then follow it on gfix).
  bool StageHeldGuesses(Channel& c, int busy);
  void FillInvalid(Channel& c, int i);  // 0xFF into cell i, ordered after every copy into it

  GraphShared& g_;
  GraphCells& cells_;
};

}  // namespace jaxvmm
