#include "ops/gemm/cpu_blas.h"

#include <dnnl.h>

#include <cstdlib>
#include <optional>
#include <string_view>

#include "core/names.h"
#include "core/shared_library.h"
#include "meshfuse/core/error.h"

namespace meshfuse::detail::cpu {
namespace {

enum class CpuBlas { MKL, OneDNN };

std::string_view to_string(CpuBlas b) { return b == CpuBlas::MKL ? "mkl" : "onednn"; }

struct Mkl {
  std::string text;  // "Intel MKL <version> (<file>), <threads>"
  MklSgemm sgemm;
};

#if defined(__x86_64__)
Mkl open_mkl() {
  const SharedLibrary lib("gemm: Intel MKL", "MESHFUSE_MKL_LIBRARY", "libmkl_rt.so.3",
                          MESHFUSE_MKL_BUILD_LIBRARY,
                          "pip install mkl, or set MESHFUSE_CPU_BLAS=onednn,");
  const char* requirement = "a oneMKL with the 64-bit-int CBLAS";
  int (*set_threading_layer)(int) = nullptr;
  void (*get_version_string)(char*, int) = nullptr;
  Mkl m{};
  lib.bind(set_threading_layer, "MKL_Set_Threading_Layer", requirement);
  lib.bind(get_version_string, "MKL_Get_Version_String", requirement);
  lib.bind(m.sgemm, "cblas_sgemm_64", requirement);
  // GNU OpenMP (MKL_THREADING_GNU = 3), the runtime meshfuse's own loops and PyTorch's run on:
  // with MKL's default, Intel's, two OpenMP thread pools would share the cores. Unless the user
  // chose with MKL_THREADING_LAYER; a process whose MKL already runs keeps its layer (returned).
  std::string threads;
  if (const char* layer = std::getenv("MKL_THREADING_LAYER"); layer != nullptr && *layer != '\0') {
    threads = std::string("threads as MKL_THREADING_LAYER=") + layer;
  } else {
    constexpr const char* kLayers[] = {"Intel OpenMP threads", "sequential", "PGI OpenMP threads",
                                       "GNU OpenMP threads", "TBB threads"};
    const int got = set_threading_layer(3);
    threads = got >= 0 && got < 5 ? kLayers[got] : "threading layer " + std::to_string(got);
    if (got != 3) threads += " (chosen before meshfuse by another user of this MKL)";
  }
  char version[198] = {};
  get_version_string(version, sizeof(version));
  // "Intel(R) oneAPI Math Kernel Library Version 2026.2.1-Product Build ..." -> "2026.2.1"
  std::string_view v(version);
  const std::size_t at = v.find("Version ");
  v = at == std::string_view::npos ? std::string_view("?") : v.substr(at + 8);
  v = v.substr(0, v.find_first_of("- "));
  m.text = "Intel MKL " + std::string(v) + " (" + lib.path() + "), " + threads;
  return m;
}
#else
Mkl open_mkl() {
  fail(ErrorCode::BackendUnavailable,
       "gemm: Intel MKL was asked for (MESHFUSE_CPU_BLAS=mkl or MESHFUSE_MKL_LIBRARY), but it "
       "exists for x86-64 only; unset them");
}
#endif

// The choice, made once; a pinned MKL that failed to open throws and is tried again next call.
const Mkl* chosen() {
  static const std::optional<Mkl> m = []() -> std::optional<Mkl> {
    const char* env = std::getenv("MESHFUSE_CPU_BLAS");
    if (env != nullptr && *env != '\0') {
      constexpr CpuBlas kAll[] = {CpuBlas::MKL, CpuBlas::OneDNN};
      if (parse_name("MESHFUSE_CPU_BLAS", env, kAll) == CpuBlas::OneDNN) return std::nullopt;
      return open_mkl();
    }
    // A file named is a file wanted: not found, it is an error, not oneDNN in silence.
    if (const char* file = std::getenv("MESHFUSE_MKL_LIBRARY"); file != nullptr && *file != '\0')
      return open_mkl();
    try {
      return open_mkl();
    } catch (const Error&) {
      return std::nullopt;  // not installed: oneDNN
    }
  }();
  return m ? &*m : nullptr;
}

}  // namespace

MklSgemm mkl_sgemm() {
  const Mkl* m = chosen();
  return m != nullptr ? m->sgemm : nullptr;
}

std::string cpu_blas_library() {
  if (const Mkl* m = chosen()) return m->text;
#if defined(__aarch64__)
  return "OpenBLAS";
#else
  const dnnl_version_t* v = dnnl_version();
  return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
         std::to_string(v->patch);
#endif
}

}  // namespace meshfuse::detail::cpu
