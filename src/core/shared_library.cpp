#include "core/shared_library.h"

#include <dlfcn.h>

#include <cstdlib>
#include <utility>

#include "meshfuse/core/error.h"

namespace meshfuse::detail {

SharedLibrary::SharedLibrary(std::string what, const char* env, const std::string& soname,
                             const std::string& fallback, const char* hint)
    : what_(std::move(what)) {
  const char* named = std::getenv(env);
  path_ = named != nullptr && *named != '\0' ? named : soname;
  // Local symbols: the library serves meshfuse's calls and does not interpose on others'.
  handle_ = dlopen(path_.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle_ == nullptr && path_ == soname && !fallback.empty() && fallback != soname) {
    path_ = fallback;
    handle_ = dlopen(path_.c_str(), RTLD_NOW | RTLD_LOCAL);
  }
  if (handle_ == nullptr)
    fail(ErrorCode::BackendUnavailable, "{}: cannot load {} ({}); {} or name the library in {}",
         what_, path_, dlerror(), hint, env);
}

void* SharedLibrary::symbol(const char* name, const char* requirement) const {
  void* fn = dlsym(handle_, name);
  if (fn == nullptr)
    fail(ErrorCode::BackendUnavailable, "{}: {} has no {} ({} is needed)", what_, path_, name,
         requirement);
  return fn;
}

}  // namespace meshfuse::detail
