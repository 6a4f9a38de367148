// The mpi backend: MPI's nonblocking collectives (MPI_Iallreduce, ...) on a communicator per team.
//
// MPI has no timeouts, so a Work polls MPI_Test (which also drives MPI's progress) until its
// deadline. Reductions use MPI operations of our own over a datatype per dtype (reduce.h), so
// every dtype reduces, bf16 and f16 in fp32 per step, and min/max let NaN win as in the other
// backends. Avg = sum, then divide. Every MPI call holds one process-wide lock (MPI is initialised
// with MPI_THREAD_SERIALIZED when meshfuse initialises it, and a program that initialised it
// must have asked for that level or more); MPI_Finalize runs at exit.
//
// Teams: the world team duplicates MPI_COMM_WORLD, sub-teams come from MPI_Comm_create_group
// (collective over the team's members only). Both block without a timeout, like MPI itself.
// Counts and displacements are MPI ints: a message of more than 2^31 - 1 elements, and an
// all_gather, reduce_scatter or all_to_all whose whole tensor has more, is Unsupported.
#include "distributed/comm_impl.h"
#include "meshfuse/core/error.h"

#ifdef MESHFUSE_WITH_MPI

#include <mpi.h>

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "distributed/reduce.h"

namespace meshfuse::detail {

namespace {

std::mutex& mpi_mutex() {
  static std::mutex mutex;
  return mutex;
}

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  fail(ErrorCode::CommunicationFailure, "mpi: {} failed: {}", what, std::string(text, len));
}

constexpr DType kDTypes[] = {DType::F32, DType::F64, DType::F16, DType::BF16,
                             DType::I32, DType::I64, DType::U8,  DType::U32, DType::Bool};
constexpr ReduceOp kSteps[] = {ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max};

// MPI_Init_thread (unless the program did it), one datatype per dtype, one MPI_Op per reduction.
struct MpiGlobals {
  MPI_Datatype types[std::size(kDTypes)];
  MPI_Op ops[std::size(kSteps)];

  static MpiGlobals& get() {
    static MpiGlobals globals;
    return globals;
  }

  MPI_Datatype type(DType dtype) const {
    for (std::size_t i = 0; i < std::size(kDTypes); ++i)
      if (kDTypes[i] == dtype) return types[i];
    return MPI_DATATYPE_NULL;
  }
  MPI_Op op(ReduceOp op) const {
    const ReduceOp step = op == ReduceOp::Avg ? ReduceOp::Sum : op;
    for (std::size_t i = 0; i < std::size(kSteps); ++i)
      if (kSteps[i] == step) return ops[i];
    return MPI_OP_NULL;
  }

 private:
  template <ReduceOp Op>
  static void apply(void* in, void* inout, int* len, MPI_Datatype* type) {
    const MpiGlobals& g = get();
    for (std::size_t i = 0; i < std::size(kDTypes); ++i)
      if (g.types[i] == *type) reduce_buffers(kDTypes[i], Op, {in, inout}, inout, *len);
  }

  // A program that initialised MPI itself must have asked for MPI_THREAD_SERIALIZED or more:
  // meshfuse calls MPI from whichever threads run its collectives (under one lock). A failed
  // construction runs again at the next get(): `ours` remembers who initialised MPI.
  MpiGlobals() {
    static bool ours = false;
    int initialized = 0, provided = 0;
    MPI_Initialized(&initialized);
    if (initialized) {
      check_mpi(MPI_Query_thread(&provided), "MPI_Query_thread");
    } else {
      ours = true;
      check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided),
                "MPI_Init_thread");
      std::atexit([] {
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (!finalized) MPI_Finalize();
      });
    }
    MESHFUSE_CHECK(provided >= MPI_THREAD_SERIALIZED, ErrorCode::BackendUnavailable,
                   "mpi: {} thread level {}, meshfuse needs MPI_THREAD_SERIALIZED ({}) or more{}",
                   ours ? "this MPI offers" : "MPI was initialised by the program with", provided,
                   MPI_THREAD_SERIALIZED,
                   ours ? "" : " (initialise it with MPI_Init_thread at that level)");
    for (std::size_t i = 0; i < std::size(kDTypes); ++i) {
      MPI_Type_contiguous(static_cast<int>(element_size(kDTypes[i])), MPI_BYTE, &types[i]);
      MPI_Type_commit(&types[i]);
    }
    MPI_Op_create(&apply<ReduceOp::Sum>, 1, &ops[0]);
    MPI_Op_create(&apply<ReduceOp::Prod>, 1, &ops[1]);
    MPI_Op_create(&apply<ReduceOp::Min>, 1, &ops[2]);
    MPI_Op_create(&apply<ReduceOp::Max>, 1, &ops[3]);
  }
};

int as_int(std::int64_t n) {
  MESHFUSE_CHECK(n <= INT_MAX, ErrorCode::Unsupported,
                 "mpi: {} elements in one message or before one in its tensor; MPI counts and "
                 "displacements stop at 2^31 - 1",
                 n);
  return static_cast<int>(n);
}

// Counts and displacements as MPI takes them.
struct Layout {
  std::vector<int> counts, displs;
  explicit Layout(const std::vector<std::int64_t>& c) {
    std::int64_t at = 0;
    for (std::int64_t n : c) {
      counts.push_back(as_int(n));
      displs.push_back(as_int(at));
      at += n;
    }
    as_int(at);  // MPI sums the counts in an int too
  }
};

// What unfinished works kept: MPI cannot cancel a collective, so it may still use them at any
// time; they stay until exit.
void abandon(std::shared_ptr<void> keep) {
  static std::mutex mutex;
  static auto* abandoned = new std::vector<std::shared_ptr<void>>;  // never freed, on purpose
  std::lock_guard lock(mutex);
  abandoned->push_back(std::move(keep));
}

// One nonblocking operation. What MPI reads or writes until completion (counts, scratch) lives
// here, and outlives the work if the operation has not finished; `done` runs once it completes
// (Avg's division).
class MpiWork : public WorkImpl {
 public:
  std::shared_ptr<void> keep;
  std::function<void()> done;
  MPI_Request request = MPI_REQUEST_NULL;

  ~MpiWork() override {
    if (!finished_ && keep) abandon(std::move(keep));
  }

  bool test() override {
    std::lock_guard lock(mutex_);
    return poll();
  }

  // Locks per poll, so that test() (is_completed()) from another thread never waits for this.
  void wait(Deadline deadline) override {
    while (!test()) {
      if (CommClock::now() >= deadline) fail(ErrorCode::Timeout, "mpi: no completion");
      std::this_thread::yield();  // let the other ranks of an oversubscribed machine run
    }
    std::lock_guard lock(mutex_);
    if (!error_.empty()) fail(ErrorCode::CommunicationFailure, "{}", error_);
  }

 private:
  bool poll() {
    if (finished_) return true;
    int flag = 0;
    int rc;
    {
      std::lock_guard lock(mpi_mutex());
      rc = MPI_Test(&request, &flag, MPI_STATUS_IGNORE);
    }
    if (rc != MPI_SUCCESS) {
      try {
        check_mpi(rc, "MPI_Test");
      } catch (const Error& e) {
        error_ = e.what();
      }
      flag = 1;
    } else if (flag && done) {
      done();
    }
    finished_ = flag != 0;
    return finished_;
  }

  std::mutex mutex_;  // one thread polls at a time (done runs once)
  bool finished_ = false;
  std::string error_;
};

class MpiComm : public CommImpl {
 public:
  explicit MpiComm(const TeamContext& context) : size_(static_cast<int>(context.team.size())) {
    MpiGlobals::get();  // initialises MPI
    std::lock_guard lock(mpi_mutex());
    int world_rank = 0, world_size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    MESHFUSE_CHECK(world_size == context.launch.world_size && world_rank == context.launch.rank,
                   ErrorCode::BackendUnavailable,
                   "communicator backend mpi: MPI_COMM_WORLD has rank {} of {} but the launch "
                   "says {}; start the job with mpirun",
                   world_rank, world_size, context.launch.str());
    bool whole_world = size_ == world_size;
    for (int r = 0; r < size_ && whole_world; ++r) whole_world = context.team[r] == r;
    if (whole_world) {
      check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
    } else {
      MPI_Group world_group, group;
      MPI_Comm_group(MPI_COMM_WORLD, &world_group);
      MPI_Group_incl(world_group, size_, context.team.data(), &group);
      check_mpi(MPI_Comm_create_group(MPI_COMM_WORLD, group, 0, &comm_), "MPI_Comm_create_group");
      MPI_Group_free(&group);
      MPI_Group_free(&world_group);
    }
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
  }

  ~MpiComm() override {
    std::lock_guard lock(mpi_mutex());
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }

  CommunicatorBackend backend() const override { return CommunicatorBackend::Mpi; }

  void exchange(const void* mine, void* all, std::size_t bytes, Deadline deadline) override {
    // The work owns the buffers (MPI writes into them until the request completes, possibly
    // after a timeout here, when the caller's are gone); copied out on success only.
    const auto* p = static_cast<const std::uint8_t*>(mine);
    using Buffers = std::pair<std::vector<std::uint8_t>, std::vector<std::uint8_t>>;
    auto buffers = std::make_shared<Buffers>(
        Buffers{{p, p + bytes}, std::vector<std::uint8_t>(bytes * size_)});
    start(
        "MPI_Iallgather",
        [&](MPI_Request* r) {
          return MPI_Iallgather(buffers->first.data(), as_int(bytes), MPI_BYTE,
                                buffers->second.data(), as_int(bytes), MPI_BYTE, comm_, r);
        },
        nullptr, buffers)
        ->wait(deadline);
    std::memcpy(all, buffers->second.data(), buffers->second.size());
  }

  std::shared_ptr<WorkImpl> all_reduce(const TensorView& t, ReduceOp op, const Stream&) override {
    const MpiGlobals& g = MpiGlobals::get();
    return start(
        "MPI_Iallreduce",
        [&](MPI_Request* r) {
          return MPI_Iallreduce(MPI_IN_PLACE, t.data(), as_int(t.numel()), g.type(t.dtype()),
                                g.op(op), comm_, r);
        },
        avg(op, t));
  }

  std::shared_ptr<WorkImpl> reduce(const TensorView& t, int root, ReduceOp op,
                                   const Stream&) override {
    const MpiGlobals& g = MpiGlobals::get();
    const bool is_root = rank_ == root;
    return start(
        "MPI_Ireduce",
        [&](MPI_Request* r) {
          return MPI_Ireduce(is_root ? MPI_IN_PLACE : t.data(), is_root ? t.data() : nullptr,
                             as_int(t.numel()), g.type(t.dtype()), g.op(op), root, comm_, r);
        },
        is_root ? avg(op, t) : nullptr);
  }

  std::shared_ptr<WorkImpl> broadcast(const TensorView& t, int root, const Stream&) override {
    return start("MPI_Ibcast", [&](MPI_Request* r) {
      return MPI_Ibcast(t.data(), as_int(t.numel()), type_of(t), root, comm_, r);
    });
  }

  std::shared_ptr<WorkImpl> all_gather(const TensorView& in, const TensorView& out,
                                       const std::vector<std::int64_t>& counts,
                                       const Stream&) override {
    auto layout = std::make_shared<Layout>(counts);
    // The in-place form (the input is this rank's block of the output, as collectives.cpp allows)
    // is MPI_IN_PLACE to MPI: aliased buffers are erroneous there (MPICH refuses them).
    const bool in_place = in.numel() > 0 && in.data() == element(out, layout->displs[rank_]);
    return start(
        "MPI_Iallgatherv",
        [&](MPI_Request* r) {
          return MPI_Iallgatherv(in_place ? MPI_IN_PLACE : in.data(), as_int(in.numel()),
                                 type_of(in), out.data(), layout->counts.data(),
                                 layout->displs.data(), type_of(out), comm_, r);
        },
        nullptr, layout);
  }

  std::shared_ptr<WorkImpl> reduce_scatter(const TensorView& in, const TensorView& out,
                                           const std::vector<std::int64_t>& counts, ReduceOp op,
                                           const Stream&) override {
    const MpiGlobals& g = MpiGlobals::get();
    auto layout = std::make_shared<Layout>(counts);
    // In place (the output is this rank's block of the input): MPI's MPI_IN_PLACE would put the
    // block at the start of the input, and aliased buffers are erroneous, so the input is copied.
    const bool in_place = out.numel() > 0 && out.data() == element(in, layout->displs[rank_]);
    using Kept = std::pair<std::shared_ptr<Layout>, std::vector<std::uint8_t>>;
    auto kept = std::make_shared<Kept>(layout, std::vector<std::uint8_t>());
    if (in_place) {
      const auto* p = static_cast<const std::uint8_t*>(in.data());
      kept->second.assign(p, p + in.numel() * static_cast<std::int64_t>(element_size(in.dtype())));
    }
    const void* send = in_place ? kept->second.data() : in.data();
    return start(
        "MPI_Ireduce_scatter",
        [&](MPI_Request* r) {
          return MPI_Ireduce_scatter(send, out.data(), layout->counts.data(), g.type(in.dtype()),
                                     g.op(op), comm_, r);
        },
        avg(op, out), kept);
  }

  std::shared_ptr<WorkImpl> gather(const TensorView& in, const TensorView& out, int root,
                                   const Stream&) override {
    return start("MPI_Igather", [&](MPI_Request* r) {
      return MPI_Igather(in.data(), as_int(in.numel()), type_of(in),
                         rank_ == root ? out.data() : nullptr, as_int(in.numel()), type_of(in),
                         root, comm_, r);
    });
  }

  std::shared_ptr<WorkImpl> scatter(const TensorView& in, const TensorView& out, int root,
                                    const Stream&) override {
    return start("MPI_Iscatter", [&](MPI_Request* r) {
      return MPI_Iscatter(rank_ == root ? in.data() : nullptr, as_int(out.numel()), type_of(out),
                          out.data(), as_int(out.numel()), type_of(out), root, comm_, r);
    });
  }

  std::shared_ptr<WorkImpl> all_to_all(const TensorView& in, const TensorView& out,
                                       const std::vector<std::int64_t>& in_counts,
                                       const std::vector<std::int64_t>& out_counts,
                                       const Stream&) override {
    auto layouts =
        std::make_shared<std::pair<Layout, Layout>>(Layout(in_counts), Layout(out_counts));
    return start(
        "MPI_Ialltoallv",
        [&](MPI_Request* r) {
          return MPI_Ialltoallv(in.data(), layouts->first.counts.data(),
                                layouts->first.displs.data(), type_of(in), out.data(),
                                layouts->second.counts.data(), layouts->second.displs.data(),
                                type_of(out), comm_, r);
        },
        nullptr, layouts);
  }

  std::shared_ptr<WorkImpl> send(const TensorView& t, int peer, int tag, const Stream&) override {
    return start("MPI_Isend", [&](MPI_Request* r) {
      return MPI_Isend(t.data(), as_int(t.numel()), type_of(t), peer, tag, comm_, r);
    });
  }

  std::shared_ptr<WorkImpl> recv(const TensorView& t, int peer, int tag, const Stream&) override {
    return start("MPI_Irecv", [&](MPI_Request* r) {
      return MPI_Irecv(t.data(), as_int(t.numel()), type_of(t), peer, tag, comm_, r);
    });
  }

  std::shared_ptr<WorkImpl> barrier(const Stream&) override {
    return start("MPI_Ibarrier", [&](MPI_Request* r) { return MPI_Ibarrier(comm_, r); });
  }

 private:
  static MPI_Datatype type_of(const TensorView& t) { return MpiGlobals::get().type(t.dtype()); }

  // Avg's division, run once the sum has arrived.
  // The address of element i of a contiguous t.
  static const void* element(const TensorView& t, std::int64_t i) {
    return static_cast<const std::uint8_t*>(t.data()) +
           i * static_cast<std::int64_t>(element_size(t.dtype()));
  }

  std::function<void()> avg(ReduceOp op, const TensorView& t) const {
    if (op != ReduceOp::Avg) return nullptr;
    return [t, n = size_] { divide_buffer(t.dtype(), t.data(), t.numel(), n); };
  }

  template <typename Post>
  std::shared_ptr<MpiWork> start(const char* what, Post&& post,
                                 std::function<void()> done = nullptr,
                                 std::shared_ptr<void> keep = nullptr) {
    auto work = std::make_shared<MpiWork>();
    work->done = std::move(done);
    work->keep = std::move(keep);
    std::lock_guard lock(mpi_mutex());
    check_mpi(post(&work->request), what);
    return work;
  }

  int size_;
  int rank_ = 0;
  MPI_Comm comm_ = MPI_COMM_NULL;
};

}  // namespace

std::unique_ptr<CommImpl> make_mpi_comm(const TeamContext& context) {
  return std::make_unique<MpiComm>(context);
}

}  // namespace meshfuse::detail

#else  // MESHFUSE_WITH_MPI

namespace meshfuse::detail {

std::unique_ptr<CommImpl> make_mpi_comm(const TeamContext&) {
  fail(ErrorCode::BackendUnavailable,
       "communicator backend mpi: not in this build (install libopenmpi-dev and openmpi-bin, and "
       "configure with -DMESHFUSE_MPI=ON)");
}

}  // namespace meshfuse::detail

#endif  // MESHFUSE_WITH_MPI
