// The TcpStore server's side of its protocol on arbitrary bytes: each input is sent on a fresh
// connection to a server on loopback, after the job's handshake (the secret proven) when the first
// byte is odd, then the connection is closed. The server must drop what it cannot serve without
// harm to the others: afterwards a genuine client still sets and gets, and a key that only the job
// wrote is unchanged unless the input proved the secret.
#include <fuzzer/FuzzedDataProvider.h>
#include <netinet/in.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "meshfuse/distributed/store.h"

namespace {

using namespace std::chrono_literals;
constexpr const char* kSecret = "fuzz secret";

struct Job {
  meshfuse::TcpStore server{"127.0.0.1", 0, true, kSecret, 5s};
  meshfuse::TcpStore client{"127.0.0.1", server.port(), false, kSecret, 5s};
  int inputs = 0;
};

// A fresh store every few thousand inputs: what proven inputs set stays within memory.
Job& job() {
  static std::unique_ptr<Job> j;
  if (!j || ++j->inputs > 4096) {
    j.reset();
    j = std::make_unique<Job>();
    j->client.set("guard", std::string("the job's"));
  }
  return *j;
}

// The client's side of the handshake (tcp_store.cpp's protocol comment): false if the server
// did not welcome it, which for the job's own secret is a finding.
bool prove_secret(int fd) {
  const std::uint32_t hello = 0x3253464d;
  const std::string nonce(32, 'n');
  std::string bytes(reinterpret_cast<const char*>(&hello), 4);
  bytes += nonce;
  ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  char challenge[65];
  std::size_t got = 0;
  for (ssize_t n; got < sizeof(challenge) &&
                  (n = ::recv(fd, challenge + got, sizeof(challenge) - got, 0)) > 0;)
    got += static_cast<std::size_t>(n);
  if (got != sizeof(challenge) || challenge[0] != 3) return false;
  // No job identity here: its length, 0, comes between the label and the nonces.
  const std::string message = std::string("meshfuse store client") + std::string(4, '\0') + nonce +
                              std::string(challenge + 1, 32);
  unsigned char mac[32];
  unsigned int len = 0;
  HMAC(EVP_sha256(), kSecret, static_cast<int>(std::strlen(kSecret)),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac, &len);
  ::send(fd, mac, len, MSG_NOSIGNAL);
  char welcome = 0;
  return ::recv(fd, &welcome, 1, 0) == 1 && welcome == 1;
}

void send_and_hang_up(int port, const std::string& bytes, bool proven) {
  // libFuzzer's SIGALRM (its -timeout check) would interrupt this thread's connect and recv:
  // a socket with SO_RCVTIMEO is not restarted after a handler, even under SA_RESTART, and the
  // EINTR looked like a stuck server once in ~19,000 inputs. Blocked here, the signal goes to
  // another thread; the 5 s below still catches a server that hangs.
  sigset_t alarm;
  sigemptyset(&alarm);
  sigaddset(&alarm, SIGALRM);
  sigset_t before;
  pthread_sigmask(SIG_BLOCK, &alarm, &before);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  // Thousands of connections a second can run this machine out of ephemeral ports for a moment;
  // a server that stays unreachable is a finding.
  for (int tries = 0; ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0; ++tries) {
    if (tries == 200) std::abort();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const timeval tv{5, 0};  // a server that neither answers nor hangs up within 5 s is stuck
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  if (proven && !prove_secret(fd)) {
    std::fprintf(stderr, "store_server: the job's handshake was not welcomed\n");
    std::abort();
  }
  ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  ::shutdown(fd, SHUT_WR);
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) {
  }
  if (n < 0 && errno != ECONNRESET) {  // a reset: it hung up on unread bytes
    std::fprintf(stderr, "store_server: the server neither answered nor hung up: %s\n",
                 std::strerror(errno));
    std::abort();
  }
  ::close(fd);
  pthread_sigmask(SIG_SETMASK, &before, nullptr);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const bool proven = in.ConsumeBool();
  const std::string bytes = in.ConsumeRemainingBytesAsString();
  Job& j = job();
  send_and_hang_up(j.server.port(), bytes, proven);
  j.client.set("alive", std::string("yes"));
  if (j.client.get_string("alive") != "yes") std::abort();
  if (!proven && j.client.get_string("guard") != "the job's") std::abort();
  if (proven) j.client.set("guard", std::string("the job's"));
  return 0;
}
