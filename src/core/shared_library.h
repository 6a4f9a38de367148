// A shared library opened at run time (dlopen) instead of linked (internal).
//
// A process keeps one copy of a library per soname, the first it loads; a library linked into
// meshfuse would be loaded with it and become the copy that PyTorch (and any other user loaded
// later) binds to, whatever version that user was built against: importing meshfuse before torch
// then broke torch (NCCL: an unknown symbol; cuBLASLt: heap corruption). Opened at first use, the
// soname resolves to the copy already in the process if there is one.
#pragma once

#include <string>
#include <type_traits>

namespace meshfuse::detail {

class SharedLibrary {
 public:
  // Opens the file named by the environment variable `env` when it is set, else `soname` (found by
  // the loader), else `fallback` (the file found at build time). Throws Error(BackendUnavailable)
  // naming `what`, the file and the loader's message, with `hint` (what to install or set).
  SharedLibrary(const char* what, const char* env, const std::string& soname,
                const std::string& fallback, const char* hint);

  // fn = the symbol `name`; throws Error(BackendUnavailable) naming the file and the symbol, with
  // `requirement` (the version needed).
  template <typename F>
  void bind(F& fn, const char* name, const char* requirement) const {
    fn = reinterpret_cast<F>(symbol(name, requirement));
  }

  const std::string& path() const { return path_; }

 private:
  void* symbol(const char* name, const char* requirement) const;

  const char* what_;
  std::string path_;  // as opened
  void* handle_ = nullptr;
};

}  // namespace meshfuse::detail
