// A shared library opened at run time (dlopen) instead of linked (internal).
//
// A library linked into meshfuse is loaded with it, and a library loaded later that needs the same
// soname binds to that copy, whatever version it was built against: with NCCL linked, importing
// meshfuse before torch made torch's import fail on a symbol of its newer NCCL. Opened at first
// use, the soname resolves to the copy already in the process if there is one (PyTorch's, when
// torch was imported first); a copy meshfuse opens first is, in turn, the one later users get.
// Libraries stay open for the life of the process.
#pragma once

#include <string>

namespace meshfuse::detail {

class SharedLibrary {
 public:
  // Opens the file named by the environment variable `env` when it is set, else `soname` (found by
  // the loader), else `fallback` (the file found at build time). Throws Error(BackendUnavailable)
  // naming `what`, the file and the loader's message, with `hint` (what to install or set).
  SharedLibrary(std::string what, const char* env, const std::string& soname,
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

  std::string what_;
  std::string path_;  // as opened
  void* handle_ = nullptr;
};

}  // namespace meshfuse::detail
