// TcpStore: a small TCP key-value server (on the rendezvous rank) and its clients.
//
// Protocol: each end proves it holds the job's secret K without sending it (HMAC-SHA256 over both
// ends' fresh nonces, a label per direction so that neither proof can be replayed as the other,
// and the job's identity J, so that a process of another job that shares the secret is refused):
//   client: [u32 kHello][Nc: 32 random bytes]
//   server: [u8 3][Ns: 32 random bytes][HMAC(K, "meshfuse store server" [u32 |J|] J Nc Ns)]
//   client: [HMAC(K, "meshfuse store client" [u32 |J|] J Nc Ns)], once it has checked the server's
//   server: [u8 1] when the client's proof holds, and otherwise hangs up without a word.
// [u8 2] instead of the challenge says the server is busy (the client tries again). Whoever
// listens on the port (a process that took it first) learns nothing of the secret that it could
// not guess offline, and a client stops at a server that does not prove it. Nothing binds the
// requests to the handshake: a relay between a client and the real server could pass the proofs
// on and then read and change the requests. Then a request is [u8 command][u32 key length][key] and
// for SET [u64 value length][value]. SET replies [u8 1], or [u8 0] when the store is full; GET
// replies [u8 found] and, when found, [u64 length][value]. Clients poll GET until the key is set,
// so the server never blocks on a missing key. Keys are at most kMaxKeyLength bytes and values
// kMaxLength: the server hangs up on a client that announces more, and reads a value as it arrives
// rather than allocating it first.
//
// Who gets in: the server listens on one address (the one its clients are given, unless told
// otherwise), drops a connection that has not proven the secret within kHelloTimeout (a deadline
// for the whole hello, however slowly it trickles in), keeps at most kMaxUnproven connections
// that have not proven it yet (a new one resets the oldest) and kMaxConnections in all, and
// closes and reaps each connection as it ends. The secret keeps out whoever can reach the port;
// what follows the handshake is neither encrypted nor authenticated: on a network others can read
// or change, give the job a private one.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>

#include "distributed/store_wait.h"
#include "meshfuse/core/error.h"
#include "meshfuse/distributed/store.h"

namespace meshfuse {

using detail::fail_timeout;
using detail::poll_until;

namespace {

using Clock = std::chrono::steady_clock;

enum : std::uint8_t { kSet = 1, kGet = 2 };
// The server's answers in the handshake (none: refused).
enum : std::uint8_t { kWelcome = 1, kBusy = 2, kChallenge = 3 };
constexpr std::uint32_t kHello = 0x3253464d;   // "MFS2"
constexpr std::size_t kNonce = 32, kMac = 32;  // bytes; kMac: SHA-256's
using Nonce = std::array<unsigned char, kNonce>;
using Mac = std::array<unsigned char, kMac>;
constexpr std::uint64_t kMaxLength = std::uint64_t{1} << 30;
constexpr std::uint32_t kMaxKeyLength = 1 << 16;
constexpr std::size_t kReadStep = std::size_t{1} << 20;  // a value grows by this as it arrives
// What one job may keep in its store: far above what rendezvous needs (a few keys a rank).
constexpr std::size_t kMaxKeys = std::size_t{1} << 20;
constexpr std::uint64_t kMaxStoredBytes = std::uint64_t{2} << 30;
constexpr int kMaxConnections = 4096;
constexpr int kMaxUnproven = 64;
constexpr std::chrono::seconds kHelloTimeout{10};

void set_io_timeout(int fd, std::chrono::microseconds t) {
  const std::int64_t us = std::max<std::int64_t>(t.count(), 1);  // a zero timeval means never
  const timeval tv{static_cast<time_t>(us / 1000000), static_cast<suseconds_t>(us % 1000000)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

// Reads n bytes by `deadline` (for the whole read, not per recv); false on timeout or hang-up.
bool read_by(int fd, void* data, std::size_t n, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    // Rounded up: it is 0 only once the deadline has passed, which the caller may ask after.
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd ready{fd, POLLIN, 0};
    const int r = ::poll(&ready, 1, static_cast<int>(left));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    const ssize_t got = ::recv(fd, p, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    n -= static_cast<std::size_t>(got);
  }
  return true;
}

// Whether `name` says loopback itself, as opposed to a host name that resolves to it: any IPv4
// form of 127/8 that getaddrinfo reads ("127.1", "2130706433"), localhost in any case, ::1.
bool names_loopback(std::string name) {
  if (in_addr a{}; ::inet_aton(name.c_str(), &a)) return (ntohl(a.s_addr) >> 24) == 127;
  std::transform(name.begin(), name.end(), name.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return name == "localhost" || name == "::1";
}

// From the kernel's generator: OpenSSL's RAND keeps a generator per thread, state that each of
// the server's connection threads would make for one nonce.
Nonce fresh_nonce() {
  Nonce n{};
  ssize_t got;
  do got = ::getrandom(n.data(), n.size(), 0);
  while (got < 0 && errno == EINTR);
  MESHFUSE_CHECK(got == static_cast<ssize_t>(n.size()), ErrorCode::Internal,
                 "TcpStore: no random bytes for a nonce (getrandom: {})", std::strerror(errno));
  return n;
}

// One end's proof that it holds `secret` in job `job`: HMAC-SHA256(secret, label || u32 |job| ||
// job || client || server).
Mac proof(const std::string& secret, const std::string& job, std::string_view label,
          const Nonce& client, const Nonce& server) {
  std::string message(label);
  const auto job_len = static_cast<std::uint32_t>(job.size());
  message.append(reinterpret_cast<const char*>(&job_len), sizeof(job_len));
  message += job;
  message.append(reinterpret_cast<const char*>(client.data()), client.size());
  message.append(reinterpret_cast<const char*>(server.data()), server.size());
  Mac mac{};
  unsigned int len = 0;
  MESHFUSE_CHECK(HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
                      reinterpret_cast<const unsigned char*>(message.data()), message.size(),
                      mac.data(), &len) != nullptr &&
                     len == mac.size(),
                 ErrorCode::Internal, "TcpStore: HMAC-SHA256 failed (OpenSSL)");
  return mac;
}
constexpr std::string_view kServerProves = "meshfuse store server";
constexpr std::string_view kClientProves = "meshfuse store client";

// In constant time, so that timing does not reveal a matching prefix.
bool same_mac(const Mac& a, const Mac& b) { return CRYPTO_memcmp(a.data(), b.data(), kMac) == 0; }

bool write_all(int fd, const void* data, std::size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* data, std::size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) errno = ECONNRESET;  // the peer hung up (errno says why a read failed)
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

template <typename T>
bool read_value(int fd, T& v) {
  return read_all(fd, &v, sizeof(T));
}

}  // namespace

struct TcpStore::Impl {
  std::string host;
  int port = 0;
  std::chrono::milliseconds timeout;
  std::string secret;
  std::string bind_address;
  std::string job;  // proven with the secret
  int client = -1;
  std::mutex client_mutex;

  // Server side (is_server only).
  int listener = -1;
  std::thread acceptor;
  std::mutex mutex;
  std::condition_variable changed;
  std::map<std::string, Bytes> values;
  std::uint64_t stored_bytes = 0;
  // Connections being served, each by its thread; a thread that ends closes its socket and
  // leaves its id in `finished`, to be joined by the acceptor (or by stop_server). `finished` is
  // reserved for every thread that can end between two reapings (the acceptor reaps before it
  // admits one more) and keeps its capacity: an ending thread allocates nothing.
  std::map<int, std::thread> handlers;  // by socket
  std::vector<std::thread> finished;
  std::deque<int> unproven;  // sockets still to prove the secret, oldest first
  int open_connections = 0;  // the proven ones, which the server waits for before it stops
  bool stopping = false;

  void serve_connection(int fd) {
    // Out of memory for one client's hello or request: that client loses its connection, nobody
    // else.
    bool proven = false;
    try {
      proven = proves_secret(fd);
    } catch (const std::exception&) {
    }
    // The HMAC left this thread's OpenSSL state (its error queue): freed now, since OpenSSL's own
    // clean-up at a thread's end no longer runs once its clean-up at exit has (a store destroyed
    // at exit ends its threads then).
    OPENSSL_thread_stop();
    {
      std::lock_guard lock(mutex);
      const auto it = std::find(unproven.begin(), unproven.end(), fd);
      if (it != unproven.end())
        unproven.erase(it);
      else
        proven = false;  // evicted meanwhile (see the acceptor): its socket is being reset
      open_connections += proven;
    }
    const std::uint8_t welcome = kWelcome;
    try {
      if (proven && write_all(fd, &welcome, 1)) serve_requests(fd);
    } catch (const std::exception&) {
    }
    std::lock_guard lock(mutex);
    open_connections -= proven;
    // Closed under the lock, so that stop_server never shuts down a number reused since.
    ::close(fd);
    auto it = handlers.find(fd);
    finished.push_back(std::move(it->second));
    handlers.erase(it);
    changed.notify_all();
  }

  // True when the client proved the secret within kHelloTimeout, or the store's timeout when
  // that is shorter (the welcome is then written by serve_connection).
  bool proves_secret(int fd) {
    const auto deadline = Clock::now() + std::min<std::chrono::milliseconds>(timeout, kHelloTimeout);
    std::uint32_t magic = 0;
    Nonce theirs{};
    if (!read_by(fd, &magic, 4, deadline) || magic != kHello ||
        !read_by(fd, theirs.data(), theirs.size(), deadline))
      return false;
    const Nonce mine = fresh_nonce();
    std::array<unsigned char, 1 + kNonce + kMac> challenge{kChallenge};
    std::copy(mine.begin(), mine.end(), challenge.begin() + 1);
    const Mac ours = proof(secret, job, kServerProves, theirs, mine);
    std::copy(ours.begin(), ours.end(), challenge.begin() + 1 + kNonce);
    Mac given{};
    // A socket buffer takes the 65 bytes at once: the send does not wait on a stranger.
    return write_all(fd, challenge.data(), challenge.size()) &&
           read_by(fd, given.data(), given.size(), deadline) &&
           same_mac(given, proof(secret, job, kClientProves, theirs, mine));
  }

  // Returns when the client hangs up or breaks the protocol.
  void serve_requests(int fd) {
    for (;;) {
      std::uint8_t command = 0;
      std::uint32_t key_len = 0;
      if (!read_value(fd, command) || !read_value(fd, key_len) || key_len > kMaxKeyLength) return;
      std::string key(key_len, '\0');
      if (!read_all(fd, key.data(), key_len)) return;
      if (command == kSet) {
        std::uint64_t len = 0;
        if (!read_value(fd, len) || len > kMaxLength) return;
        Bytes value;
        while (value.size() < len) {
          const std::size_t at = value.size();
          value.resize(at + std::min<std::uint64_t>(kReadStep, len - at));
          if (!read_all(fd, value.data() + at, value.size() - at)) return;
        }
        std::uint8_t ok = 1;
        {
          std::lock_guard lock(mutex);
          auto it = values.find(key);
          const std::uint64_t before = it == values.end() ? 0 : key.size() + it->second.size();
          const std::uint64_t after = stored_bytes - before + key.size() + len;
          if (after > kMaxStoredBytes || (it == values.end() && values.size() >= kMaxKeys)) {
            ok = 0;
          } else {
            stored_bytes = after;
            values[key] = std::move(value);
          }
        }
        if (!write_all(fd, &ok, 1)) return;
      } else if (command == kGet) {
        Bytes value;
        std::uint8_t found = 0;
        {
          std::lock_guard lock(mutex);
          auto it = values.find(key);
          if (it != values.end()) {
            found = 1;
            value = it->second;
          }
        }
        // One write: with separate ones, Nagle's algorithm holds the second until the client's
        // delayed ACK of the first (40 ms a get).
        const std::uint64_t len = value.size();
        Bytes reply(1 + (found ? 8 + len : 0));
        reply[0] = found;
        if (found) {
          std::memcpy(reply.data() + 1, &len, 8);
          if (len > 0) std::memcpy(reply.data() + 9, value.data(), len);  // an empty one has no data
        }
        if (!write_all(fd, reply.data(), reply.size())) return;
      } else {
        return;  // not a client of ours
      }
    }
  }

  void accept_loop() {
    for (;;) {
      const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        const int error = errno;
        {
          std::lock_guard lock(mutex);
          if (stopping) return;
        }
        if (error == EINTR || error == ECONNABORTED) continue;
        // Out of descriptors or memory, or an error of one connection (Linux passes on network
        // errors of a pending connection): keep serving. Ending here would leave the listener
        // taking connections that nobody answers.
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      std::lock_guard lock(mutex);
      if (stopping) {  // stop_server joins what `finished` holds
        ::close(fd);
        return;
      }
      reap_finished();
      // Too many still to prove the secret: the oldest of them makes room. Idle connections of
      // a stranger then cannot lock the job's ranks out (they were told busy until their
      // deadline); a rank cut off in its hello is reset, which it takes as busy and tries again.
      if (static_cast<int>(unproven.size()) >= kMaxUnproven) {
        const int oldest = unproven.front();
        unproven.pop_front();
        const linger reset{1, 0};  // its handler's close sends a reset
        ::setsockopt(oldest, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
        ::shutdown(oldest, SHUT_RD);  // wakes the handler's read of the hello
      }
      if (static_cast<int>(handlers.size()) >= kMaxConnections) {
        const std::uint8_t busy = kBusy;
        ::send(fd, &busy, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        ::close(fd);
      } else {
        const int one = 1;  // replies go out at once
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        // The lists first, the thread last: once started, the thread owns (and closes) the
        // socket, so nothing after it may fail. Without memory or a thread to be had, this one is
        // turned away.
        try {
          unproven.push_back(fd);
          try {
            const auto it = handlers.emplace(fd, std::thread()).first;
            try {
              it->second = std::thread([this, fd] { serve_connection(fd); });
            } catch (...) {
              handlers.erase(it);
              throw;
            }
          } catch (...) {
            unproven.pop_back();
            throw;
          }
        } catch (const std::exception&) {
          ::close(fd);
        }
      }
    }
  }

  // Joins the handlers that have ended (under `mutex`: each released it when it listed itself,
  // and has only its exit left).
  void reap_finished() {
    for (std::thread& t : finished) t.join();
    finished.clear();
  }

  // Listens on bind_address (or host): the one interface the job's clients use. A host name that
  // resolves to loopback (Debian maps the machine's own name to 127.0.1.1) is still how the
  // job's other hosts reach it, over the network: then every interface.
  void start_server() {
    const std::string& where = bind_address.empty() ? host : bind_address;
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(where.c_str(), nullptr, &hints, &found);
    MESHFUSE_CHECK(rc == 0 && found, ErrorCode::CommunicationFailure,
                   "TcpStore: cannot serve on '{}': {} (an IPv4 address or host name)", where,
                   rc ? ::gai_strerror(rc) : "no address");
    sockaddr_in addr = *reinterpret_cast<const sockaddr_in*>(found->ai_addr);
    ::freeaddrinfo(found);
    if (bind_address.empty() && (ntohl(addr.sin_addr.s_addr) >> 24) == 127 && !names_loopback(host))
      addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<std::uint16_t>(port));
    listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    MESHFUSE_CHECK(listener >= 0, ErrorCode::CommunicationFailure, "TcpStore: socket: {}",
                   std::strerror(errno));
    const int one = 1;
    ::setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(listener, 1024) != 0) {
      const std::string why = std::strerror(errno);
      ::close(listener);
      char ip[INET_ADDRSTRLEN] = "?";
      ::inet_ntop(AF_INET, &addr.sin_addr, ip, sizeof(ip));
      fail(ErrorCode::CommunicationFailure,
           "TcpStore: cannot serve on {}:{} ('{}'): {}; the address must be one of this "
           "machine's (MESHFUSE_STORE_BIND=0.0.0.0 serves on every interface)",
           ip, port, where, why);
    }
    socklen_t len = sizeof(addr);
    ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
    port = ntohs(addr.sin_port);
    finished.reserve(kMaxConnections + 1);
    acceptor = std::thread([this] { accept_loop(); });
  }

  // wait_for_clients: let the other ranks finish with the store before it goes away.
  void stop_server(bool wait_for_clients) {
    {
      std::unique_lock lock(mutex);
      if (wait_for_clients)
        changed.wait_for(lock, timeout, [&] { return open_connections == 0; });
      stopping = true;
      for (auto& [fd, thread] : handlers) ::shutdown(fd, SHUT_RDWR);
    }
    ::shutdown(listener, SHUT_RDWR);
    acceptor.join();
    // The handlers end once their sockets are shut down; each moves itself to `finished`.
    std::unique_lock lock(mutex);
    changed.wait(lock, [&] { return handlers.empty(); });
    reap_finished();
    lock.unlock();
    ::close(listener);
  }

  // A connected socket, or -1 with `why` set, by `deadline`: a blocking connect would wait out
  // the kernel's SYN retries (about two minutes) past it where the server's backlog is full or
  // its packets are dropped.
  int connect_once(std::string& why, Clock::time_point deadline) const {
    // IPv4 only, as the server listens: with AF_UNSPEC, a name with an IPv6 address (localhost's
    // ::1) was tried there first, where another user's process could listen and take the secret.
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
    if (rc != 0) {
      why = ::gai_strerror(rc);
      return -1;
    }
    int connected = -1;
    for (addrinfo* a = found; a && connected < 0; a = a->ai_next) {
      const int fd =
          ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
      if (fd < 0) continue;
      int error = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
      if (error == EINPROGRESS) {
        pollfd p{fd, POLLOUT, 0};
        const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
        const int ready =
            ::poll(&p, 1, static_cast<int>(std::clamp<std::int64_t>(left.count(), 0, INT_MAX)));
        socklen_t len = sizeof(error);
        if (ready < 0)
          error = errno;
        else if (ready == 0)
          error = ETIMEDOUT;
        else if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) != 0)
          error = errno;
      }
      // Blocking again: the handshake and requests read and write with their own timeouts.
      if (error == 0 && ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0)
        error = errno;
      if (error == 0) {
        connected = fd;
      } else {
        why = std::strerror(error);
        ::close(fd);
      }
    }
    ::freeaddrinfo(found);
    return connected;
  }

  // Connects and proves the secret, retrying until the deadline while the server is not up yet
  // (it may start after its clients) or is busy.
  void connect_client() {
    const auto deadline = Clock::now() + timeout;
    std::string why;
    auto sleep = std::chrono::milliseconds(5);
    for (;; std::this_thread::sleep_for(sleep), sleep = std::min(sleep * 2, std::chrono::milliseconds(200))) {
      MESHFUSE_CHECK(Clock::now() < deadline, ErrorCode::CommunicationFailure,
                     "TcpStore: cannot reach {}:{} within {} ms: {} (rank 0 serves on "
                     "MASTER_ADDR's interface; MESHFUSE_STORE_BIND=0.0.0.0 serves on every one)",
                     host, port, timeout.count(), why);
      client = connect_once(why, deadline);
      if (client < 0) continue;
      const int one = 1;
      ::setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      // A server that stops answering a request: reads and writes give up after the timeout.
      set_io_timeout(client, std::chrono::duration_cast<std::chrono::microseconds>(timeout));
      const Handshake h = handshake(deadline);
      if (h == Handshake::Welcome) return;
      ::close(client);
      client = -1;
      if (h == Handshake::Busy) {
        why = "the server is busy";
        continue;
      }
      if (h == Handshake::Silent) no_answer();
      fail(ErrorCode::CommunicationFailure,
           "TcpStore: the server at {}:{} did not prove this job's secret (MESHFUSE_STORE_SECRET "
           "differs from the server's, the server is another job's with the same secret (the "
           "launchers' job identities differ), or another process listens on this port); "
           "nothing of the secret was sent to it",
           host, port);
    }
  }

  enum class Handshake { Welcome, Busy, Silent, Impostor };

  // The client's side of the protocol (the top of this file), every answer read by `deadline`.
  // Busy also covers a reset or hang-up (a busy server closes on the hello unread, evicts the
  // oldest connection still to prove itself, or drops a proof that came after its own deadline):
  // tried again. Anything but the server's proof before the welcome is an impostor's.
  Handshake handshake(Clock::time_point deadline) {
    const auto failed_read = [&] {
      return Clock::now() >= deadline ? Handshake::Silent : Handshake::Busy;
    };
    const Nonce mine = fresh_nonce();
    if (!write_all(client, &kHello, 4) || !write_all(client, mine.data(), mine.size()))
      return Handshake::Busy;
    std::uint8_t answer = 0;
    if (!read_by(client, &answer, 1, deadline)) return failed_read();
    if (answer == kBusy) return Handshake::Busy;
    if (answer != kChallenge) return Handshake::Impostor;
    Nonce theirs{};
    Mac server_proof{};
    if (!read_by(client, theirs.data(), theirs.size(), deadline) ||
        !read_by(client, server_proof.data(), server_proof.size(), deadline))
      return failed_read();
    if (!same_mac(server_proof, proof(secret, job, kServerProves, mine, theirs)))
      return Handshake::Impostor;
    const Mac ours = proof(secret, job, kClientProves, mine, theirs);
    if (!write_all(client, ours.data(), ours.size())) return Handshake::Busy;
    if (!read_by(client, &answer, 1, deadline)) return failed_read();
    return answer == kWelcome ? Handshake::Welcome : Handshake::Impostor;
  }

  // A request failed (errno says why): the connection is out of step, so later requests fail too.
  [[noreturn]] void lost() {
    const bool timed_out = errno == EAGAIN || errno == EWOULDBLOCK;
    if (client >= 0) ::shutdown(client, SHUT_RDWR);
    if (timed_out) no_answer();
    fail(ErrorCode::CommunicationFailure, "TcpStore: lost the connection to {}:{}", host, port);
  }

  [[noreturn]] void no_answer() const {
    fail(ErrorCode::Timeout, "TcpStore: no answer from {}:{} within {} ms", host, port,
         timeout.count());
  }

  static void check_length(const char* what, std::uint64_t n, std::uint64_t most) {
    MESHFUSE_CHECK(n <= most, ErrorCode::InvalidArgument,
                   "TcpStore: {} of {} bytes; the most is {}", what, n, most);
  }

  std::optional<Bytes> request_get(const std::string& key) {
    check_length("key", key.size(), kMaxKeyLength);
    std::lock_guard lock(client_mutex);
    const std::uint8_t command = kGet;
    const auto key_len = static_cast<std::uint32_t>(key.size());
    if (!write_all(client, &command, 1) || !write_all(client, &key_len, 4) ||
        !write_all(client, key.data(), key.size()))
      lost();
    std::uint8_t found = 0;
    if (!read_value(client, found)) lost();
    if (!found) return std::nullopt;
    std::uint64_t len = 0;
    if (!read_value(client, len)) lost();
    if (len > kMaxLength) {
      errno = EPROTO;
      lost();
    }
    // Read as it arrives, not allocated from the length alone.
    Bytes value;
    while (value.size() < len) {
      const std::size_t at = value.size();
      value.resize(std::min<std::uint64_t>(len, at + kReadStep));
      if (!read_all(client, value.data() + at, value.size() - at)) lost();
    }
    return value;
  }
};

TcpStore::TcpStore(std::string host, int port, bool is_server, std::string secret,
                   std::chrono::milliseconds timeout, std::string bind_address, std::string job)
    : Store(timeout), impl_(std::make_unique<Impl>()) {
  MESHFUSE_CHECK(!secret.empty() && secret.size() <= 4096, ErrorCode::InvalidArgument,
                 "TcpStore: secret: expected 1 to 4096 bytes shared by the job's processes, got "
                 "{} bytes",
                 secret.size());
  impl_->host = std::move(host);
  impl_->port = port;
  impl_->timeout = timeout;
  impl_->secret = std::move(secret);
  impl_->bind_address = std::move(bind_address);
  impl_->job = std::move(job);
  if (is_server) impl_->start_server();
  try {
    impl_->connect_client();
  } catch (...) {
    if (impl_->listener >= 0) impl_->stop_server(false);
    throw;
  }
}

TcpStore::~TcpStore() {
  // Shut down, not only closed: a child forked since (os.fork, MPI's orted) holds a copy of the
  // socket, which would keep the connection open and the server below waiting for it. The sockets
  // are made close-on-exec for the same reason.
  ::shutdown(impl_->client, SHUT_RDWR);
  ::close(impl_->client);
  // Gone while an error unwinds, the server does not wait for the others to finish with it: they
  // are failing too, and this rank's exit is how the launcher learns of the failure.
  if (impl_->listener >= 0) impl_->stop_server(std::uncaught_exceptions() == 0);
}

int TcpStore::port() const { return impl_->port; }

void TcpStore::set(const std::string& key, const Bytes& value) {
  Impl::check_length("key", key.size(), kMaxKeyLength);
  Impl::check_length("value", value.size(), kMaxLength);
  std::lock_guard lock(impl_->client_mutex);
  const std::uint8_t command = kSet;
  const auto key_len = static_cast<std::uint32_t>(key.size());
  const std::uint64_t len = value.size();
  std::uint8_t ok = 0;
  if (!write_all(impl_->client, &command, 1) || !write_all(impl_->client, &key_len, 4) ||
      !write_all(impl_->client, key.data(), key.size()) || !write_all(impl_->client, &len, 8) ||
      !write_all(impl_->client, value.data(), len) || !read_value(impl_->client, ok))
    impl_->lost();
  MESHFUSE_CHECK(ok == 1, ErrorCode::InvalidArgument,
                 "TcpStore: cannot set '{}': the store is full (at most {} keys and {} bytes in "
                 "all)",
                 key, kMaxKeys, kMaxStoredBytes);
}

Store::Bytes TcpStore::get(const std::string& key) {
  std::optional<Bytes> value;
  if (!poll_until([&] { return (value = impl_->request_get(key)).has_value(); }, timeout()))
    fail_timeout("TcpStore", {key}, timeout());
  return *value;
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  for (const std::string& k : keys)
    if (!impl_->request_get(k)) return false;
  return true;
}

}  // namespace meshfuse
