#include "config.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "graph_words.h"

namespace jaxvmm {
namespace {

// One row per Setting, in its order: the name jaxvmm/_config.py declares it under and, for a choice,
// its names in the order of their values (nullptr-terminated; none for a number).
struct Row {
  Setting setting;
  const char* name;
  const char* choices[3];
};
constexpr Row kRows[] = {
    {Setting::kHostPoolLimit, "host_pool_limit", {}},
    {Setting::kHostStore, "host_store", {"pinned", "host_numa"}},  // HostStoreKind
    {Setting::kHostPoolChunk, "host_pool_chunk", {}},
    {Setting::kPrefetchDepth, "prefetch_depth", {}},
    {Setting::kStagingBudget, "staging_budget", {}},
    {Setting::kStagingIdleMs, "staging_idle_ms", {}},
    {Setting::kKeepResident, "keep_resident", {}},
    {Setting::kCopyChunk, "copy_chunk", {}},
    {Setting::kGraphCells, "graph_cells", {}},
    {Setting::kGraphSpares, "graph_spares", {}},
    {Setting::kGraphSpareBudget, "graph_spare_budget", {}},
    {Setting::kGraphHold, "graph_hold", {"spares", "large"}},  // EngineConfig::GraphHold
    {Setting::kTrace, "trace", {}},
    {Setting::kPredict, "predict", {}},
    {Setting::kWorkerSpinUs, "worker_spin_us", {}},
    {Setting::kRingProfile, "ring_profile", {}},
    {Setting::kPosixAsync, "posix_async", {}},
    {Setting::kPosixLinkUs, "posix_link_us", {}},
    {Setting::kPosixDtodUs, "posix_dtod_us", {}},
};
constexpr int kSettings = static_cast<int>(Setting::kCount);
static_assert(std::size(kRows) == kSettings, "one row per Setting");
constexpr bool RowsInOrder() {
  for (int i = 0; i < kSettings; ++i)
    if (static_cast<int>(kRows[i].setting) != i) return false;
  return true;
}
static_assert(RowsInOrder(), "kRows in the order of Setting");

// The values in force; 0 until Python pushes every setting at import (jaxvmm/_config.py, load).
std::atomic<int64_t> g_values[kSettings] = {};

const Row& RowOf(Setting s) { return kRows[static_cast<int>(s)]; }
int64_t ChoiceCount(Setting s) {
  int64_t n = 0;
  while (n < 3 && RowOf(s).choices[n]) ++n;
  return n;
}

}  // namespace

int64_t EngineConfig::Get(Setting s) { return g_values[static_cast<int>(s)].load(std::memory_order_relaxed); }

bool EngineConfig::Find(std::string_view name, Setting* out) {
  for (const Row& r : kRows)
    if (name == r.name) {
      *out = r.setting;
      return true;
    }
  return false;
}

bool EngineConfig::Set(Setting s, int64_t value) {
  if (ChoiceCount(s) > 0) return false;
  g_values[static_cast<int>(s)].store(value);
  return true;
}

bool EngineConfig::SetChoice(Setting s, std::string_view name) {
  for (int64_t i = 0, n = ChoiceCount(s); i < n; ++i)
    if (name == RowOf(s).choices[i]) {
      g_values[static_cast<int>(s)].store(i);
      return true;
    }
  return false;
}

const char* EngineConfig::ChoiceName(Setting s, int64_t index) {
  return index >= 0 && index < ChoiceCount(s) ? RowOf(s).choices[index] : nullptr;
}

int EngineConfig::KeepResident() {
  return static_cast<int>(std::clamp<int64_t>(Get(Setting::kKeepResident), 0, std::numeric_limits<int>::max()));
}
int EngineConfig::GraphCells() { return static_cast<int>(std::clamp<int64_t>(Get(Setting::kGraphCells), 1, kMaxCells)); }
int EngineConfig::GraphSpares() { return static_cast<int>(std::clamp<int64_t>(Get(Setting::kGraphSpares), 0, kMaxSpares)); }
size_t EngineConfig::GraphSpareBudget() { return static_cast<size_t>(std::max<int64_t>(Get(Setting::kGraphSpareBudget), 0)); }
int EngineConfig::GraphSparesPerChannel() {
  const int n = GraphSpares();
  return n > 0 ? n : GraphSpareBudget() > 0 ? kMaxSpares : 0;
}
EngineConfig::GraphHold EngineConfig::GraphHoldPolicy() {
  return Get(Setting::kGraphHold) == static_cast<int64_t>(GraphHold::kSpares) ? GraphHold::kSpares : GraphHold::kLarge;
}
size_t EngineConfig::CopyChunk() { return static_cast<size_t>(std::max<int64_t>(Get(Setting::kCopyChunk), 0)); }


namespace {

// XLA_FLAGS as XLA reads it: the value itself when it starts with '-' (after blanks), else the file it
// names. Flags are blank-separated `--name` or `--name=value`, a value possibly in double quotes
// (backslash escapes) or single quotes; parsing stops at the first token that is not a flag.
std::vector<std::pair<std::string, std::optional<std::string>>> XlaFlags() {
  std::vector<std::pair<std::string, std::optional<std::string>>> out;
  const char* env = std::getenv("XLA_FLAGS");
  if (!env) return out;
  std::string text(env);
  constexpr const char* kBlank = " \t\r\n";
  const size_t first = text.find_first_not_of(kBlank);
  if (first == std::string::npos) return out;
  if (text[first] != '-') {
    std::ifstream file(text);
    if (!file) return out;  // XLA stops the process over it
    text.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
  }
  auto name_char = [](char ch) { return ch == '-' || ch == '_' || std::isalnum(static_cast<unsigned char>(ch)); };
  size_t i = text.find_first_not_of(kBlank);
  while (i != std::string::npos && text[i] == '-') {
    size_t e = i;
    while (e < text.size() && name_char(text[e])) ++e;
    std::string name = text.substr(i, e - i);
    std::optional<std::string> value;
    if (e < text.size() && text[e] == '=') {
      ++e;
      if (e < text.size() && (text[e] == '"' || text[e] == '\'')) {
        const char quote = text[e++];
        value.emplace();
        for (; e < text.size() && text[e] != quote; ++e) {
          if (quote == '"' && text[e] == '\\' && e + 1 < text.size()) ++e;
          value->push_back(text[e]);
        }
        if (e < text.size()) ++e;  // the closing quote
      } else {
        const size_t end = std::min(text.find_first_of(kBlank, e), text.size());
        value = text.substr(e, end - e);
        e = end;
      }
    } else {
      e = std::min(text.find_first_of(kBlank, e), text.size());
    }
    if (name.rfind("--", 0) == 0) out.emplace_back(name.substr(2), std::move(value));
    i = text.find_first_not_of(kBlank, e);
  }
  return out;
}

}  // namespace

bool EngineConfig::XlaKeepsCommandOrder() {
  // The last setting that XLA takes wins: the mode's names (case as XLA spells them; XLA ignores any
  // other value), and the deprecated boolean that sets CONCURRENT (true) or SERIALIZE (false).
  bool in_order = true;
  for (const auto& [name, value] : XlaFlags()) {
    if (name == "xla_gpu_command_buffer_scheduling_mode" && value) {
      if (*value == "CONCURRENT") in_order = false;
      else if (*value == "LHS" || *value == "SERIALIZE") in_order = true;
    } else if (name == "xla_gpu_graph_enable_concurrent_region") {
      if (!value || *value == "true" || *value == "1") in_order = false;
      else if (*value == "false" || *value == "0") in_order = true;
    }
  }
  return in_order;
}

}  // namespace jaxvmm
