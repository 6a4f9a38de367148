// The operations of a Communicator (collectives, send and recv, barrier): the argument checks
// every backend shares, the metadata check, the record, then the backend of the tensors' device.
#include <algorithm>
#include <exception>
#include <functional>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "distributed/comm_state.h"
#include "distributed/reduce.h"
#include "meshfuse/core/error.h"
#include "meshfuse/distributed/communicator.h"

namespace meshfuse {

using detail::CommState;

namespace {

// One call, as the generic layer sees it.
struct Call {
  using Named = std::pair<const char*, TensorView>;  // the argument's name, the tensor
  Call(CommState& state, CommOp op, std::vector<Named> tensors)
      : op(op), tensors(std::move(tensors)), state_(&state) {}
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;
  // A collective whose arguments fail this rank's checks (an exception before start() exchanges
  // its metadata) still counts as an exchange, so that the next exchange finds this rank out of
  // step with the ranks that did exchange (CommState::exchanges).
  ~Call() {
    const bool p2p = op == CommOp::Send || op == CommOp::Recv || op == CommOp::SendRecv;
    if (!exchanged && state_->check && !p2p && std::uncaught_exceptions() > exceptions_)
      ++state_->exchanges;
  }

  CommOp op;
  std::vector<Named> tensors;  // the ones this rank passes (a gather's output only on the root)
  int root = -1;
  int source = -1;  // send_recv
  std::optional<ReduceOp> reduction;
  std::int64_t count = 0;  // see CommRecord::count
  std::int64_t bytes = 0;
  bool split_sizes = false;  // called with split sizes (the metadata check compares them)
  std::vector<std::int64_t> in_counts, out_counts;  // elements per rank, where they apply
  Stream stream;
  DType dtype = DType::U8;
  Device device{};
  bool exchanged = false;  // start() reached the metadata exchange (or has none to make)

 private:
  CommState* state_;
  int exceptions_ = std::uncaught_exceptions();
};

std::string op_name(CommOp op) { return std::string(to_string(op)); }

bool all_equal(const std::vector<std::int64_t>& counts) {
  return std::adjacent_find(counts.begin(), counts.end(), std::not_equal_to<>()) == counts.end();
}

// Checks the tensors (defined, contiguous, one dtype, one device) and the stream (on the tensors'
// device, never relabelled: a CPU stream with CUDA tensors is a DeviceMismatch); fills dtype and
// device.
void check_tensors(Call& c, const Stream& stream) {
  const std::string op = op_name(c.op);
  if (c.tensors.empty()) {
    c.stream = stream;
    c.device = stream.device;
    return;
  }
  for (const auto& [name, t] : c.tensors)
    MESHFUSE_CHECK(t.defined(), ErrorCode::InvalidArgument, "{}: '{}' is undefined", op, name);
  const TensorView& first = c.tensors.front().second;
  c.dtype = first.dtype();
  c.device = first.device();
  for (const auto& [name, t] : c.tensors) {
    MESHFUSE_CHECK(t.is_contiguous(), ErrorCode::InvalidArgument,
                   "{}: tensors must be contiguous, got {}", op, t.str());
    MESHFUSE_CHECK(t.dtype() == c.dtype, ErrorCode::DTypeMismatch,
                   "{}: tensors must share one dtype, got {} and {}", op, first.str(), t.str());
    MESHFUSE_CHECK(t.device() == c.device, ErrorCode::DeviceMismatch,
                   "{}: tensors must be on one device, got {} and {}", op, first.str(), t.str());
  }
  c.stream = stream;
  MESHFUSE_CHECK(c.stream.device == c.device, ErrorCode::DeviceMismatch,
                 "{}: the stream is on {} but the tensors on {}", op, c.stream.device.str(),
                 c.device.str());
  MESHFUSE_CHECK(c.device.type != DeviceType::CPU || stream.native == nullptr,
                 ErrorCode::InvalidArgument,
                 "{}: stream: a native stream handle ({}) came with tensors on the CPU, where the "
                 "backends run on the calling thread: pass none",
                 op, stream.native);
}

// Where `part` shares memory with `whole`, it may only be this rank's block of it, starting at
// element `at` (the in-place all_gather and reduce_scatter, whose backends leave that block where
// it lies); any other overlap is read after it is written, and gave wrong values silently. `at`
// < 0: no overlap at all (all_to_all sends and receives every block at once; gather, scatter and
// send_recv have no in-place form).
void check_overlap(const char* whole_name, const TensorView& whole, const char* part_name,
                   const TensorView& part, std::int64_t at, CommOp op) {
  const auto* w = static_cast<const std::uint8_t*>(whole.data());
  const auto* p = static_cast<const std::uint8_t*>(part.data());
  const auto size = static_cast<std::int64_t>(element_size(whole.dtype()));
  const bool overlap = whole.numel() > 0 && part.numel() > 0 && p < w + whole.numel() * size &&
                       w < p + part.numel() * size;
  if (!overlap || (at >= 0 && p == w + at * size)) return;
  fail(ErrorCode::InvalidArgument, "{}: {} {} overlaps {} {}{}", op_name(op), part_name, part.str(),
       whole_name, whole.str(),
       at >= 0 ? fmt::format(" other than as this rank's block (from element {}), the one "
                             "overlap it takes",
                             at)
               : fmt::format(", and {} has no in-place form: give '{}' its own memory", op_name(op),
                             part_name));
}

std::int64_t elements_before(const std::vector<std::int64_t>& counts, int rank) {
  return std::accumulate(counts.begin(), counts.begin() + rank, std::int64_t{0});
}

void check_rank(int r, int size, const char* what, CommOp op) {
  MESHFUSE_CHECK(r >= 0 && r < size, ErrorCode::InvalidArgument,
                 "{}: {} {} is outside the team's ranks 0..{}", op_name(op), what, r, size - 1);
}

// A contiguous tensor as a flat 1-D view (what backends receive).
TensorView flat(const TensorView& t) {
  if (!t.defined()) return t;
  return TensorView(t.data(), t.dtype(), Shape{t.numel()}, t.device());
}

std::int64_t row_elements(const TensorView& t) {
  Shape trailing(t.shape().begin() + 1, t.shape().end());
  return shape_numel(trailing);
}

// Split sizes (rows of dim 0) -> elements per rank; checks the count and the sum.
std::vector<std::int64_t> split_elements(const std::vector<std::int64_t>& rows, const TensorView& t,
                                         int size, const char* which, CommOp op) {
  const std::string name = op_name(op);
  MESHFUSE_CHECK(t.dim() >= 1, ErrorCode::InvalidArgument,
                 "{}: split sizes need tensors of at least one dim, got {}", name, t.str());
  std::vector<std::int64_t> rows_used = rows;
  if (rows_used.empty()) {  // equal rows
    MESHFUSE_CHECK(t.size(0) % size == 0, ErrorCode::InvalidArgument,
                   "{}: without {}, dim 0 of {} must divide by the team size {}", name, which,
                   t.str(), size);
    rows_used.assign(size, t.size(0) / size);
  }
  MESHFUSE_CHECK(static_cast<int>(rows_used.size()) == size, ErrorCode::InvalidArgument,
                 "{}: {} has {} entries for a team of {}", name, which, rows_used.size(), size);
  std::int64_t sum = 0;
  bool wrapped = false;  // sizes near 2^63 could otherwise add up, wrapped, to the tensor's rows
  for (std::int64_t r : rows_used) {
    MESHFUSE_CHECK(r >= 0, ErrorCode::InvalidArgument, "{}: {} {} has a negative size", name, which,
                   detail::list_str(rows_used));
    wrapped = __builtin_add_overflow(sum, r, &sum) || wrapped;
  }
  MESHFUSE_CHECK(!wrapped && sum == t.size(0), ErrorCode::InvalidArgument,
                 "{}: {} {} add up to {} rows but the tensor {} has {}", name, which,
                 detail::list_str(rows_used), wrapped ? "more than 2^63" : std::to_string(sum),
                 t.str(), t.size(0));
  const std::int64_t row = row_elements(t);
  for (std::int64_t& r : rows_used) r *= row;
  return rows_used;
}

void check_same_rows(const TensorView& a, const TensorView& b, CommOp op) {
  MESHFUSE_CHECK(a.dim() >= 1 && a.dim() == b.dim() &&
                     std::equal(a.shape().begin() + 1, a.shape().end(), b.shape().begin() + 1),
                 ErrorCode::ShapeMismatch, "{}: {} and {} must agree in every dim but dim 0",
                 op_name(op), a.str(), b.str());
}

void check_numel(const TensorView& t, std::int64_t expected, const char* what, CommOp op,
                 std::string_view note = {}) {
  MESHFUSE_CHECK(t.numel() == expected, ErrorCode::ShapeMismatch,
                 "{}: {} {} has {} elements, expected {}{}", op_name(op), what, t.str(), t.numel(),
                 expected, note);
}

// `whole` must hold size() parts of `part`'s numel. An all_gather's or reduce_scatter's whose two
// are the other way round is most likely torch's order, which takes the output first
// (all_gather_into_tensor, reduce_scatter_tensor): the error says meshfuse's.
void check_parts(const TensorView& whole, const char* whole_name, const TensorView& part, int size,
                 CommOp op) {
  if (whole.numel() == size * part.numel()) return;  // the note is formatted for errors only
  const bool exchanged = (op == CommOp::AllGather || op == CommOp::ReduceScatter) && size > 1 &&
                         part.numel() == size * whole.numel();
  check_numel(whole, size * part.numel(), whole_name, op,
              fmt::format(" ({} ranks x {}){}", size, part.numel(),
                          exchanged ? "; the arguments are (input, output), input first (torch's "
                                      "*_into_tensor and *_tensor collectives take the output "
                                      "first)"
                                    : ""));
}

template <typename F>
Work start(CommState& s, Call& c, F&& run) {
  detail::free_finished_buffers();
  s.health->check(s.name);
  const CommunicatorBackend backend = s.spec.for_device(c.device.type);
  MESHFUSE_CHECK(!c.reduction || c.dtype != DType::Bool, ErrorCode::InvalidArgument,
                 "{}: cannot reduce bool tensors (use u8)", op_name(c.op));
  if (c.reduction) detail::check_reducible(c.dtype, *c.reduction, op_name(c.op));
  detail::CommImpl& impl = s.impl(backend);
  impl.check_device(c.device);

  CommRecord record;
  record.op = c.op;
  record.backend = backend;
  record.team = s.team;
  record.rank = s.rank;
  record.root = c.root;
  record.source = c.source;
  record.reduction = c.reduction;
  record.dtype = c.dtype;
  record.count = c.count;
  record.bytes = c.bytes;
  record.seq = s.seq++;
  record.uneven = !all_equal(c.in_counts) || !all_equal(c.out_counts);
  s.remember(record);

  c.exchanged = true;
  try {
    if (s.check && c.op != CommOp::Send && c.op != CommOp::Recv && c.op != CommOp::SendRecv) {
      const int n = s.size();
      detail::Meta meta{
          {static_cast<std::int32_t>(c.op), static_cast<std::int32_t>(c.dtype), c.root,
           c.reduction ? static_cast<std::int32_t>(*c.reduction) : -1, c.split_sizes, 0, c.count},
          c.in_counts,
          c.out_counts};
      meta.in.resize(n, 0);
      meta.out.resize(n, 0);
      s.exchange_meta(impl, meta);
    }
    auto work = std::make_shared<detail::WorkState>();
    work->impl = run(impl);
    work->record = std::move(record);
    work->comm = s.impls.at(backend);
    work->health = s.health;
    work->timeout = s.timeout;
    return Work(std::move(work));
  } catch (const Error& e) {
    detail::rethrow_for(record, e, s.timeout, *s.health, &impl);
  }
}

std::int64_t bytes_of(std::int64_t elements, DType dtype) {
  return elements * static_cast<std::int64_t>(element_size(dtype));
}

}  // namespace

void Communicator::count_failed_collective() {
  if (state_->check) ++state_->exchanges;
}

Work Communicator::all_reduce(const TensorView& tensor, ReduceOp op, const Stream& stream) {
  Call c(*state_, CommOp::AllReduce, {{"tensor", tensor}});
  c.reduction = op;
  check_tensors(c, stream);
  c.count = tensor.numel();
  c.bytes = bytes_of(c.count, c.dtype);
  return start(*state_, c,
               [&](detail::CommImpl& impl) { return impl.all_reduce(flat(tensor), op, c.stream); });
}

Work Communicator::broadcast(const TensorView& tensor, int root, const Stream& stream) {
  Call c(*state_, CommOp::Broadcast, {{"tensor", tensor}});
  check_rank(root, size(), "root", c.op);
  c.root = root;
  check_tensors(c, stream);
  c.count = tensor.numel();
  c.bytes = bytes_of(c.count, c.dtype);
  return start(*state_, c, [&](detail::CommImpl& impl) {
    return impl.broadcast(flat(tensor), root, c.stream);
  });
}

Work Communicator::reduce(const TensorView& tensor, int root, ReduceOp op, const Stream& stream) {
  Call c(*state_, CommOp::Reduce, {{"tensor", tensor}});
  check_rank(root, size(), "root", c.op);
  c.root = root;
  c.reduction = op;
  check_tensors(c, stream);
  c.count = tensor.numel();
  c.bytes = bytes_of(c.count, c.dtype);
  return start(*state_, c, [&](detail::CommImpl& impl) {
    return impl.reduce(flat(tensor), root, op, c.stream);
  });
}

Work Communicator::all_gather(const TensorView& input, const TensorView& output,
                              const Stream& stream) {
  Call c(*state_, CommOp::AllGather, {{"input", input}, {"output", output}});
  check_tensors(c, stream);
  check_parts(output, "output", input, size(), c.op);
  c.count = input.numel();
  c.bytes = bytes_of(output.numel(), c.dtype);
  c.out_counts.assign(size(), input.numel());
  check_overlap("output", output, "input", input, elements_before(c.out_counts, rank()), c.op);
  return start(*state_, c, [&](detail::CommImpl& impl) {
    return impl.all_gather(flat(input), flat(output), c.out_counts, c.stream);
  });
}

Work Communicator::all_gather(const TensorView& input, const TensorView& output,
                              const std::vector<std::int64_t>& output_split_sizes,
                              const Stream& stream) {
  Call c(*state_, CommOp::AllGather, {{"input", input}, {"output", output}});
  check_tensors(c, stream);
  check_same_rows(input, output, c.op);
  c.split_sizes = true;
  c.out_counts = split_elements(output_split_sizes, output, size(), "output_split_sizes", c.op);
  check_numel(input, c.out_counts[rank()], "input", c.op);
  check_overlap("output", output, "input", input, elements_before(c.out_counts, rank()), c.op);
  c.count = input.numel();
  c.bytes = bytes_of(output.numel(), c.dtype);
  return start(*state_, c, [&](detail::CommImpl& impl) {
    return impl.all_gather(flat(input), flat(output), c.out_counts, c.stream);
  });
}

Work Communicator::reduce_scatter(const TensorView& input, const TensorView& output, ReduceOp op,
                                  const Stream& stream) {
  Call c(*state_, CommOp::ReduceScatter, {{"input", input}, {"output", output}});
  c.reduction = op;
  check_tensors(c, stream);
  check_parts(input, "input", output, size(), c.op);
  c.count = output.numel();
  c.bytes = bytes_of(input.numel(), c.dtype);
  c.in_counts.assign(size(), output.numel());
  check_overlap("input", input, "output", output, elements_before(c.in_counts, rank()), c.op);
  return start(*state_, c, [&](detail::CommImpl& impl) {
    return impl.reduce_scatter(flat(input), flat(output), c.in_counts, op, c.stream);
  });
}

Work Communicator::reduce_scatter(const TensorView& input, const TensorView& output,
                                  const std::vector<std::int64_t>& input_split_sizes, ReduceOp op,
                                  const Stream& stream) {
  Call c(*state_, CommOp::ReduceScatter, {{"input", input}, {"output", output}});
  c.reduction = op;
  check_tensors(c, stream);
  check_same_rows(input, output, c.op);
  c.split_sizes = true;
  c.in_counts = split_elements(input_split_sizes, input, size(), "input_split_sizes", c.op);
  check_numel(output, c.in_counts[rank()], "output", c.op);
  check_overlap("input", input, "output", output, elements_before(c.in_counts, rank()), c.op);
  c.count = output.numel();
  c.bytes = bytes_of(input.numel(), c.dtype);
  return start(*state_, c, [&](detail::CommImpl& impl) {
    return impl.reduce_scatter(flat(input), flat(output), c.in_counts, op, c.stream);
  });
}

Work Communicator::gather(const TensorView& input, const TensorView& output, int root,
                          const Stream& stream) {
  Call c(*state_, CommOp::Gather, {{"input", input}});
  check_rank(root, size(), "root", c.op);
  const bool is_root = rank() == root;
  if (is_root) c.tensors.emplace_back("output", output);
  c.root = root;
  check_tensors(c, stream);
  if (is_root) {
    check_parts(output, "output", input, size(), c.op);
    check_overlap("output", output, "input", input, -1, c.op);
  }
  c.count = input.numel();
  c.bytes = bytes_of(is_root ? output.numel() : c.count, c.dtype);
  return start(*state_, c, [&](detail::CommImpl& impl) {
    return impl.gather(flat(input), is_root ? flat(output) : TensorView{}, root, c.stream);
  });
}

Work Communicator::scatter(const TensorView& input, const TensorView& output, int root,
                           const Stream& stream) {
  Call c(*state_, CommOp::Scatter, {{"output", output}});
  check_rank(root, size(), "root", c.op);
  const bool is_root = rank() == root;
  if (is_root) c.tensors.emplace_back("input", input);
  c.root = root;
  check_tensors(c, stream);
  if (is_root) {
    check_parts(input, "input", output, size(), c.op);
    check_overlap("input", input, "output", output, -1, c.op);
  }
  c.count = output.numel();
  c.bytes = bytes_of(is_root ? input.numel() : c.count, c.dtype);
  return start(*state_, c, [&](detail::CommImpl& impl) {
    return impl.scatter(is_root ? flat(input) : TensorView{}, flat(output), root, c.stream);
  });
}

Work Communicator::all_to_all(const TensorView& input, const TensorView& output,
                              const std::vector<std::int64_t>& input_split_sizes,
                              const std::vector<std::int64_t>& output_split_sizes,
                              const Stream& stream) {
  Call c(*state_, CommOp::AllToAll, {{"input", input}, {"output", output}});
  check_tensors(c, stream);
  const int n = size();
  if (input_split_sizes.empty() && output_split_sizes.empty()) {
    MESHFUSE_CHECK(input.numel() % n == 0, ErrorCode::InvalidArgument,
                   "all_to_all: without split sizes the input {} must divide into {} blocks",
                   input.str(), n);
    check_numel(output, input.numel(), "output", c.op);
    c.in_counts.assign(n, input.numel() / n);
    c.out_counts = c.in_counts;
  } else {
    check_same_rows(input, output, c.op);
    c.split_sizes = true;
    c.in_counts = split_elements(input_split_sizes, input, n, "input_split_sizes", c.op);
    c.out_counts = split_elements(output_split_sizes, output, n, "output_split_sizes", c.op);
  }
  check_overlap("input", input, "output", output, -1, c.op);
  c.count = input.numel();
  c.bytes = bytes_of(std::max(input.numel(), output.numel()), c.dtype);
  return start(*state_, c, [&](detail::CommImpl& impl) {
    return impl.all_to_all(flat(input), flat(output), c.in_counts, c.out_counts, c.stream);
  });
}

Work Communicator::send(const TensorView& tensor, int dst, int tag, const Stream& stream) {
  Call c(*state_, CommOp::Send, {{"tensor", tensor}});
  check_rank(dst, size(), "destination", c.op);
  MESHFUSE_CHECK(dst != rank() && tag >= 0, ErrorCode::InvalidArgument,
                 "send: to rank {} with tag {} from rank {} (no sends to self, tags >= 0)", dst,
                 tag, rank());
  c.root = dst;
  check_tensors(c, stream);
  c.count = tensor.numel();
  c.bytes = bytes_of(c.count, c.dtype);
  return start(*state_, c,
               [&](detail::CommImpl& impl) { return impl.send(flat(tensor), dst, tag, c.stream); });
}

Work Communicator::recv(const TensorView& tensor, int src, int tag, const Stream& stream) {
  Call c(*state_, CommOp::Recv, {{"tensor", tensor}});
  check_rank(src, size(), "source", c.op);
  MESHFUSE_CHECK(src != rank() && tag >= 0, ErrorCode::InvalidArgument,
                 "recv: from rank {} with tag {} on rank {} (no receives from self, tags >= 0)",
                 src, tag, rank());
  c.root = src;
  check_tensors(c, stream);
  c.count = tensor.numel();
  c.bytes = bytes_of(c.count, c.dtype);
  return start(*state_, c,
               [&](detail::CommImpl& impl) { return impl.recv(flat(tensor), src, tag, c.stream); });
}

Work Communicator::send_recv(const TensorView& send_tensor, int dst, const TensorView& recv_tensor,
                             int src, int tag, const Stream& stream) {
  Call c(*state_, CommOp::SendRecv, {{"send_tensor", send_tensor}, {"recv_tensor", recv_tensor}});
  check_rank(dst, size(), "destination", c.op);
  check_rank(src, size(), "source", c.op);
  MESHFUSE_CHECK(dst != rank() && src != rank() && tag >= 0, ErrorCode::InvalidArgument,
                 "send_recv: to rank {} and from rank {} with tag {} on rank {} (no transfers to "
                 "or from self, tags >= 0)",
                 dst, src, tag, rank());
  c.root = dst;
  c.source = src;
  check_tensors(c, stream);
  check_overlap("send_tensor", send_tensor, "recv_tensor", recv_tensor, -1, c.op);
  c.count = send_tensor.numel();
  c.bytes = bytes_of(std::max(send_tensor.numel(), recv_tensor.numel()), c.dtype);
  return start(*state_, c, [&](detail::CommImpl& impl) {
    return impl.send_recv(flat(send_tensor), dst, flat(recv_tensor), src, tag, c.stream);
  });
}

Work Communicator::barrier(const Stream& stream) {
  Call c(*state_, CommOp::Barrier, {});
  check_tensors(c, stream);
  return start(*state_, c, [&](detail::CommImpl& impl) { return impl.barrier(c.stream); });
}

}  // namespace meshfuse
