// Running the `meshfuse` binary from a test, as a user runs it (shared by the CLI test files).
#pragma once

#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace meshfuse::cli::test {

namespace fs = std::filesystem;

struct CliResult {
  int exit_code = -1;
  std::string out, err;
};

inline std::string read_file(const fs::path& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

// A scratch directory removed at the end of the test.
class ScratchDir {
 public:
  ScratchDir()
      : path_(fs::temp_directory_path() /
              fmt::format("meshfuse_cli_test_{}_{}", getpid(), next_++)) {
    fs::create_directories(path_);
  }
  ~ScratchDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  static inline int next_ = 0;
  fs::path path_;
};

// `meshfuse ARGS` through the shell, with the environment assignments `env` ("NAME=value ...")
// in front; its exit code, stdout and stderr.
inline CliResult run_cli(const std::string& args, const std::string& env = "") {
  const ScratchDir dir;
  const fs::path out = dir.path() / "out", err = dir.path() / "err";
  const std::string command = fmt::format("{} '{}' {} >'{}' 2>'{}'", env, MESHFUSE_CLI_PATH, args,
                                          out.string(), err.string());
  const int status = std::system(command.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_file(out), read_file(err)};
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace meshfuse::cli::test
