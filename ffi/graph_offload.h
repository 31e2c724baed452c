// Graph mode's offload rounds, as the poller serves them (DESIGN.md, "Graph mode"): a round's ticket
// and its host block, the D2H out of its cell on gd2h, and the cell's next grant: armed behind that
// D2H, lent to a spare when PCIe is behind, or held with its bytes readable (every spare lent, or the
// one cell of a large call site until its next round knocks).
//
// No lock of its own: every call is made with GraphMode::mu_ held.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "graph_cells.h"

namespace jaxvmm {

class OffloadRounds {
 public:
  OffloadRounds(GraphShared& g, GraphCells& cells) : g_(g), cells_(cells) {}
  OffloadRounds(const OffloadRounds&) = delete;
  OffloadRounds& operator=(const OffloadRounds&) = delete;

  // One poller pass over offload channel c: its finished rounds (filled) and a waiting one (knock).
  // True when there was work.
  bool Serve(Channel& c);
  bool ReapOffloads();  // graph-mode D2H copies that finished: their tickets are on the host
  bool Draining() const { return !round_d2h_.empty(); }  // a graph-mode D2H may still run

 private:
  using Held = Ledger::Held;
  // A graph-mode offload round's ticket with its host block, for the token the device took (its cell's
  // grant_token). Null, and *st says why, when it cannot be made. Takes the ledger lock.
  std::shared_ptr<Ticket> MakeRoundTicket(const Channel& c, uint64_t token, Status* st);
  Status CopyOutOfCell(Channel& c, int i, const std::shared_ptr<Ticket>& t);  // D2H of cell i on gd2h
  void RecordOffloadError(const Channel& c, const Status& st);
  // A reserved token into grant[i], on gd2h after the cell's D2H; or on garm when no copy out of the
  // cell is pending (`settled`, or found so) or, when PCIe is behind and that D2H is still queued,
  // after the cell took a free spare's pages (Lend). With no spare to lend, holds the cell instead
  // (Hold; returns false).
  bool Arm(Channel& c, int i, bool host, bool settled = false);
  void Hold(Channel& c, int i, bool host, bool until_knock);  // cell i keeps its bytes readable, unarmed
  static bool HoldsUntilKnock(const Channel& c);  // GraphHold::kLarge: the one cell of a large call site
  bool ServeHeld(Channel& c);                     // arms held cells that settled or found a spare
  void ArmIdleCells(Channel& c);  // every idle cell it can map within the budget

  GraphShared& g_;
  GraphCells& cells_;
  uint64_t gd2h_issued_ = 0;  // the last graph D2H sequence number enqueued on gd2h (the clock's)
  std::vector<std::shared_ptr<Ticket>> round_d2h_;  // offload rounds whose D2H may still run
};

}  // namespace jaxvmm
