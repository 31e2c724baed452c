// A stats struct's field table: for each counter, the key Python reads and the member that holds it.
// Each table sits next to its struct; the bindings build the stats dicts from the tables (module.cc),
// so a counter is reported by adding one row beside it. Flags are reported as 0 or 1.
#pragma once

#include <cstdint>

namespace jaxvmm {

template <typename T>
struct StatField {
  constexpr StatField(const char* k, int64_t T::*m) : key(k), count(m) {}
  constexpr StatField(const char* k, bool T::*m) : key(k), flag(m) {}
  int64_t Get(const T& s) const { return count != nullptr ? s.*count : (s.*flag ? 1 : 0); }

  const char* key;
  int64_t T::*count = nullptr;
  bool T::*flag = nullptr;
};

}  // namespace jaxvmm
