// What the bindings share: module.cc (jaxvmm._jaxvmm) and module_testing.cc (its _testing hooks), the
// only files besides this one that see nanobind. A failed Status is thrown as a StatusError, which
// module.cc's translator raises as the jaxvmm error it names; the core is called without the GIL (it
// never touches Python).
#pragma once

#include <nanobind/nanobind.h>

#include <string>
#include <type_traits>
#include <utility>

#include "driver.h"
#include "engine.h"
#include "status.h"

namespace nb = nanobind;

namespace jaxvmm {

struct StatusError {
  Status status;
};

inline void Check(const Status& st) {
  if (!st.ok()) throw StatusError{st};
}

// Calls `f` without the GIL and returns what it returns.
template <typename F>
auto NoGil(F&& f) {
  nb::gil_scoped_release nogil;
  return f();
}

// Calls `f`, which returns a Status, without the GIL; a failure raises.
template <typename F>
void Run(F&& f) {
  Check(NoGil(std::forward<F>(f)));
}

inline Backend ParseBackend(const std::string& name) {
  if (name == "cuda") return Backend::kCuda;
  if (name == "posix") return Backend::kPosix;
  Check(Status(Code::kInvalidArgument, "unknown backend '" + name + "' (expected 'cuda' or 'posix')"));
  return Backend::kPosix;
}

// The engine of (backend, device) as Python holds it (`Engine`): each call finds the engine, starting it
// on first use as XLA's handlers do, so a handle stays valid across close_all().
struct EngineRef {
  Backend backend;
  int device;

  Engine* Get() const {
    Engine* e = nullptr;
    Run([&] { return Engine::For(backend, device, &e); });
    return e;
  }
};

// An Engine method bound as a Python method of `Engine`: runs without the GIL; a Status is raised when
// it failed, any other result returned.
template <typename R, typename... A>
auto EngineMethod(R (Engine::*op)(A...)) {
  return [op](const EngineRef& ref, A... args) {
    Engine* e = ref.Get();
    if constexpr (std::is_same_v<R, Status>) {
      Run([&] { return (e->*op)(args...); });
    } else {
      return NoGil([&] { return (e->*op)(args...); });
    }
  };
}

// The test, replay, benchmark and fault hooks (module_testing.cc), bound into `m` by load_testing().
void BindTesting(nb::module_ m);

}  // namespace jaxvmm
