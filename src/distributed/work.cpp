// Works: the state behind a Communicator's Work (its wait, and the errors that break the
// communicator), and the backends' finished works and worker queue that makes blocking
// transfers asynchronous.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <iterator>
#include <mutex>
#include <thread>

#include "distributed/comm_impl.h"
#include "distributed/comm_state.h"
#include "meshfuse/core/error.h"

namespace meshfuse::detail {

namespace {

class CompletedWork : public WorkImpl {
 public:
  bool test() override { return true; }
  void wait(Deadline) override {}
};

class JoinedWork : public WorkImpl {
 public:
  explicit JoinedWork(std::vector<std::shared_ptr<WorkImpl>> parts) : parts_(std::move(parts)) {}
  bool test() override {
    for (const auto& p : parts_)
      if (!p->test()) return false;
    return true;
  }
  void wait(Deadline deadline) override {
    for (const auto& p : parts_) p->wait(deadline);
  }

 private:
  std::vector<std::shared_ptr<WorkImpl>> parts_;
};

// The works whose last handle went while their transfer was in flight with buffers given to
// Work::keep_alive, held (with the backend's state of the operation) until the transfer ends. Never
// destroyed: a transfer may outlast the static destructors.
struct Graveyard {
  std::mutex mutex;
  std::vector<std::pair<std::shared_ptr<WorkImpl>, std::vector<Tensor>>> kept;
  std::atomic<bool> any{false};
};

Graveyard& graveyard() {
  static auto* g = new Graveyard;
  return *g;
}

// Whether the backend may still use an operation's buffers (Work::in_flight).
bool transfer_in_flight(WorkImpl& impl) {
  try {
    return !impl.test();
  } catch (const std::exception&) {  // a backend that cannot tell: still in flight, to be safe
    return true;
  }
}

}  // namespace

void free_finished_buffers() noexcept {
  Graveyard& g = graveyard();
  if (!g.any.load(std::memory_order_acquire)) return;
  try {
    std::vector<std::pair<std::shared_ptr<WorkImpl>, std::vector<Tensor>>> ended;  // freed unlocked
    std::lock_guard lock(g.mutex);
    const auto still = std::partition(g.kept.begin(), g.kept.end(),
                                      [](const auto& k) { return transfer_in_flight(*k.first); });
    ended.reserve(static_cast<std::size_t>(g.kept.end() - still));
    std::move(still, g.kept.end(), std::back_inserter(ended));
    g.kept.erase(still, g.kept.end());
    g.any.store(!g.kept.empty(), std::memory_order_release);
  } catch (const std::exception&) {  // no memory for the list: a later sweep frees them
  }
}

WorkState::~WorkState() {
  if (kept.empty() || !impl || !transfer_in_flight(*impl)) return;
  Graveyard& g = graveyard();
  try {
    std::lock_guard lock(g.mutex);
    g.kept.emplace_back(impl, std::move(kept));
    g.any.store(true, std::memory_order_release);
  } catch (const std::exception&) {  // no memory to keep them: freed here, as without keep_alive
  }
}

std::shared_ptr<WorkImpl> completed_work() { return std::make_shared<CompletedWork>(); }

std::shared_ptr<WorkImpl> joined_work(std::vector<std::shared_ptr<WorkImpl>> parts) {
  return std::make_shared<JoinedWork>(std::move(parts));
}

std::shared_ptr<WorkImpl> CommImpl::send_recv(const TensorView& send_tensor, int dst,
                                              const TensorView& recv_tensor, int src, int tag,
                                              const Stream& stream) {
  std::shared_ptr<WorkImpl> sent = send(send_tensor, dst, tag, stream);
  return joined_work({std::move(sent), recv(recv_tensor, src, tag, stream)});
}

bool TaskWork::test() {
  std::lock_guard lock(mutex_);
  return done_;
}

void TaskWork::wait(Deadline deadline) {
  std::unique_lock lock(mutex_);
  if (!finished_.wait_until(lock, deadline, [&] { return done_; }))
    fail(ErrorCode::Timeout, "the operation has not finished");
  if (error_) std::rethrow_exception(error_);
}

void TaskWork::finish(std::exception_ptr error) {
  {
    std::lock_guard lock(mutex_);
    done_ = true;
    error_ = std::move(error);
  }
  finished_.notify_all();
}

struct WorkerQueue::State {
  std::string name;
  std::mutex mutex;
  std::condition_variable wake;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<TaskWork>>> tasks;
  bool stop = false;
  std::thread worker;

  void run() {
    for (;;) {
      std::unique_lock lock(mutex);
      wake.wait(lock, [&] { return stop || !tasks.empty(); });
      if (tasks.empty()) return;  // stopping, and everything queued has run
      auto [task, work] = std::move(tasks.front());
      tasks.pop_front();
      lock.unlock();
      std::exception_ptr error;
      try {
        task();
      } catch (const Error&) {
        error = std::current_exception();
      } catch (const std::exception& e) {
        error = std::make_exception_ptr(Error(ErrorCode::CommunicationFailure, e.what()));
      }
      work->finish(std::move(error));
    }
  }
};

WorkerQueue::WorkerQueue(std::string name) : state_(std::make_shared<State>()) {
  state_->name = std::move(name);
  state_->worker = std::thread([s = state_.get()] { s->run(); });
}

WorkerQueue::~WorkerQueue() { stop(); }

void WorkerQueue::stop() {
  {
    std::lock_guard lock(state_->mutex);
    state_->stop = true;
  }
  state_->wake.notify_all();
  if (state_->worker.joinable()) state_->worker.join();
}

std::shared_ptr<WorkImpl> WorkerQueue::submit(std::function<void()> task) {
  auto work = std::make_shared<TaskWork>();
  {
    std::lock_guard lock(state_->mutex);
    state_->tasks.emplace_back(std::move(task), work);
  }
  state_->wake.notify_one();
  return work;
}

void WorkerQueue::abort(const std::string& why) {
  decltype(state_->tasks) dropped;
  {
    std::lock_guard lock(state_->mutex);
    dropped.swap(state_->tasks);
  }
  for (auto& [task, work] : dropped)
    work->finish(std::make_exception_ptr(Error(ErrorCode::CommunicationFailure, why)));
}

bool breaks_communicator(ErrorCode code) {
  return code == ErrorCode::Timeout || code == ErrorCode::CommunicationFailure;
}

[[noreturn]] void rethrow_for(const CommRecord& record, const Error& e,
                              std::chrono::milliseconds timeout, Health& health, CommImpl* impl) {
  std::string message = record.to_string() + ": ";
  if (e.code() == ErrorCode::Timeout)
    message += fmt::format(
        "not finished after {} ms (has every rank of the team called it? is one dead?): ",
        timeout.count());
  message += e.message();
  if (breaks_communicator(e.code())) health.fail_with(message, impl);
  throw Error(e.code(), message);
}

void WorkState::wait(std::chrono::milliseconds wait_timeout) {
  {
    std::lock_guard lock(mutex);
    if (finished) {
      if (error) std::rethrow_exception(error);
      return;
    }
  }
  std::exception_ptr failure;
  try {
    impl->wait(CommClock::now() + wait_timeout);
  } catch (const Error& e) {
    try {
      rethrow_for(record, e, wait_timeout, *health, comm.get());
    } catch (...) {
      failure = std::current_exception();
    }
  }
  std::lock_guard lock(mutex);
  if (!finished) {
    finished = true;
    error = failure;
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace meshfuse::detail

namespace meshfuse {

Work::Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}

void Work::wait() {
  if (state_) state_->wait(state_->timeout);
}

void Work::wait(std::chrono::milliseconds timeout) {
  detail::check_timeout(timeout, "Work::wait");
  if (state_) state_->wait(timeout);
}

bool Work::is_completed() const {
  if (!state_) return true;
  {
    std::lock_guard lock(state_->mutex);
    if (state_->finished) return true;
  }
  return state_->impl->test();
}

bool Work::in_flight() const { return state_ && detail::transfer_in_flight(*state_->impl); }

Work& Work::keep_alive(std::initializer_list<Tensor> buffers) {
  if (!state_) return *this;
  std::lock_guard lock(state_->mutex);
  for (const Tensor& t : buffers)
    if (t.defined()) state_->kept.push_back(t);
  return *this;
}

const CommRecord& Work::record() const {
  static const CommRecord kEmpty;
  return state_ ? state_->record : kEmpty;
}

}  // namespace meshfuse
