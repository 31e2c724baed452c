// Status: how every layer above the driver seam reports failure. No exceptions below module.cc.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "driver.h"

namespace jaxvmm {

enum class Code : int {
  kOk = 0,
  kInvalidArgument = 1,  // the caller passed something wrong (Python validates first; C++ checks again)
  kNotSupported = 2,     // the device/driver lacks a capability (HOST_NUMA, VMM, a handle type)
  kOutOfMemory = 3,      // the driver or kernel has no memory for the request
  kDriver = 4,           // any other driver failure
  kState = 5,            // the slot is in the wrong state (released, closed, busy)
  kNotFound = 6,         // no slot with that id or exact range
  kUnavailable = 7,      // the backend cannot be used on this machine
  kQuarantined = 8,      // teardown failed; the remains are quarantined and will be retried
  kInternal = 9,         // a broken invariant inside jaxvmm
};
const char* CodeName(Code c);

class Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  // A failed driver call: code from the result, message "cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY".
  static Status Driver(CUresult result, Entry entry);

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  CUresult driver_result() const { return driver_result_; }
  const char* driver_error() const { return driver_result_ == CUDA_SUCCESS ? "" : ResultName(driver_result_); }
  int64_t slot() const { return slot_; }
  const std::string& stage() const { return stage_; }

  // Attach where it happened. The first annotation wins, so inner layers keep the precise stage.
  Status& At(int64_t slot, const char* stage) {
    if (slot_ < 0) slot_ = slot;
    if (stage_.empty() && stage != nullptr) stage_ = stage;
    return *this;
  }
  Status& Append(const std::string& more) {
    message_ += more;
    return *this;
  }
  Status& WithCode(Code c) {
    code_ = c;
    return *this;
  }

  // "jaxvmm: slot 7: remap: cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY"
  std::string ToString() const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
  CUresult driver_result_ = CUDA_SUCCESS;
  int64_t slot_ = -1;
  std::string stage_;
};

#define JAXVMM_RETURN_IF_ERROR(expr)   \
  do {                                 \
    ::jaxvmm::Status _st = (expr);     \
    if (!_st.ok()) return _st;         \
  } while (0)

}  // namespace jaxvmm
