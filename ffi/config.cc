#include "config.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "graph_words.h"

namespace jaxvmm {
namespace {

std::atomic<int> g_keep{0};
std::atomic<int> g_graph_cells{2};
std::atomic<int> g_graph_spares{0};
std::atomic<size_t> g_graph_spare_budget{0};
std::atomic<int> g_graph_hold{static_cast<int>(EngineConfig::GraphHold::kLarge)};
std::atomic<size_t> g_copy_chunk{size_t{64} << 20};

}  // namespace

void EngineConfig::SetKeepResident(int n) { g_keep.store(std::max(n, 0)); }
int EngineConfig::KeepResident() { return g_keep.load(); }
void EngineConfig::SetGraphCells(int k) { g_graph_cells.store(std::clamp(k, 1, kMaxCells)); }
int EngineConfig::GraphCells() { return g_graph_cells.load(); }
void EngineConfig::SetGraphSpares(int n) { g_graph_spares.store(std::clamp(n, 0, kMaxSpares)); }
int EngineConfig::GraphSpares() { return g_graph_spares.load(); }
void EngineConfig::SetGraphSpareBudget(size_t bytes) { g_graph_spare_budget.store(bytes); }
size_t EngineConfig::GraphSpareBudget() { return g_graph_spare_budget.load(); }
int EngineConfig::GraphSparesPerChannel() {
  const int n = GraphSpares();
  return n > 0 ? n : GraphSpareBudget() > 0 ? kMaxSpares : 0;
}
void EngineConfig::SetGraphHold(GraphHold h) { g_graph_hold.store(static_cast<int>(h)); }
EngineConfig::GraphHold EngineConfig::GraphHoldPolicy() { return static_cast<GraphHold>(g_graph_hold.load()); }
void EngineConfig::SetCopyChunk(size_t bytes) { g_copy_chunk.store(bytes); }
size_t EngineConfig::CopyChunk() { return g_copy_chunk.load(); }

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
