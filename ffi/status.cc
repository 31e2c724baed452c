#include "status.h"

namespace jaxvmm {

const char* CodeName(Code c) {
  switch (c) {
    case Code::kOk: return "ok";
    case Code::kInvalidArgument: return "invalid_argument";
    case Code::kNotSupported: return "not_supported";
    case Code::kOutOfMemory: return "out_of_memory";
    case Code::kDriver: return "driver";
    case Code::kState: return "state";
    case Code::kNotFound: return "not_found";
    case Code::kUnavailable: return "unavailable";
    case Code::kQuarantined: return "quarantined";
    case Code::kInternal: return "internal";
  }
  return "unknown";
}

Status Status::Driver(CUresult result, Entry entry) {
  Code code = Code::kDriver;
  if (result == CUDA_ERROR_OUT_OF_MEMORY) code = Code::kOutOfMemory;
  if (result == CUDA_ERROR_NOT_SUPPORTED || result == CUDA_ERROR_NOT_PERMITTED) code = Code::kNotSupported;
  Status s(code, std::string(EntryName(entry)) + ": " + ResultName(result));
  s.driver_result_ = result;
  return s;
}

std::string Status::ToString() const {
  std::string out = "jaxvmm: ";
  if (slot_ >= 0) out += "slot " + std::to_string(slot_) + ": ";
  if (!stage_.empty()) out += stage_ + ": ";
  return out + message_;
}

}  // namespace jaxvmm
