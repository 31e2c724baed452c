// XLA FFI handlers: the only file that sees XLA headers. Thin and non-throwing: decode the call,
// run the engine's host-time step, turn a Status into an ffi::Error. User input was validated in
// Python (jaxvmm/ops.py); sizes are checked again here.
#include "handlers.h"

#include "engine.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxvmm {
namespace {

ffi::Error ToFfi(const Status& st) {
  if (st.ok()) return ffi::Error::Success();
  ffi::ErrorCode code = ffi::ErrorCode::kInternal;
  switch (st.code()) {
    case Code::kInvalidArgument: code = ffi::ErrorCode::kInvalidArgument; break;
    case Code::kOutOfMemory: code = ffi::ErrorCode::kResourceExhausted; break;
    case Code::kNotSupported: code = ffi::ErrorCode::kUnimplemented; break;
    case Code::kUnavailable: code = ffi::ErrorCode::kUnavailable; break;
    default: break;
  }
  return ffi::Error(code, st.ToString());
}

CUdeviceptr Ptr(void* p) { return reinterpret_cast<CUdeviceptr>(p); }

Status GetEngine(Backend b, int device, Engine** e) {
  JAXVMM_RETURN_IF_ERROR(Engine::For(b, device, e));
  return Status();
}

Status CheckToken(const ffi::AnyBuffer& token, const char* what) {
  if (token.size_bytes() != sizeof(uint64_t))
    return Status(Code::kInvalidArgument, std::string(what) + ": a ticket token is 8 bytes, got " +
                                              std::to_string(token.size_bytes()));
  return Status();
}

// Errors name the call site (Python maps the number to a source line).
Status AtSite(Status st, int64_t site) {
  if (!st.ok() && site > 0) st.Append(" [call site " + std::to_string(site) + "]");
  return st;
}

Status Offload(Backend b, CUstream stream, int device, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> token,
               int64_t signature, int64_t site) {
  Engine* e = nullptr;
  JAXVMM_RETURN_IF_ERROR(GetEngine(b, device, &e));
  JAXVMM_RETURN_IF_ERROR(CheckToken(*token, "offload"));
  return AtSite(e->Offload(stream, site, Ptr(x.untyped_data()), ArrayMeta{x.size_bytes(), signature, site},
                           Ptr(token->untyped_data())),
                site);
}

Status Reload(Backend b, CUstream stream, int device, ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> y,
              int64_t signature, int64_t site) {
  Engine* e = nullptr;
  JAXVMM_RETURN_IF_ERROR(GetEngine(b, device, &e));
  JAXVMM_RETURN_IF_ERROR(CheckToken(token, "reload"));
  return AtSite(e->Reload(stream, site, Ptr(token.untyped_data()), Ptr(y->untyped_data()),
                          ArrayMeta{y->size_bytes(), signature, site}),
                site);
}

// The initialize stage (CUDA): once per execution, on the host, before the execution's device work.
Status Prepare(CUstream stream, int device, ChannelKind kind, size_t nbytes, int64_t signature, int64_t site) {
  Engine* e = nullptr;
  JAXVMM_RETURN_IF_ERROR(GetEngine(Backend::kCuda, device, &e));
  return e->Prepare(stream, site, kind, ArrayMeta{nbytes, signature});
}

Status Prefetch(Backend b, CUstream stream, int device, ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> out) {
  Engine* e = nullptr;
  JAXVMM_RETURN_IF_ERROR(GetEngine(b, device, &e));
  JAXVMM_RETURN_IF_ERROR(CheckToken(token, "prefetch"));
  return e->Prefetch(stream, Ptr(token.untyped_data()), Ptr(out->untyped_data()));
}

// ---- CUDA: XLA's stream and the device ordinal come from the call's context ----
ffi::Error OffloadCuda(CUstream s, int32_t dev, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> t, int64_t sig, int64_t site) {
  return ToFfi(Offload(Backend::kCuda, s, dev, x, t, sig, site));
}
ffi::Error ReloadCuda(CUstream s, int32_t dev, ffi::AnyBuffer t, ffi::Result<ffi::AnyBuffer> y, int64_t sig, int64_t site) {
  return ToFfi(Reload(Backend::kCuda, s, dev, t, y, sig, site));
}
ffi::Error OffloadInitCuda(CUstream s, int32_t dev, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer>, int64_t sig, int64_t site) {
  return ToFfi(Prepare(s, dev, ChannelKind::kOffload, x.size_bytes(), sig, site));
}
ffi::Error ReloadInitCuda(CUstream s, int32_t dev, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> y, int64_t sig, int64_t site) {
  return ToFfi(Prepare(s, dev, ChannelKind::kReload, y->size_bytes(), sig, site));
}
ffi::Error PrefetchCuda(CUstream s, int32_t dev, ffi::AnyBuffer t, ffi::Result<ffi::AnyBuffer> o, int64_t) {
  return ToFfi(Prefetch(Backend::kCuda, s, dev, t, o));
}

// ---- cpu: no stream; the POSIX backend's copies complete in the call ----
// XLA passes a cpu device's id; with jax.distributed that is not the local index the engines use.
ffi::Error OffloadCpu(int32_t dev, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> t, int64_t sig, int64_t site) {
  return ToFfi(Offload(Backend::kPosix, nullptr, PosixLocalOrdinal(dev), x, t, sig, site));
}
ffi::Error ReloadCpu(int32_t dev, ffi::AnyBuffer t, ffi::Result<ffi::AnyBuffer> y, int64_t sig, int64_t site) {
  return ToFfi(Reload(Backend::kPosix, nullptr, PosixLocalOrdinal(dev), t, y, sig, site));
}
ffi::Error PrefetchCpu(int32_t dev, ffi::AnyBuffer t, ffi::Result<ffi::AnyBuffer> o, int64_t) {
  return ToFfi(Prefetch(Backend::kPosix, nullptr, PosixLocalOrdinal(dev), t, o));
}

}  // namespace
}  // namespace jaxvmm

// `site` is a per-call-site attribute: it keeps XLA from merging two offloads of the same value (CSE)
// and names the call site in diagnostics. CUDA handlers also take XLA's stream.
#define JAXVMM_CUDA_CTX .Ctx<ffi::PlatformStream<CUstream>>().Ctx<ffi::DeviceOrdinal>()
#define JAXVMM_CPU_CTX .Ctx<ffi::DeviceOrdinal>()
#define JAXVMM_ARRAY_OP(bind, ctx) bind ctx.Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>("signature").Attr<int64_t>("site")
#define JAXVMM_TOKEN_OP(ctx) ffi::Ffi::Bind() ctx.Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>("site")
#define JAXVMM_GRAPH_TRAITS {xla::ffi::Traits::kCmdBufferCompatible}

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxvmm_offload_cuda, jaxvmm::OffloadCuda, JAXVMM_ARRAY_OP(ffi::Ffi::Bind(), JAXVMM_CUDA_CTX));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxvmm_reload_cuda, jaxvmm::ReloadCuda, JAXVMM_ARRAY_OP(ffi::Ffi::Bind(), JAXVMM_CUDA_CTX));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxvmm_prefetch_cuda, jaxvmm::PrefetchCuda, JAXVMM_TOKEN_OP(JAXVMM_CUDA_CTX));
// Graph mode: the execute stages XLA may capture, and the initialize stages that prepare them.
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxvmm_offload_cuda_graph, jaxvmm::OffloadCuda, JAXVMM_ARRAY_OP(ffi::Ffi::Bind(), JAXVMM_CUDA_CTX),
                              JAXVMM_GRAPH_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxvmm_reload_cuda_graph, jaxvmm::ReloadCuda, JAXVMM_ARRAY_OP(ffi::Ffi::Bind(), JAXVMM_CUDA_CTX),
                              JAXVMM_GRAPH_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxvmm_prefetch_cuda_graph, jaxvmm::PrefetchCuda, JAXVMM_TOKEN_OP(JAXVMM_CUDA_CTX), JAXVMM_GRAPH_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxvmm_offload_cuda_init, jaxvmm::OffloadInitCuda,
                              JAXVMM_ARRAY_OP(ffi::Ffi::BindInitialize(), JAXVMM_CUDA_CTX));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxvmm_reload_cuda_init, jaxvmm::ReloadInitCuda,
                              JAXVMM_ARRAY_OP(ffi::Ffi::BindInitialize(), JAXVMM_CUDA_CTX));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxvmm_offload_cpu, jaxvmm::OffloadCpu, JAXVMM_ARRAY_OP(ffi::Ffi::Bind(), JAXVMM_CPU_CTX));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxvmm_reload_cpu, jaxvmm::ReloadCpu, JAXVMM_ARRAY_OP(ffi::Ffi::Bind(), JAXVMM_CPU_CTX));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxvmm_prefetch_cpu, jaxvmm::PrefetchCpu, JAXVMM_TOKEN_OP(JAXVMM_CPU_CTX));

namespace jaxvmm {

std::vector<HandlerEntry> Handlers() {
  auto p = [](auto* f) { return reinterpret_cast<void*>(f); };
  return {
      {"jaxvmm_offload", "CUDA", p(&jaxvmm_offload_cuda), p(&jaxvmm_offload_cuda_graph), p(&jaxvmm_offload_cuda_init)},
      {"jaxvmm_reload", "CUDA", p(&jaxvmm_reload_cuda), p(&jaxvmm_reload_cuda_graph), p(&jaxvmm_reload_cuda_init)},
      {"jaxvmm_prefetch", "CUDA", p(&jaxvmm_prefetch_cuda), p(&jaxvmm_prefetch_cuda_graph), nullptr},
      {"jaxvmm_offload", "cpu", reinterpret_cast<void*>(&jaxvmm_offload_cpu)},
      {"jaxvmm_reload", "cpu", reinterpret_cast<void*>(&jaxvmm_reload_cpu)},
      {"jaxvmm_prefetch", "cpu", reinterpret_cast<void*>(&jaxvmm_prefetch_cpu)},
  };
}

std::string FfiApiVersion() { return std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR); }

}  // namespace jaxvmm
