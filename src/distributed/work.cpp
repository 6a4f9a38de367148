// Finished works and the worker queue that makes blocking transfers asynchronous.
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include "distributed/comm_impl.h"
#include "meshfuse/core/error.h"

namespace meshfuse::detail {

namespace {

class CompletedWork : public WorkImpl {
 public:
  bool test() override { return true; }
  void wait(Deadline) override {}
};

}  // namespace

std::shared_ptr<WorkImpl> completed_work() { return std::make_shared<CompletedWork>(); }

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

WorkerQueue::~WorkerQueue() {
  {
    std::lock_guard lock(state_->mutex);
    state_->stop = true;
  }
  state_->wake.notify_all();
  state_->worker.join();
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

}  // namespace meshfuse::detail
