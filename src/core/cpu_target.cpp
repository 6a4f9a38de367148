// The SIMD target of the cpu kernels: Highway's dynamic dispatch picks the best one this build has
// (HWY_TARGETS, the same in every kernel file: one set of flags) and the CPU allows;
// MESHFUSE_CPU_TARGET lowers it, through hwy::DisableTargets (Highway's call for "the best
// available target is undesirable"), applied when the library is loaded, before any kernel runs.
#include <hwy/highway.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "meshfuse/core/platform.h"

namespace meshfuse {
namespace {

// meshfuse's name of a Highway target (MESHFUSE_CPU_TARGET takes these).
std::string target_name(std::int64_t target) {
  switch (target) {
#if HWY_ARCH_X86
    case HWY_AVX3:
    case HWY_AVX3_DL:
      return "avx512";
    case HWY_AVX2:
      return "avx2";
    case HWY_SSE4:
      return "sse4";
    case HWY_SSSE3:
      return "ssse3";
#endif
#if HWY_ARCH_ARM
    case HWY_NEON:
      return "neon";
    case HWY_SVE:
    case HWY_SVE_256:
      return "sve";
    case HWY_SVE2:
    case HWY_SVE2_128:
      return "sve2";
#endif
    case HWY_EMU128:
    case HWY_SCALAR:
      return "scalar";
    default: {
      std::string name = hwy::TargetName(target);
      for (char& c : name) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
      return name;
    }
  }
}

// The targets this build has, best first.
std::vector<std::int64_t> compiled_targets() {
  std::vector<std::int64_t> targets;
  for (std::int64_t t = HWY_TARGETS; t != 0; t &= t - 1) targets.push_back(t & -t);
  return targets;
}

// Applies MESHFUSE_CPU_TARGET: every target better than the ones of that name is disabled, except
// those of that name. (Arm's names interleave, best first: SVE2_128 "sve2", SVE_256 "sve", SVE2
// "sve2", SVE "sve", NEON: "sve" keeps SVE_256 and SVE, and disables SVE2_128 and SVE2.)
// An unknown name leaves the choice alone and says so (the library cannot throw while loading);
// a target the CPU lacks leaves the best one below it, and says so.
const bool kPinned = [] {
  const char* env = std::getenv("MESHFUSE_CPU_TARGET");
  if (!env || !*env) return false;
  std::int64_t named = 0, worst = 0;  // the targets of that name, the last (worst) of them
  for (const std::int64_t t : compiled_targets()) {
    if (target_name(t) != env) continue;
    named |= t;
    worst = t;
  }
  if (named) {
    hwy::DisableTargets((worst - 1) & ~named);  // the bits below a target are the better ones
    if ((hwy::SupportedTargets() & named) == 0)
      std::fprintf(stderr, "meshfuse: MESHFUSE_CPU_TARGET=%s: this CPU lacks it; %s runs\n", env,
                   cpu_simd_target().c_str());
    return true;
  }
  std::string known;
  for (const std::string& name : cpu_simd_targets()) known += (known.empty() ? "" : "|") + name;
  std::fprintf(stderr,
               "meshfuse: MESHFUSE_CPU_TARGET=%s is not a target of this build (%s); "
               "ignored\n",
               env, known.c_str());
  return false;
}();

}  // namespace

std::string cpu_simd_target() {
  const std::int64_t usable = hwy::SupportedTargets() & HWY_TARGETS;
  return target_name(usable & -usable);
}

std::vector<std::string> cpu_simd_targets() {
  std::vector<std::string> names;
  for (const std::int64_t t : compiled_targets()) {
    const std::string name = target_name(t);
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  return names;
}

}  // namespace meshfuse
