// Rendezvous stores: a small key-value space shared by the ranks of a job, used to set up the
// transports (gloo's pair addresses, NCCL's unique id) and to name sub-teams. The model is c10d's
// Store: set a key once, get it (waiting until some rank has set it), wait for several keys.
//
// meshfuse has its own stores instead of Gloo's: they must also work in builds without Gloo (an
// nccl-only build), and Debian's Gloo (0.0~git20220518) has no TCP store.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace meshfuse {

class Store {
 public:
  using Bytes = std::vector<std::uint8_t>;

  virtual ~Store() = default;

  // Sets key to value (overwriting an earlier value).
  virtual void set(const std::string& key, const Bytes& value) = 0;
  // The value of key, waiting until it is set; Error(Timeout) naming the key after timeout().
  virtual Bytes get(const std::string& key) = 0;
  // True when every key is set; never blocks.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Waits until every key is set; Error(Timeout) naming the missing keys after `timeout`.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }

  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }

  // Strings as values (ids, addresses).
  void set(const std::string& key, const std::string& value) {
    set(key, Bytes(value.begin(), value.end()));
  }
  std::string get_string(const std::string& key) {
    Bytes b = get(key);
    return std::string(b.begin(), b.end());
  }

 protected:
  explicit Store(std::chrono::milliseconds timeout = std::chrono::minutes(5)) : timeout_(timeout) {}

 private:
  std::chrono::milliseconds timeout_;
};

// In-memory store for the threads of one process (the local backend; tests).
class HashStore : public Store {
 public:
  explicit HashStore(std::chrono::milliseconds timeout = std::chrono::minutes(5));
  ~HashStore() override;
  void set(const std::string& key, const Bytes& value) override;
  using Store::set;
  Bytes get(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  using Store::wait;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// One file per key under a directory every rank can reach (a shared filesystem across machines,
// or /tmp on one machine). Writes are atomic (write a temporary file, then rename). The directory
// is created if missing, readable by its owner only (its permissions are what keeps others out);
// one that exists must be too, and not a symbolic link (InvalidArgument otherwise). It is opened
// once, at construction: keys are read and written in that directory even if another is put at
// its path later. The files are left for the caller to remove. Give every job a fresh
// directory: keys left by an earlier job would be read as this one's.
class FileStore : public Store {
 public:
  explicit FileStore(std::string path, std::chrono::milliseconds timeout = std::chrono::minutes(5));
  ~FileStore() override;
  FileStore(const FileStore&) = delete;
  FileStore& operator=(const FileStore&) = delete;
  void set(const std::string& key, const Bytes& value) override;
  using Store::set;
  Bytes get(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  const std::string& path() const { return path_; }

 private:
  static std::string file_of(const std::string& key);  // the key's file name in the directory
  std::string path_;
  int dir_ = -1;  // the directory, opened and checked once
};

// A store served over TCP by one process (the server, usually world rank 0) at host:port; every
// process, the server included, talks to it as a client. The server keeps serving until it is
// destroyed; its destructor waits (up to timeout()) for the connected clients to hang up, so a
// fast rank 0 does not pull the store from under slower ranks.
//
// Only the job gets in: the server listens on `bind_address`, or when that is empty on `host`'s
// address (the one its clients reach: loopback for a job on one host; every interface when host
// is a name that resolves to loopback, as Debian's own host name does, since the job's other
// hosts reach it by that name), never on every interface otherwise unless told ("0.0.0.0").
// Both ends of every connection prove `secret` (1 to 4096 bytes, the same in every process of
// the job; meshfuse launch makes 128 random bits) and `job` (what sets the job apart from others
// that share the secret: bootstrap's job identity) without sending them: an HMAC-SHA256 of fresh
// nonces (tcp_store.cpp), the server first, so that a process listening on the port in the
// server's place learns nothing of it. A client does so within 10 s of connecting (or the
// timeout, if shorter), before any request; the others are dropped unanswered, and at most 64
// may be waiting to prove it at once (a 65th resets the longest waiting, which, if it was a rank,
// tries again until its timeout); at most 4096 connections are open at once (more are told the
// server is busy). The secret keeps out whoever can reach the port; the requests after the
// handshake are neither encrypted nor authenticated, so it does not keep out whoever can read or
// change the network, nor a relay between a client and the server. Anyone who can connect gets a
// proof of the secret from the server, so a guessable one can be found offline: use random bytes
// (meshfuse launch makes 128 bits). A job
// keeps at most 2^20 keys and 2 GiB; keys are at most 64 KiB and values 1 GiB; a client that
// breaks the protocol loses its connection, nobody else.
// Errors: CommunicationFailure when the address cannot be served or the server not reached
// (clients retry connecting until the timeout), the server cannot prove the secret, it refuses
// this end's proof, or the connection is lost;
// Timeout as Store and when the server does not answer a request within the timeout given at
// construction (the connection is then unusable); InvalidArgument for an empty or oversized
// secret, an oversized key or value, or a set into a full store.
class TcpStore : public Store {
 public:
  TcpStore(std::string host, int port, bool is_server, std::string secret,
           std::chrono::milliseconds timeout = std::chrono::minutes(5),
           std::string bind_address = {}, std::string job = {});
  ~TcpStore() override;
  void set(const std::string& key, const Bytes& value) override;
  using Store::set;
  Bytes get(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  // The port served (useful with port 0 on the server: the kernel picks a free one).
  int port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Puts every key of `store` under "prefix/": one store shared by several teams or backends.
class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> store);
  void set(const std::string& key, const Bytes& value) override;
  using Store::set;
  Bytes get(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  using Store::wait;
  const std::shared_ptr<Store>& base() const { return store_; }

 private:
  std::vector<std::string> prefixed(const std::vector<std::string>& keys) const;
  std::string prefix_;
  std::shared_ptr<Store> store_;
};

}  // namespace meshfuse
