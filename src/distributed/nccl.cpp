// The nccl backend: one NCCL communicator per team, on the CUDA device of the rank's LOCAL rank.
//
// Operations are queued on the caller's stream; the Work is a CUDA event recorded after them, and
// waiting polls it (cudaEventQuery) against the deadline, so a rank that never arrives gives a
// Timeout (and then ncclCommAbort) instead of a hang. NCCL has no uneven all-gather,
// reduce-scatter, gather, scatter or all-to-all: they are grouped (ncclGroupStart/End) broadcasts,
// reduces and send/recv pairs, which NCCL runs as one launch. A rank's own block moves with
// cudaMemcpyAsync on the same stream.
//
// Point to point: NCCL matches the sends and receives between two ranks in the order they are
// issued; tags are not seen by it. A send blocks its stream until the peer receives, so a ring
// step is send_recv, one group.
#include "core/cuda/runtime.h"
#include "core/shared_library.h"
#include "distributed/comm_impl.h"
#include "meshfuse/core/error.h"

#if MESHFUSE_WITH_NCCL

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstring>
#include <shared_mutex>
#include <string>
#include <thread>
#include <type_traits>

namespace meshfuse::detail {
namespace {

// NCCL is opened with the first nccl communicator, not linked (core/shared_library.h says why);
// MESHFUSE_NCCL_LIBRARY names another file.
struct NcclApi {
  std::string path;  // as opened
  decltype(&::ncclAllGather) AllGather;
  decltype(&::ncclAllReduce) AllReduce;
  decltype(&::ncclBroadcast) Broadcast;
  decltype(&::ncclCommAbort) CommAbort;
  decltype(&::ncclCommDestroy) CommDestroy;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&::ncclCommInitRank) CommInitRank;
  decltype(&::ncclGetErrorString) GetErrorString;
  decltype(&::ncclGetLastError) GetLastError;
  decltype(&::ncclGetUniqueId) GetUniqueId;
  decltype(&::ncclGetVersion) GetVersion;
  decltype(&::ncclGroupEnd) GroupEnd;
  decltype(&::ncclGroupStart) GroupStart;
  decltype(&::ncclRecv) Recv;
  decltype(&::ncclReduce) Reduce;
  decltype(&::ncclReduceScatter) ReduceScatter;
  decltype(&::ncclSend) Send;
};

const NcclApi& nccl() {
  static const NcclApi api = [] {
    const SharedLibrary lib("nccl", "MESHFUSE_NCCL_LIBRARY", "libnccl.so.2",
                            MESHFUSE_NCCL_BUILD_LIBRARY, "install NCCL");
    NcclApi a{};
    a.path = lib.path();
    const auto bind = [&](auto& fn, const char* name) { lib.bind(fn, name, "NCCL 2.13 or newer"); };
    bind(a.AllGather, "ncclAllGather");
    bind(a.AllReduce, "ncclAllReduce");
    bind(a.Broadcast, "ncclBroadcast");
    bind(a.CommAbort, "ncclCommAbort");
    bind(a.CommDestroy, "ncclCommDestroy");
    bind(a.CommGetAsyncError, "ncclCommGetAsyncError");
    bind(a.CommInitRank, "ncclCommInitRank");
    bind(a.GetErrorString, "ncclGetErrorString");
    bind(a.GetLastError, "ncclGetLastError");
    bind(a.GetUniqueId, "ncclGetUniqueId");
    bind(a.GetVersion, "ncclGetVersion");
    bind(a.GroupEnd, "ncclGroupEnd");
    bind(a.GroupStart, "ncclGroupStart");
    bind(a.Recv, "ncclRecv");
    bind(a.Reduce, "ncclReduce");
    bind(a.ReduceScatter, "ncclReduceScatter");
    bind(a.Send, "ncclSend");
    return a;
  }();
  return api;
}

void check_cuda(cudaError_t status, std::string_view what) {
  if (status == cudaSuccess) return;
  cudaGetLastError();  // clear a sticky error so the next call starts clean
  fail(ErrorCode::CommunicationFailure, "nccl: {}: CUDA error {} ({})", what,
       cudaGetErrorName(status), cudaGetErrorString(status));
}

// core's DeviceGuard with its CUDA error as this backend's other CUDA errors: a device that cannot
// be made current fails the operation with CommunicationFailure, which breaks the communicator.
cuda::DeviceGuard device_guard(int device) {
  try {
    return cuda::DeviceGuard(device);
  } catch (const Error& e) {
    fail(ErrorCode::CommunicationFailure, "nccl: {}", e.message());
  }
}

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return ncclFloat32;
    case DType::F64:
      return ncclFloat64;
    case DType::F16:
      return ncclFloat16;
    case DType::BF16:
      return ncclBfloat16;
    case DType::I32:
      return ncclInt32;
    case DType::I64:
      return ncclInt64;
    case DType::U32:
      return ncclUint32;
    case DType::U8:
    case DType::Bool:
      return ncclUint8;  // Bool only moves (reductions reject it before here)
  }
  fail(ErrorCode::Internal, "nccl: unknown dtype");
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return ncclSum;
    case ReduceOp::Prod:
      return ncclProd;
    case ReduceOp::Min:
      return ncclMin;
    case ReduceOp::Max:
      return ncclMax;
    case ReduceOp::Avg:
      return ncclAvg;  // sum / team size, computed by NCCL in the dtype's math
  }
  fail(ErrorCode::Internal, "nccl: unknown reduction");
}

cudaStream_t native(const Stream& stream) { return static_cast<cudaStream_t>(stream.native); }

char* bytes_at(const TensorView& t, std::int64_t element_offset) {
  return static_cast<char*>(t.data()) +
         element_offset * static_cast<std::int64_t>(element_size(t.dtype()));
}

// Prefix sums: offsets[r] = sum(counts[:r]).
std::vector<std::int64_t> offsets_of(const std::vector<std::int64_t>& counts) {
  std::vector<std::int64_t> offsets(counts.size(), 0);
  for (std::size_t r = 1; r < counts.size(); ++r) offsets[r] = offsets[r - 1] + counts[r - 1];
  return offsets;
}

bool all_equal(const std::vector<std::int64_t>& counts) {
  for (std::int64_t c : counts)
    if (c != counts.front()) return false;
  return true;
}

[[noreturn]] void fail_nccl(ncclResult_t result, std::string_view what, ncclComm_t comm) {
  fail(ErrorCode::CommunicationFailure, "nccl: {} failed: {} ({})", what,
       nccl().GetErrorString(result), nccl().GetLastError(comm));
}

// The NCCL communicator, shared by the backend and its Works, so that a Work outliving the
// Communicator can still be waited on; destroyed (or left after an abort) with the last of them.
struct Handle {
  int device = 0;
  ncclComm_t comm = nullptr;
  std::atomic<bool> aborted{false};
  // Works may be waited from several threads, and one that fails aborts the communicator, which
  // frees it: held shared around the queries of `comm`, exclusively around its abort.
  mutable std::shared_mutex abort_mutex;

  ~Handle() {
    if (comm && !aborted) {
      cudaSetDevice(device);
      nccl().CommDestroy(comm);
    }
  }
  // The communicator's asynchronous error (a failed peer, a network error), as an Error.
  void check_async() const {
    const std::shared_lock lock(abort_mutex);
    MESHFUSE_CHECK(!aborted, ErrorCode::CommunicationFailure,
                   "nccl: the communicator was aborted after an earlier failure");
    ncclResult_t async = ncclSuccess;
    if (nccl().CommGetAsyncError(comm, &async) == ncclSuccess && async != ncclSuccess &&
        async != ncclInProgress)
      fail_nccl(async, "the communicator", comm);
  }
};

// An event recorded on the stream after the operation.
class NcclWork : public WorkImpl {
 public:
  NcclWork(std::shared_ptr<const Handle> handle, cudaEvent_t event)
      : handle_(std::move(handle)), event_(event) {}
  ~NcclWork() override { cudaEventDestroy(event_); }
  bool test() override;
  void wait(Deadline deadline) override;

 private:
  std::shared_ptr<const Handle> handle_;
  cudaEvent_t event_;
};

class NcclComm : public CommImpl {
 public:
  explicit NcclComm(const TeamContext& context)
      : handle_(std::make_shared<Handle>()),
        device_(context.launch.cuda_device()),
        rank_(context.rank),
        size_(static_cast<int>(context.team.size())) {
    int devices = 0;
    check_cuda(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
    MESHFUSE_CHECK(device_ < devices, ErrorCode::BackendUnavailable,
                   "nccl: rank {} (local rank {}) needs CUDA device {}, but this process sees {} "
                   "CUDA device(s); start at most one process per GPU on each machine",
                   context.launch.rank, context.launch.local_rank, device_, devices);
    // Rank 0's unique id reaches the others through the rendezvous (every rank has checked in
    // there before NCCL's blocking init starts; a rank dying in between leaves init waiting: NCCL
    // offers a deadline only to non-blocking communicators, whose every call would then need
    // polling).
    ncclUniqueId id{};
    if (rank_ == 0) check(nccl().GetUniqueId(&id), "ncclGetUniqueId");
    std::vector<ncclUniqueId> ids(static_cast<std::size_t>(size_));
    context.bootstrap_exchange(&id, ids.data(), sizeof id);
    const cuda::DeviceGuard guard = device_guard(device_);
    handle_->device = device_;
    check(nccl().CommInitRank(&handle_->comm, size_, ids[0], rank_), "ncclCommInitRank");
    comm_ = handle_->comm;
    check_cuda(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking),
               "cudaStreamCreateWithFlags");
  }

  ~NcclComm() override {
    // Errors ignored: nothing is left to tell them to (at exit the driver may be gone already).
    int previous = -1;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    if (scratch_) cudaFree(scratch_);
    if (host_scratch_) cudaFreeHost(host_scratch_);
    if (barrier_) cudaFree(barrier_);
    if (side_stream_) cudaStreamDestroy(side_stream_);
    if (previous >= 0) cudaSetDevice(previous);
  }

  CommunicatorBackend backend() const override { return CommunicatorBackend::Nccl; }

  // Through the device: host bytes up, ncclAllGather, back down, on a stream of our own. The host
  // side is pinned, so that no copy blocks and the wait can honour the deadline.
  void exchange(const void* mine, void* all, std::size_t bytes, Deadline deadline) override {
    const cuda::DeviceGuard guard = device_guard(device_);
    const std::size_t total = bytes * static_cast<std::size_t>(size_ + 1);
    if (scratch_bytes_ < total) {
      if (scratch_) check_cuda(cudaFree(scratch_), "cudaFree");
      if (host_scratch_) check_cuda(cudaFreeHost(host_scratch_), "cudaFreeHost");
      scratch_ = host_scratch_ = nullptr;
      scratch_bytes_ = 0;
      check_cuda(cudaMalloc(&scratch_, total), "cudaMalloc");
      check_cuda(cudaMallocHost(&host_scratch_, total), "cudaMallocHost");
      scratch_bytes_ = total;
    }
    char* send = static_cast<char*>(scratch_);
    char* host = static_cast<char*>(host_scratch_);
    std::memcpy(host, mine, bytes);
    check_cuda(cudaMemcpyAsync(send, host, bytes, cudaMemcpyHostToDevice, side_stream_),
               "cudaMemcpyAsync");
    check(nccl().AllGather(send, send + bytes, bytes, ncclUint8, comm_, side_stream_),
          "ncclAllGather");
    check_cuda(cudaMemcpyAsync(host + bytes, send + bytes, total - bytes, cudaMemcpyDeviceToHost,
                               side_stream_),
               "cudaMemcpyAsync");
    record(side_stream_)->wait(deadline);
    std::memcpy(all, host + bytes, total - bytes);
  }

  std::shared_ptr<WorkImpl> all_reduce(const TensorView& t, ReduceOp op,
                                       const Stream& stream) override {
    const Launch l(*this, t, stream);
    check(nccl().AllReduce(t.data(), t.data(), count(t), nccl_type(t.dtype()), nccl_op(op), comm_,
                           l.stream),
          "ncclAllReduce");
    return record(stream);
  }

  std::shared_ptr<WorkImpl> broadcast(const TensorView& t, int root,
                                      const Stream& stream) override {
    const Launch l(*this, t, stream);
    check(
        nccl().Broadcast(t.data(), t.data(), count(t), nccl_type(t.dtype()), root, comm_, l.stream),
        "ncclBroadcast");
    return record(stream);
  }

  std::shared_ptr<WorkImpl> reduce(const TensorView& t, int root, ReduceOp op,
                                   const Stream& stream) override {
    const Launch l(*this, t, stream);
    check(nccl().Reduce(t.data(), t.data(), count(t), nccl_type(t.dtype()), nccl_op(op), root,
                        comm_, l.stream),
          "ncclReduce");
    return record(stream);
  }

  std::shared_ptr<WorkImpl> all_gather(const TensorView& input, const TensorView& output,
                                       const std::vector<std::int64_t>& counts,
                                       const Stream& stream) override {
    const Launch l(*this, output, stream);
    const ncclDataType_t type = nccl_type(output.dtype());
    if (all_equal(counts)) {
      check(nccl().AllGather(input.data(), output.data(), static_cast<std::size_t>(counts[0]), type,
                             comm_, l.stream),
            "ncclAllGather");
    } else {
      // Rank r broadcasts its rows into their place in everyone's output.
      const std::vector<std::int64_t> offsets = offsets_of(counts);
      grouped([&] {
        for (int r = 0; r < size_; ++r) {
          char* place = bytes_at(output, offsets[r]);
          check(nccl().Broadcast(r == rank_ ? input.data() : place, place,
                                 static_cast<std::size_t>(counts[r]), type, r, comm_, l.stream),
                "ncclBroadcast");
        }
      });
    }
    return record(stream);
  }

  std::shared_ptr<WorkImpl> reduce_scatter(const TensorView& input, const TensorView& output,
                                           const std::vector<std::int64_t>& counts, ReduceOp op,
                                           const Stream& stream) override {
    const Launch l(*this, input, stream);
    const ncclDataType_t type = nccl_type(input.dtype());
    if (all_equal(counts)) {
      check(nccl().ReduceScatter(input.data(), output.data(), static_cast<std::size_t>(counts[0]),
                                 type, nccl_op(op), comm_, l.stream),
            "ncclReduceScatter");
    } else {
      // Block r is reduced onto rank r (the receive buffer only matters on the root).
      const std::vector<std::int64_t> offsets = offsets_of(counts);
      grouped([&] {
        for (int r = 0; r < size_; ++r) {
          char* block = bytes_at(input, offsets[r]);
          check(nccl().Reduce(block, r == rank_ ? output.data() : block,
                              static_cast<std::size_t>(counts[r]), type, nccl_op(op), r, comm_,
                              l.stream),
                "ncclReduce");
        }
      });
    }
    return record(stream);
  }

  std::shared_ptr<WorkImpl> gather(const TensorView& input, const TensorView& output, int root,
                                   const Stream& stream) override {
    const Launch l(*this, input, stream);
    const std::int64_t n = input.numel();
    grouped([&] {
      if (rank_ != root)
        return check(nccl().Send(input.data(), count(input), nccl_type(input.dtype()), root, comm_,
                                 l.stream),
                     "ncclSend");
      for (int r = 0; r < size_; ++r)
        if (r == rank_)
          copy(input.data(), bytes_at(output, r * n), input.nbytes(), l.stream);
        else
          check(nccl().Recv(bytes_at(output, r * n), count(input), nccl_type(input.dtype()), r,
                            comm_, l.stream),
                "ncclRecv");
    });
    return record(stream);
  }

  std::shared_ptr<WorkImpl> scatter(const TensorView& input, const TensorView& output, int root,
                                    const Stream& stream) override {
    const Launch l(*this, output, stream);
    const std::int64_t n = output.numel();
    grouped([&] {
      if (rank_ != root)
        return check(nccl().Recv(output.data(), count(output), nccl_type(output.dtype()), root,
                                 comm_, l.stream),
                     "ncclRecv");
      for (int r = 0; r < size_; ++r)
        if (r == rank_)
          copy(bytes_at(input, r * n), output.data(), output.nbytes(), l.stream);
        else
          check(nccl().Send(bytes_at(input, r * n), count(output), nccl_type(output.dtype()), r,
                            comm_, l.stream),
                "ncclSend");
    });
    return record(stream);
  }

  std::shared_ptr<WorkImpl> all_to_all(const TensorView& input, const TensorView& output,
                                       const std::vector<std::int64_t>& in_counts,
                                       const std::vector<std::int64_t>& out_counts,
                                       const Stream& stream) override {
    const Launch l(*this, output, stream);
    const std::vector<std::int64_t> in_offsets = offsets_of(in_counts);
    const std::vector<std::int64_t> out_offsets = offsets_of(out_counts);
    const ncclDataType_t type = nccl_type(output.dtype());
    const std::size_t element = element_size(output.dtype());
    grouped([&] {
      for (int r = 0; r < size_; ++r) {
        // Empty blocks are skipped on both sides: in_counts[r] here is out_counts[me] on rank r.
        if (r == rank_) {
          copy(bytes_at(input, in_offsets[r]), bytes_at(output, out_offsets[r]),
               static_cast<std::size_t>(in_counts[r]) * element, l.stream);
          continue;
        }
        if (in_counts[r] > 0)
          check(nccl().Send(bytes_at(input, in_offsets[r]), static_cast<std::size_t>(in_counts[r]),
                            type, r, comm_, l.stream),
                "ncclSend");
        if (out_counts[r] > 0)
          check(nccl().Recv(bytes_at(output, out_offsets[r]),
                            static_cast<std::size_t>(out_counts[r]), type, r, comm_, l.stream),
                "ncclRecv");
      }
    });
    return record(stream);
  }

  std::shared_ptr<WorkImpl> send(const TensorView& t, int peer, int,
                                 const Stream& stream) override {
    const Launch l(*this, t, stream);
    if (t.numel() > 0)  // empty transfers are skipped on both sides, as in send_recv
      check(nccl().Send(t.data(), count(t), nccl_type(t.dtype()), peer, comm_, l.stream),
            "ncclSend");
    return record(stream);
  }

  std::shared_ptr<WorkImpl> recv(const TensorView& t, int peer, int,
                                 const Stream& stream) override {
    const Launch l(*this, t, stream);
    if (t.numel() > 0)
      check(nccl().Recv(t.data(), count(t), nccl_type(t.dtype()), peer, comm_, l.stream),
            "ncclRecv");
    return record(stream);
  }

  // One group: NCCL posts both before either blocks, so a ring of them cannot deadlock. Empty
  // transfers are skipped, as in all_to_all (the peer's matching side is empty too).
  std::shared_ptr<WorkImpl> send_recv(const TensorView& out, int dst, const TensorView& in, int src,
                                      int, const Stream& stream) override {
    const Launch l(*this, out, stream);
    grouped([&] {
      if (out.numel() > 0)
        check(nccl().Send(out.data(), count(out), nccl_type(out.dtype()), dst, comm_, l.stream),
              "ncclSend");
      if (in.numel() > 0)
        check(nccl().Recv(in.data(), count(in), nccl_type(in.dtype()), src, comm_, l.stream),
              "ncclRecv");
    });
    return record(stream);
  }

  // An all-reduce of one int on a scratch buffer, as torch.distributed's NCCL barrier.
  std::shared_ptr<WorkImpl> barrier(const Stream& stream) override {
    const cuda::DeviceGuard guard = device_guard(device_);
    check_device(stream.device, "stream");
    if (!barrier_) check_cuda(cudaMalloc(&barrier_, sizeof(int)), "cudaMalloc");
    check(nccl().AllReduce(barrier_, barrier_, 1, ncclInt32, ncclSum, comm_, native(stream)),
          "ncclAllReduce (barrier)");
    return record(stream);
  }

  void abort() override {
    const std::unique_lock lock(handle_->abort_mutex);
    if (!handle_->aborted.exchange(true)) nccl().CommAbort(comm_);
  }

  void check_device(const Device& device) override { check_device(device, "tensor"); }

 private:
  // The scope of one operation: the device made current and the tensors' device checked.
  struct Launch {
    Launch(const NcclComm& comm, const TensorView& t, const Stream& s)
        : guard(device_guard(comm.device_)), stream(native(s)) {
      comm.check_device(t.device(), "tensor");
      comm.check_device(s.device, "stream");
    }
    cuda::DeviceGuard guard;
    cudaStream_t stream;
  };

  // Runs `calls` between ncclGroupStart and ncclGroupEnd: NCCL launches them as one operation.
  template <typename Calls>
  void grouped(const Calls& calls) const {
    check(nccl().GroupStart(), "ncclGroupStart");
    try {
      calls();
    } catch (...) {
      nccl().GroupEnd();
      throw;
    }
    check(nccl().GroupEnd(), "ncclGroupEnd");
  }

  void check(ncclResult_t result, std::string_view what) const {
    if (result != ncclSuccess) fail_nccl(result, what, comm_);
  }

  void check_device(const Device& device, std::string_view what) const {
    MESHFUSE_CHECK(device.type == DeviceType::CUDA && device.index == device_,
                   ErrorCode::DeviceMismatch,
                   "nccl: the {} is on {}, but this rank's NCCL communicator is on cuda:{} (its "
                   "local rank)",
                   what, device.str(), device_);
  }

  static std::size_t count(const TensorView& t) { return static_cast<std::size_t>(t.numel()); }

  static void copy(const void* src, void* dst, std::size_t bytes, cudaStream_t stream) {
    if (bytes > 0 && src != dst)
      check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream),
                 "cudaMemcpyAsync");
  }

  std::shared_ptr<WorkImpl> record(cudaStream_t stream) {
    cudaEvent_t event;
    check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
    const cudaError_t status = cudaEventRecord(event, stream);
    if (status != cudaSuccess) cudaEventDestroy(event);
    check_cuda(status, "cudaEventRecord");
    return std::make_shared<NcclWork>(handle_, event);
  }
  std::shared_ptr<WorkImpl> record(const Stream& stream) { return record(native(stream)); }

  std::shared_ptr<Handle> handle_;
  int device_;
  int rank_;
  int size_;
  ncclComm_t comm_ = nullptr;           // handle_->comm
  cudaStream_t side_stream_ = nullptr;  // exchange()
  void* scratch_ = nullptr;       // exchange(): the bytes sent, then size_ x the bytes received
  void* host_scratch_ = nullptr;  // the same, pinned on the host
  std::size_t scratch_bytes_ = 0;
  void* barrier_ = nullptr;
};

bool NcclWork::test() {
  const cudaError_t status = cudaEventQuery(event_);
  if (status == cudaErrorNotReady) return false;
  cudaGetLastError();
  return true;
}

void NcclWork::wait(Deadline deadline) {
  // Yield-spin through the first 2 ms (most collectives: a sleep there overshoots their end by
  // up to its own length), then poll every 20 us, watching NCCL's own errors.
  const auto spin_until = CommClock::now() + std::chrono::milliseconds(2);
  while (true) {
    // After an abort the kernels stop early and the event completes, without the results.
    handle_->check_async();
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaSuccess) return;
    if (status != cudaErrorNotReady) check_cuda(status, "waiting for the operation");
    const auto now = CommClock::now();
    if (now >= deadline)
      fail(ErrorCode::Timeout,
           "nccl: the operation did not finish before the timeout (a rank did not arrive, or "
           "the transfer stalled); the NCCL communicator is aborted");
    if (now < spin_until)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

}  // namespace

std::unique_ptr<CommImpl> make_nccl_comm(const TeamContext& context) {
  return std::make_unique<NcclComm>(context);
}

}  // namespace meshfuse::detail

namespace meshfuse {

std::string nccl_library() {
  const detail::NcclApi& api = detail::nccl();
  int version = 0;
  if (api.GetVersion(&version) != ncclSuccess)
    fail(ErrorCode::BackendUnavailable, "nccl: ncclGetVersion failed in {}", api.path);
  // NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch since 2.9.
  return fmt::format("NCCL {}.{}.{} ({})", version / 10000, version / 100 % 100, version % 100,
                     api.path);
}

}  // namespace meshfuse

#else  // !MESHFUSE_WITH_NCCL

namespace meshfuse {

std::string nccl_library() {
  fail(ErrorCode::BackendUnavailable,
       "nccl: not in this build (it needs CUDA and NCCL: configure with -DMESHFUSE_CUDA=ON "
       "-DMESHFUSE_NCCL=ON)");
}

}  // namespace meshfuse

namespace meshfuse::detail {

std::unique_ptr<CommImpl> make_nccl_comm(const TeamContext&) {
  fail(ErrorCode::BackendUnavailable,
       "communicator backend nccl: not in this build (it needs CUDA and NCCL: configure with "
       "-DMESHFUSE_CUDA=ON -DMESHFUSE_NCCL=ON)");
}

}  // namespace meshfuse::detail

#endif  // MESHFUSE_WITH_NCCL
