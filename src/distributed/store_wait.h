// What the stores share (internal): waiting for keys, and the error when they do not come.
#pragma once

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace meshfuse::detail {

// Throws Error(Timeout) naming the store, the keys and the timeout.
[[noreturn]] void fail_timeout(const char* store, const std::vector<std::string>& keys,
                               std::chrono::milliseconds timeout);

// Polls check() with a growing sleep (1 ms .. 50 ms): rendezvous waits are short and rare.
template <typename Check>
bool poll_until(Check&& check, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto sleep = std::chrono::milliseconds(1);
  while (!check()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::chrono::milliseconds(50));
  }
  return true;
}

}  // namespace meshfuse::detail
