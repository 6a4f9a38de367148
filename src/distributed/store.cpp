// Rendezvous stores: the Store interface, in memory (HashStore), files in a directory (FileStore)
// and key prefixes (PrefixStore). TcpStore is in tcp_store.cpp.
#include "meshfuse/distributed/store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <filesystem>
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
  // The parents as the umask says, the directory itself private from its creation: made 0755 and
  // then narrowed, another rank could find it open in between and refuse it.
  std::error_code ec;
  const std::filesystem::path parent = std::filesystem::path(path_).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  if (!ec && ::mkdir(path_.c_str(), 0700) != 0 && errno != EEXIST)
    ec = std::error_code(errno, std::generic_category());
  MESHFUSE_CHECK(!ec, ErrorCode::InvalidArgument, "FileStore: cannot create the directory '{}': {}",
                 path_, ec.message());
  // Opened once, and every key read and written relative to that descriptor: whoever controls a
  // directory above it cannot swap it for another after this check. It must be as private as one
  // made here: whoever else can write to it could plant the job's keys, whoever else can read it
  // could read them. Not a symbolic link, which its owner could point elsewhere.
  dir_ = ::open(path_.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  struct stat st {};
  const bool opened = dir_ >= 0 && ::fstat(dir_, &st) == 0;
  const std::string why = opened ? "" : std::strerror(errno);
  if (opened && st.st_uid == ::getuid() && (st.st_mode & (S_IRWXG | S_IRWXO)) == 0) return;
  if (dir_ >= 0) ::close(dir_);
  fail(ErrorCode::InvalidArgument,
       "FileStore: the directory '{}' must be a directory (not a symbolic link) of this user that "
       "nobody else can read or write, got {}",
       path_, opened ? fmt::format("mode {:o}, owner uid {}", st.st_mode & 07777, st.st_uid) : why);
}

FileStore::~FileStore() { ::close(dir_); }

namespace {
// Closes a descriptor when the scope ends, also by an exception (no memory for a value).
struct ClosedAtEnd {
  int fd;
  ~ClosedAtEnd() { ::close(fd); }
};
}  // namespace

// Keys may hold any byte: everything but [A-Za-z0-9._-] is written as %XX.
std::string FileStore::file_of(const std::string& key) {
  std::string name;
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '.' || c == '_' || c == '-')
      name += static_cast<char>(c);
    else
      name += fmt::format("%{:02X}", c);
  }
  return name;
}

void FileStore::set(const std::string& key, const Bytes& value) {
  // Write a private temporary file, then rename it: readers see the whole value or nothing.
  static std::atomic<std::uint64_t> counter{0};
  const std::string file = file_of(key);
  const std::string tmp =
      fmt::format(".tmp.{}.{}.{}", ::getpid(),
                  std::hash<std::thread::id>{}(std::this_thread::get_id()), counter++);
  const int fd =
      ::openat(dir_, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  MESHFUSE_CHECK(fd >= 0, ErrorCode::CommunicationFailure,
                 "FileStore: cannot create '{}/{}' for key '{}': {}", path_, tmp, key,
                 std::strerror(errno));
  std::size_t done = 0;
  int error = 0;
  while (done < value.size()) {
    const ssize_t n = ::write(fd, value.data() + done, value.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      error = errno;
      break;
    }
    done += static_cast<std::size_t>(n);
  }
  if (::close(fd) != 0 && error == 0) error = errno;  // nothing above throws
  if (error == 0 && ::renameat(dir_, tmp.c_str(), dir_, file.c_str()) == 0) return;
  if (error == 0) error = errno;
  ::unlinkat(dir_, tmp.c_str(), 0);
  fail(ErrorCode::CommunicationFailure, "FileStore: cannot write '{}/{}' for key '{}': {}", path_,
       file, key, std::strerror(error));
}

Store::Bytes FileStore::get(const std::string& key) {
  wait({key});
  const std::string file = file_of(key);
  const int fd = ::openat(dir_, file.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  MESHFUSE_CHECK(fd >= 0, ErrorCode::CommunicationFailure,
                 "FileStore: cannot read '{}/{}' for key '{}': {}", path_, file, key,
                 std::strerror(errno));
  const ClosedAtEnd closed{fd};
  Bytes value;
  for (;;) {
    std::uint8_t chunk[65536];
    const ssize_t n = ::read(fd, chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    MESHFUSE_CHECK(n >= 0, ErrorCode::CommunicationFailure,
                   "FileStore: cannot read '{}/{}' for key '{}': {}", path_, file, key,
                   std::strerror(errno));
    if (n == 0) return value;
    value.insert(value.end(), chunk, chunk + n);
  }
}

bool FileStore::check(const std::vector<std::string>& keys) {
  for (const std::string& k : keys) {
    const std::string file = file_of(k);
    struct stat st;
    if (::fstatat(dir_, file.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) continue;
    // Not there yet; anything else (no permission, a name too long) would never change.
    MESHFUSE_CHECK(errno == ENOENT, ErrorCode::CommunicationFailure,
                   "FileStore: cannot look up '{}/{}' for key '{}': {}", path_, file, k,
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
