#include "core/shared_library.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <cstdlib>
#include <utility>

#include "meshfuse/core/error.h"

namespace meshfuse::detail {

SharedLibrary::SharedLibrary(std::string what, const char* env, const std::string& soname,
                             const std::string& fallback, const char* hint)
    : what_(std::move(what)) {
  const char* named = std::getenv(env);
  const bool by_env = named != nullptr && *named != '\0';
  path_ = by_env ? named : soname;
  // Local symbols: the library serves meshfuse's calls and does not interpose on others'.
  handle_ = dlopen(path_.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle_ != nullptr) return;
  if (by_env)
    fail(ErrorCode::BackendUnavailable, "{}: cannot load {}, the file {} names ({})", what_, path_,
         env, dlerror());
  std::string tried = fmt::format("{} ({})", path_, dlerror());
  if (!fallback.empty() && fallback != soname) {
    path_ = fallback;
    handle_ = dlopen(path_.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle_ != nullptr) return;
    tried += fmt::format(", nor {} ({})", path_, dlerror());
  }
  fail(ErrorCode::BackendUnavailable, "{}: cannot load {}; {} or name the library in {}", what_,
       tried, hint, env);
}

void* SharedLibrary::symbol(const char* name, const char* requirement) const {
  void* fn = dlsym(handle_, name);
  if (fn == nullptr)
    fail(ErrorCode::BackendUnavailable, "{}: {} has no {} ({} is needed)", what_, path_, name,
         requirement);
  return fn;
}

}  // namespace meshfuse::detail
