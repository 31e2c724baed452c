#include "config.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <string>

#include "graph_words.h"

namespace jaxvmm {
namespace {

std::atomic<int> g_keep{0};
std::atomic<bool> g_graph_kernels{true};
std::atomic<int> g_graph_cells{2};
std::atomic<int> g_graph_spares{0};
std::atomic<bool> g_graph_fused{false};
std::atomic<int> g_graph_hold{static_cast<int>(EngineConfig::GraphHold::kLarge)};
std::atomic<size_t> g_copy_chunk{size_t{64} << 20};

}  // namespace

void EngineConfig::SetKeepResident(int n) { g_keep.store(std::max(n, 0)); }
int EngineConfig::KeepResident() { return g_keep.load(); }
void EngineConfig::SetGraphKernels(bool on) { g_graph_kernels.store(on); }
bool EngineConfig::GraphKernels() { return g_graph_kernels.load(); }
void EngineConfig::SetGraphCells(int k) { g_graph_cells.store(std::clamp(k, 1, kMaxCells)); }
int EngineConfig::GraphCells() { return g_graph_cells.load(); }
void EngineConfig::SetGraphSpares(int n) { g_graph_spares.store(std::clamp(n, 0, kMaxSpares)); }
int EngineConfig::GraphSpares() { return g_graph_spares.load(); }
void EngineConfig::SetGraphFused(bool on) { g_graph_fused.store(on); }
bool EngineConfig::GraphFused() { return g_graph_fused.load(); }
void EngineConfig::SetGraphHold(GraphHold h) { g_graph_hold.store(static_cast<int>(h)); }
EngineConfig::GraphHold EngineConfig::GraphHoldPolicy() { return static_cast<GraphHold>(g_graph_hold.load()); }
void EngineConfig::SetCopyChunk(size_t bytes) { g_copy_chunk.store(bytes); }
size_t EngineConfig::CopyChunk() { return g_copy_chunk.load(); }

bool EngineConfig::XlaKeepsCommandOrder() {
  const char* env = std::getenv("XLA_FLAGS");
  if (!env) return true;
  std::string flags(env);
  for (char& ch : flags) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  // The last setting wins, as in XLA's parser (-- or -, `=` and the value, possibly quoted).
  const std::string key = "xla_gpu_command_buffer_scheduling_mode=";
  bool in_order = true;
  for (size_t at = flags.find(key); at != std::string::npos; at = flags.find(key, at + key.size())) {
    size_t v = at + key.size();
    while (v < flags.size() && (flags[v] == '"' || flags[v] == '\'')) ++v;
    in_order = flags.compare(v, 10, "concurrent") != 0;
  }
  return in_order;
}

}  // namespace jaxvmm
