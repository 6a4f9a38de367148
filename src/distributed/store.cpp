// Rendezvous stores: the Store interface, in memory (HashStore), files in a directory (FileStore)
// and key prefixes (PrefixStore). TcpStore is in tcp_store.cpp.
#include "meshfuse/distributed/store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include "distributed/store_wait.h"
#include "meshfuse/core/error.h"

namespace meshfuse {

namespace detail {

namespace {

std::string key_list(const std::vector<std::string>& keys) {
  std::string s;
  for (const std::string& k : keys) s += (s.empty() ? "'" : ", '") + k + "'";
  return s;
}

}  // namespace

[[noreturn]] void fail_timeout(const char* store, const std::vector<std::string>& keys,
                               std::chrono::milliseconds timeout) {
  fail(ErrorCode::Timeout, "{}: keys {} not set after {} ms", store, key_list(keys),
       timeout.count());
}

}  // namespace detail

using detail::fail_timeout;
using detail::poll_until;

void Store::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  if (!poll_until([&] { return check(keys); }, timeout)) fail_timeout("store", keys, timeout);
}

// --- HashStore
// ------------------------------------------------------------------------------------

struct HashStore::State {
  std::mutex mutex;
  std::condition_variable changed;
  std::map<std::string, Bytes> values;

  bool has(const std::vector<std::string>& keys) const {
    for (const std::string& k : keys)
      if (!values.count(k)) return false;
    return true;
  }
};

HashStore::HashStore(std::chrono::milliseconds timeout)
    : Store(timeout), state_(std::make_unique<State>()) {}
HashStore::~HashStore() = default;

void HashStore::set(const std::string& key, const Bytes& value) {
  {
    std::lock_guard lock(state_->mutex);
    state_->values[key] = value;
  }
  state_->changed.notify_all();
}

Store::Bytes HashStore::get(const std::string& key) {
  wait({key});
  std::lock_guard lock(state_->mutex);
  return state_->values.at(key);
}

bool HashStore::check(const std::vector<std::string>& keys) {
  std::lock_guard lock(state_->mutex);
  return state_->has(keys);
}

void HashStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::unique_lock lock(state_->mutex);
  if (!state_->changed.wait_for(lock, timeout, [&] { return state_->has(keys); }))
    fail_timeout("HashStore", keys, timeout);
}

// --- FileStore
// ------------------------------------------------------------------------------------

FileStore::FileStore(std::string path, std::chrono::milliseconds timeout)
    : Store(timeout), path_(std::move(path)) {
  std::error_code ec;
  if (std::filesystem::create_directories(path_, ec))
    std::filesystem::permissions(path_, std::filesystem::perms::owner_all, ec);
  MESHFUSE_CHECK(!ec && std::filesystem::is_directory(path_), ErrorCode::InvalidArgument,
                 "FileStore: cannot create the directory '{}': {}", path_, ec.message());
  // One that existed already must be as private as one made here: whoever else can write to it
  // could plant the job's keys, whoever else can read it could read them. Not a symbolic link,
  // which its owner could point elsewhere after this check.
  struct stat st {};
  MESHFUSE_CHECK(::lstat(path_.c_str(), &st) == 0 && S_ISDIR(st.st_mode) &&
                     st.st_uid == ::getuid() && (st.st_mode & (S_IRWXG | S_IRWXO)) == 0,
                 ErrorCode::InvalidArgument,
                 "FileStore: the directory '{}' must be a directory (not a symbolic link) of this "
                 "user that nobody else can read or write, got mode {:o}",
                 path_, st.st_mode & 07777);
}

// Keys may hold any byte: everything but [A-Za-z0-9._-] is written as %XX.
std::string FileStore::file_of(const std::string& key) const {
  std::string name;
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '.' || c == '_' || c == '-')
      name += static_cast<char>(c);
    else
      name += fmt::format("%{:02X}", c);
  }
  return path_ + "/" + name;
}

void FileStore::set(const std::string& key, const Bytes& value) {
  // Write a private temporary file, then rename it: readers see the whole value or nothing.
  static std::atomic<std::uint64_t> counter{0};
  const std::string file = file_of(key);
  const std::string tmp =
      fmt::format("{}/.tmp.{}.{}.{}", path_, ::getpid(),
                  std::hash<std::thread::id>{}(std::this_thread::get_id()), counter++);
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(value.data()),
              static_cast<std::streamsize>(value.size()));
    MESHFUSE_CHECK(out.good(), ErrorCode::CommunicationFailure,
                   "FileStore: cannot write '{}' for key '{}'", tmp, key);
  }
  MESHFUSE_CHECK(std::rename(tmp.c_str(), file.c_str()) == 0, ErrorCode::CommunicationFailure,
                 "FileStore: cannot rename '{}' to '{}': {}", tmp, file, std::strerror(errno));
}

Store::Bytes FileStore::get(const std::string& key) {
  wait({key});
  std::ifstream in(file_of(key), std::ios::binary);
  MESHFUSE_CHECK(in.is_open(), ErrorCode::CommunicationFailure,
                 "FileStore: cannot read '{}' for key '{}': {}", file_of(key), key,
                 std::strerror(errno));
  Bytes value{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  MESHFUSE_CHECK(!in.bad(), ErrorCode::CommunicationFailure,
                 "FileStore: cannot read '{}' for key '{}'", file_of(key), key);
  return value;
}

bool FileStore::check(const std::vector<std::string>& keys) {
  for (const std::string& k : keys) {
    struct stat st;
    if (::stat(file_of(k).c_str(), &st) == 0) continue;
    // Not there yet; anything else (no permission, a name too long) would never change.
    MESHFUSE_CHECK(errno == ENOENT, ErrorCode::CommunicationFailure,
                   "FileStore: cannot look up '{}' for key '{}': {}", file_of(k), k,
                   std::strerror(errno));
    return false;
  }
  return true;
}

// --- PrefixStore
// ----------------------------------------------------------------------------------

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> store)
    : Store(store->timeout()), prefix_(std::move(prefix) + "/"), store_(std::move(store)) {}

void PrefixStore::set(const std::string& key, const Bytes& value) {
  store_->set(prefix_ + key, value);
}
Store::Bytes PrefixStore::get(const std::string& key) { return store_->get(prefix_ + key); }
bool PrefixStore::check(const std::vector<std::string>& keys) {
  return store_->check(prefixed(keys));
}
void PrefixStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  store_->wait(prefixed(keys), timeout);
}

std::vector<std::string> PrefixStore::prefixed(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  for (const std::string& k : keys) out.push_back(prefix_ + k);
  return out;
}

}  // namespace meshfuse
