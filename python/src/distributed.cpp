// Communicators in the _meshfuse extension: init_communicator (from the launcher's environment),
// LocalWorld / run_local (ranks as threads), the collectives on DLPack arrays, Work, CommRecord.
// Collectives and waits release the GIL. The arrays of an operation stay alive until it completes.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "arrays.h"
#include "meshfuse/distributed/communicator.h"
#include "options.h"

namespace meshfuse::python {

// A scalar argument of a collective (op, root, split sizes, stream), taken as any object and
// converted by the binding (Arg::as) once ArgumentChecks is armed, so that a wrong type (op=5,
// root="0") counts as this rank's failed collective: refused by nanobind before the binding ran,
// it was not counted, and the rank's next collective paired with the others' current one.
template <typename T>
struct Arg {
  nb::object object;

  T as(std::string_view op, std::string_view name, std::string_view expected) const {
    T value{};
    if (!nb::try_cast(object, value))
      throw nb::type_error(fmt::format("{}: '{}' must be {}, got {}", op, name, expected,
                                       Py_TYPE(object.ptr())->tp_name)
                               .c_str());
    return value;
  }
};

}  // namespace meshfuse::python

namespace nanobind::detail {

template <typename T>
struct type_caster<meshfuse::python::Arg<T>> {
  NB_TYPE_CASTER(meshfuse::python::Arg<T>, make_caster<T>::Name)  // stubs show T

  bool from_python(handle src, uint8_t, cleanup_list*) noexcept {
    value.object = borrow<object>(src);
    return true;
  }
};

}  // namespace nanobind::detail

namespace meshfuse::python {
namespace {

using namespace nb::literals;
using In = Input;    // an array the collective reads: one that is not an array is named (arrays.h)
using Out = Output;  // an array the collective writes: a read-only one is named too
using Splits = std::optional<std::vector<std::int64_t>>;
using Kept = nb::ndarray<nb::ro>;

// A Work and the arrays it reads and writes, which the backend uses while the operation is in
// flight (Work::in_flight: after a wait that timed out, gloo and mpi may still write them). A
// PyWork dropped before then (a collective whose Work was never kept) hands them to `orphans`,
// freed by a later operation's start once the backend is done with them: freed with the handle,
// they were written after their memory went back to Python.
struct PyWork {
  PyWork(Work work, std::vector<Kept> arrays) : work(std::move(work)), arrays(std::move(arrays)) {}
  PyWork(PyWork&&) = default;
  PyWork& operator=(PyWork&&) = default;
  ~PyWork();

  Work work;
  std::vector<Kept> arrays;
};

struct Orphan {
  Work work;
  std::vector<Kept> arrays;
};

// Never destroyed: its arrays must not be released after the interpreter has ended.
std::vector<Orphan>& orphans() {
  static auto* kept = new std::vector<Orphan>();
  return *kept;
}

PyWork::~PyWork() {
  if (!arrays.empty() && work.in_flight())
    orphans().push_back({std::move(work), std::move(arrays)});
}

void free_finished_orphans() {
  std::erase_if(orphans(), [](const Orphan& o) { return !o.work.in_flight(); });
}

std::chrono::milliseconds milliseconds(double seconds) {
  MESHFUSE_CHECK(std::isfinite(seconds) && seconds > 0 && seconds * 1e3 <= kMaxTimeout.count(),
                 ErrorCode::InvalidArgument,
                 "communicator: timeout: expected seconds > 0 and at most a year ({}), got {}",
                 kMaxTimeout.count() / 1000, seconds);
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(seconds * 1e3)));
}

CommOptions options(const std::string& backend, double timeout, bool check) {
  CommOptions o;
  o.backend = backend;
  o.timeout = milliseconds(timeout);
  o.check = check;
  return o;
}

// The binding's own checks of a collective's arguments (their conversion to views, the reduce op's
// name). A collective that fails them is counted as one that fails the C++ call's checks
// (Communicator::count_failed_collective): uncounted, this rank's next collective would pair with
// the peers' current one.
class ArgumentChecks {
 public:
  explicit ArgumentChecks(Communicator& c) : c_(c) {}
  ArgumentChecks(const ArgumentChecks&) = delete;
  ArgumentChecks& operator=(const ArgumentChecks&) = delete;
  ~ArgumentChecks() {
    if (!passed_ && std::uncaught_exceptions() > exceptions_) c_.count_failed_collective();
  }
  void passed() { passed_ = true; }

 private:
  Communicator& c_;
  bool passed_ = false;
  int exceptions_ = std::uncaught_exceptions();
};

using ReduceArg = Arg<std::string>;
using RankArg = Arg<int>;
using SplitsArg = Arg<std::vector<std::int64_t>>;  // or None (its default says so in the stubs)
using StreamArg = Arg<std::uintptr_t>;

ReduceOp reduce_op(const ReduceArg& op, std::string_view collective) {
  return parse_reduce_op_arg(op.as(collective, "op", "a str ('sum', 'avg', 'prod', 'min', 'max')"),
                             collective);
}

int rank_of(const RankArg& root, std::string_view collective) {
  return root.as(collective, "root", "an int (a rank of the team)");
}

Splits splits_of(const SplitsArg& splits, std::string_view collective, std::string_view name) {
  if (splits.object.is_none()) return std::nullopt;
  return splits.as(collective, name, "a list of ints (rows per rank) or None");
}

Stream stream_of(const StreamArg& stream, const TensorView& on, std::string_view collective) {
  return stream_on(on.device(),
                   stream.as(collective, "stream", "an int (a cudaStream_t; 0: the default)"));
}

// Calls `op` with the GIL released; the Work holds `arrays`. `checks`: a collective's, passed.
template <typename Op>
PyWork run(Op&& op, std::vector<Kept> arrays, ArgumentChecks* checks = nullptr) {
  free_finished_orphans();
  if (checks) checks->passed();
  Work work;
  {
    nb::gil_scoped_release release;
    work = op();
  }
  return {std::move(work), std::move(arrays)};
}

// The arrays of `args` to keep (In, Out, and optional ones when given).
std::vector<Kept> kept(std::initializer_list<const In*> ins,
                       std::initializer_list<const Out*> outs = {}) {
  std::vector<Kept> k;
  for (const In* in : ins)
    if (in) k.push_back(in->array);
  for (const Out* out : outs)
    if (out) k.emplace_back(out->array);
  return k;
}

void bind_record(nb::module_& m) {
  nb::class_<CommRecord>(m, "CommRecord",
                         "What one communication did, as seen from one rank; str() prints it.")
      .def_prop_ro("op", [](const CommRecord& r) { return std::string(to_string(r.op)); })
      .def_prop_ro("backend", [](const CommRecord& r) { return std::string(to_string(r.backend)); })
      .def_ro("team", &CommRecord::team)
      .def_ro("rank", &CommRecord::rank)
      .def_ro("root", &CommRecord::root)
      .def_ro("source", &CommRecord::source)
      .def_prop_ro("reduction",
                   [](const CommRecord& r) -> std::optional<std::string> {
                     if (!r.reduction) return std::nullopt;
                     return std::string(to_string(*r.reduction));
                   })
      .def_prop_ro("dtype", [](const CommRecord& r) { return std::string(to_string(r.dtype)); })
      .def_ro("count", &CommRecord::count)
      .def_ro("bytes", &CommRecord::bytes)
      .def_ro("seq", &CommRecord::seq)
      .def_ro("uneven", &CommRecord::uneven)
      .def("__str__", &CommRecord::to_string)
      .def("__repr__", [](const CommRecord& r) { return "<CommRecord " + r.to_string() + ">"; });

  nb::class_<PyWork>(m, "Work", "The handle of one asynchronous communication.")
      .def(
          "wait",
          [](PyWork& w, std::optional<double> timeout) {
            nb::gil_scoped_release release;
            if (timeout)
              w.work.wait(milliseconds(*timeout));
            else
              w.work.wait();
          },
          "timeout"_a = nb::none(),
          "Blocks until done (timeout in seconds; default: the communicator's). Raises the "
          "operation's error. A timeout that expires fails the communicator (a transfer cannot be "
          "cancelled): to poll, use is_completed().")
      .def(
          "is_completed", [](const PyWork& w) { return w.work.is_completed(); },
          "Whether the operation has finished (successfully or not), without blocking.")
      .def_prop_ro(
          "record", [](const PyWork& w) { return w.work.record(); },
          "The CommRecord of the operation: op, backend, dtype, bytes, team, sequence number.")
      .def("__repr__", [](const PyWork& w) {
        return "<Work " + w.work.record().to_string() +
               (w.work.is_completed() ? ", completed>" : ", pending>");
      });
}

void bind_communicator(nb::module_& m) {
  nb::class_<Communicator>(m, "Communicator",
                           "A team of ranks and the backends that move its arrays (see "
                           "include/meshfuse/distributed/communicator.h).")
      .def_prop_ro("rank", &Communicator::rank, "This rank's index in the team, 0 .. size - 1.")
      .def_prop_ro("size", &Communicator::size, "The team's number of ranks.")
      .def_prop_ro("team", &Communicator::team,
                   "The team's ranks as world ranks, in team order (list of int).")
      .def_prop_ro(
          "spec", [](const Communicator& c) { return c.spec().str(); },
          "The backend of each device type, e.g. 'cpu:gloo,cuda:nccl'.")
      .def(
          "backend",
          [](const Communicator& c, const std::string& device) {
            return std::string(to_string(c.backend(Device::parse(device).type)));
          },
          "device"_a = "cpu", "The backend serving a device type ('cpu', 'cuda').")
      .def_prop_rw(
          "timeout", [](const Communicator& c) { return c.timeout().count() / 1e3; },
          [](Communicator& c, double seconds) { c.set_timeout(milliseconds(seconds)); },
          "Seconds a rank waits for its peers.")
      .def_prop_rw("checks", &Communicator::checks, &Communicator::set_checks,
                   "The cross-rank metadata check before each collective.")
      .def_prop_rw("history_size", &Communicator::history_size, &Communicator::set_history_size,
                   "How many CommRecords history() keeps (0: none).")
      .def("history", &Communicator::history, "The last history_size records, oldest first.")
      .def("split", &Communicator::split, "color"_a, "key"_a = 0,
           nb::call_guard<nb::gil_scoped_release>(),
           "The team of the ranks that pass the same color, ordered by key then rank (MPI's "
           "Comm_split; collective). Returns None on a rank that passes a negative color.")
      .def("new_group", &Communicator::new_group, "ranks"_a,
           nb::call_guard<nb::gil_scoped_release>(),
           "The team of `ranks` (ranks of this team, in the new team's order, no duplicates; "
           "torch.distributed.new_group). Collective: every rank of this team calls it with the "
           "same list (checked: InvalidArgumentError on every rank when the lists differ), members "
           "and non-members alike; non-members get None. A rank that does not call it leaves the "
           "others waiting until the timeout (CommunicationTimeoutError).")
      .def("mesh_teams", &Communicator::mesh_teams, "mesh"_a,
           nb::call_guard<nb::gil_scoped_release>(),
           "The teams of `mesh` (a DeviceMesh over this team's ranks), one per mesh dimension: "
           "team m holds the ranks that share every coordinate but m, ordered along m (DTensor's "
           "DeviceMesh.get_group(m)). Split on the first call for a mesh (collective) and kept: "
           "later calls return the same teams. Raises ValueError for a mesh of other ranks.")
      .def(
          "all_reduce",
          [](Communicator& c, Out t, ReduceArg op, StreamArg stream) {
            ArgumentChecks checks(c);
            const TensorView v = view(t, "all_reduce", "tensor");
            const ReduceOp r = reduce_op(op, "all_reduce");
            const Stream s = stream_of(stream, v, "all_reduce");
            return run([&] { return c.all_reduce(v, r, s); }, kept({}, {&t}), &checks);
          },
          "tensor"_a, "op"_a = "sum", "stream"_a = 0,
          "In place: tensor = op over the ranks' tensors (the same shape and dtype on every rank). "
          "op: 'sum', 'avg', 'prod', 'min' or 'max' (NaN wins min and max). stream: a "
          "cudaStream_t as an int for CUDA arrays (0: the default stream). Returns a Work; every "
          "rank makes the same calls in the same order (with checks on, a mismatch raises "
          "InvalidArgumentError on every rank).")
      .def(
          "broadcast",
          [](Communicator& c, Out t, RankArg root, StreamArg stream) {
            ArgumentChecks checks(c);
            const TensorView v = view(t, "broadcast", "tensor");
            const int r = rank_of(root, "broadcast");
            const Stream s = stream_of(stream, v, "broadcast");
            return run([&] { return c.broadcast(v, r, s); }, kept({}, {&t}), &checks);
          },
          "tensor"_a, "root"_a, "stream"_a = 0,
          "In place: every rank's tensor = root's (root: a rank of this team). Returns a Work.")
      .def(
          "reduce",
          [](Communicator& c, Out t, RankArg root, ReduceArg op, StreamArg stream) {
            ArgumentChecks checks(c);
            const TensorView v = view(t, "reduce", "tensor");
            const int to = rank_of(root, "reduce");
            const ReduceOp r = reduce_op(op, "reduce");
            const Stream s = stream_of(stream, v, "reduce");
            return run([&] { return c.reduce(v, to, r, s); }, kept({}, {&t}), &checks);
          },
          "tensor"_a, "root"_a, "op"_a = "sum", "stream"_a = 0,
          "In place on root: tensor = op over the ranks' tensors; the others' are left as they "
          "were. op as all_reduce. Returns a Work.")
      .def(
          "all_gather",
          [](Communicator& c, In input, Out output, SplitsArg split_sizes, StreamArg stream) {
            ArgumentChecks checks(c);
            const TensorView in = view(input, "all_gather", "input"),
                             out = view(output, "all_gather", "output");
            const Splits splits = splits_of(split_sizes, "all_gather", "output_split_sizes");
            const Stream s = stream_of(stream, in, "all_gather");
            return run(
                [&] {
                  return splits ? c.all_gather(in, out, *splits, s) : c.all_gather(in, out, s);
                },
                kept({&input}, {&output}), &checks);
          },
          "input"_a, "output"_a, "output_split_sizes"_a = nb::none(), "stream"_a = 0,
          "output = the ranks' inputs concatenated in rank order. Without output_split_sizes, "
          "equal shards: output.size == size * input.size (torch all_gather_into_tensor); with "
          "them (a list of size ints, the same on every rank), rank r contributes "
          "output_split_sizes[r] rows (its input.shape[0]) and output holds their sum, trailing "
          "dims as input's. Returns a Work.")
      .def(
          "reduce_scatter",
          [](Communicator& c, In input, Out output, SplitsArg split_sizes, ReduceArg op,
             StreamArg stream) {
            ArgumentChecks checks(c);
            const TensorView in = view(input, "reduce_scatter", "input"),
                             out = view(output, "reduce_scatter", "output");
            const Splits splits = splits_of(split_sizes, "reduce_scatter", "input_split_sizes");
            const ReduceOp r = reduce_op(op, "reduce_scatter");
            const Stream s = stream_of(stream, in, "reduce_scatter");
            return run(
                [&] {
                  return splits ? c.reduce_scatter(in, out, *splits, r, s)
                                : c.reduce_scatter(in, out, r, s);
                },
                kept({&input}, {&output}), &checks);
          },
          "input"_a, "output"_a, "input_split_sizes"_a = nb::none(), "op"_a = "sum", "stream"_a = 0,
          "input is reduced (op as all_reduce) over the ranks and rank r keeps block r in output. "
          "Without input_split_sizes, equal blocks: input.size == size * output.size (torch "
          "reduce_scatter_tensor); with them (the same on every rank), rank r keeps "
          "input_split_sizes[r] rows (its output.shape[0]) and input.shape[0] is their sum. "
          "Returns a Work.")
      .def(
          "gather",
          [](Communicator& c, In input, const std::optional<Out>& output, RankArg root,
             StreamArg stream) {
            ArgumentChecks checks(c);
            const TensorView in = view(input, "gather", "input"),
                             out = view(output, "gather", "output");
            const int r = rank_of(root, "gather");
            const Stream s = stream_of(stream, in, "gather");
            return run([&] { return c.gather(in, out, r, s); },
                       kept({&input}, {output ? &*output : nullptr}), &checks);
          },
          "input"_a, "output"_a.none(), "root"_a, "stream"_a = 0,
          "output is only used on the root (None elsewhere).")
      .def(
          "scatter",
          [](Communicator& c, const std::optional<In>& input, Out output, RankArg root,
             StreamArg stream) {
            ArgumentChecks checks(c);
            const TensorView in = view(input, "scatter", "input"),
                             out = view(output, "scatter", "output");
            const int r = rank_of(root, "scatter");
            const Stream s = stream_of(stream, out, "scatter");
            return run([&] { return c.scatter(in, out, r, s); },
                       kept({input ? &*input : nullptr}, {&output}), &checks);
          },
          "input"_a.none(), "output"_a, "root"_a, "stream"_a = 0,
          "input is only used on the root (None elsewhere).")
      .def(
          "all_to_all",
          [](Communicator& c, In input, Out output, SplitsArg input_split_sizes,
             SplitsArg output_split_sizes, StreamArg stream) {
            ArgumentChecks checks(c);
            const TensorView in = view(input, "all_to_all", "input"),
                             out = view(output, "all_to_all", "output");
            const Splits in_splits =
                splits_of(input_split_sizes, "all_to_all", "input_split_sizes");
            const Splits out_splits =
                splits_of(output_split_sizes, "all_to_all", "output_split_sizes");
            const Stream s = stream_of(stream, in, "all_to_all");
            return run(
                [&] {
                  return c.all_to_all(in, out, in_splits.value_or(std::vector<std::int64_t>{}),
                                      out_splits.value_or(std::vector<std::int64_t>{}), s);
                },
                kept({&input}, {&output}), &checks);
          },
          "input"_a, "output"_a, "input_split_sizes"_a = nb::none(),
          "output_split_sizes"_a = nb::none(), "stream"_a = 0,
          "Rank r sends rows [sum(in[:s]), + in[s]) of its input to rank s, which stores them at "
          "rows [sum(out[:r]), + out[r]) of its output (torch all_to_all_single, input splits "
          "first). No split lists: equal blocks of size / team size elements. Every rank's "
          "out[r] must equal rank r's in[this rank] (checked). Returns a Work.")
      .def(
          "send",
          [](Communicator& c, In t, int dst, int tag, std::uintptr_t stream) {
            const TensorView v = view(t, "send", "tensor");
            return run([&] { return c.send(v, dst, tag, stream_on(v.device(), stream)); },
                       kept({&t}));
          },
          "tensor"_a, "dst"_a, "tag"_a = 0, "stream"_a = 0,
          "Sends tensor to rank dst, matched by (this rank, tag) with its recv (same bytes). Keep "
          "tensor alive and unchanged until the returned Work completes.")
      .def(
          "recv",
          [](Communicator& c, Out t, int src, int tag, std::uintptr_t stream) {
            const TensorView v = view(t, "recv", "tensor");
            return run([&] { return c.recv(v, src, tag, stream_on(v.device(), stream)); },
                       kept({}, {&t}));
          },
          "tensor"_a, "src"_a, "tag"_a = 0, "stream"_a = 0,
          "Receives into tensor what rank src sends with this tag (the same number of bytes, "
          "else CommunicationError). Returns a Work; the data is there once it completes.")
      .def(
          "send_recv",
          [](Communicator& c, In send, int dst, Out recv, int src, int tag, std::uintptr_t stream) {
            const TensorView out = view(send, "send_recv", "send_tensor"),
                             in = view(recv, "send_recv", "recv_tensor");
            return run(
                [&] {
                  return c.send_recv(out, dst, in, src, tag, stream_on(out.device(), stream));
                },
                kept({&send}, {&recv}));
          },
          "send_tensor"_a, "dst"_a, "recv_tensor"_a, "src"_a, "tag"_a = 0, "stream"_a = 0,
          "Sends send_tensor to dst and receives recv_tensor from src as one operation (a ring "
          "step; on nccl one group, which separate send and recv calls cannot be).")
      .def(
          "barrier",
          [](Communicator& c, Arg<std::string> device, StreamArg stream) {
            ArgumentChecks checks(c);
            const Device d =
                Device::parse(device.as("barrier", "device", "a str ('cpu', 'cuda', 'cuda:1')"));
            const Stream s = stream_on(
                d, stream.as("barrier", "stream", "an int (a cudaStream_t; 0: the default)"));
            return run([&] { return c.barrier(s); }, {}, &checks);
          },
          "device"_a = "cpu", "stream"_a = 0,
          "Completes once every rank has called it, on the backend of `device`.");

  m.def(
      "init_communicator",
      [](const std::string& backend, double timeout, bool check) {
        const CommOptions o = options(backend, timeout, check);
        nb::gil_scoped_release release;
        return init_communicator(o);
      },
      "backend"_a = "", "timeout"_a = 300.0, "check"_a = true,
      "The world communicator of this process from its launcher's environment (torchrun / "
      "meshfuse launch, mpirun, srun). backend: 'cpu:gloo,cuda:nccl' style, or one name; empty: "
      "the default (cpu:gloo,cuda:nccl). Once per process: a second call while the first one's "
      "communicator (or a team split from it) lives raises ValueError.");

  nb::class_<LocalWorld>(m, "LocalWorld",
                         "N ranks as threads of this process (the local backend); each thread "
                         "takes its rank's communicator once.")
      .def(
          "__init__",
          [](LocalWorld* w, int size, double timeout, bool check) {
            new (w) LocalWorld(size, options("", timeout, check));
          },
          "size"_a, "timeout"_a = 300.0, "check"_a = true)
      .def_prop_ro("size", &LocalWorld::size, "The number of ranks.")
      .def("communicator", &LocalWorld::communicator, "rank"_a,
           "Rank `rank`'s Communicator (once per rank: a second call raises "
           "InvalidArgumentError), for the thread that runs that rank.")
      .def("abort", &LocalWorld::abort, "why"_a, nb::call_guard<nb::gil_scoped_release>(),
           "Breaks the world for good: ranks waiting in (or later starting) a collective or a "
           "recv fail at once with CommunicationError saying `why`.");

  m.def(
      "run_local",
      [](int size, nb::callable fn, double timeout, bool check) {
        MESHFUSE_CHECK(size >= 1, ErrorCode::InvalidArgument, "run_local: size {} is not positive",
                       size);
        std::vector<nb::object> results(size);
        {
          // Each rank's fn gets the shared_ptr of its communicator (not a reference): what fn
          // makes of it, a MultiDeviceExecutor, may keep it, and the Python object then owns it
          // past run_local.
          nb::gil_scoped_release release;
          run_local(
              size,
              [&](const std::shared_ptr<Communicator>& comm) {
                nb::gil_scoped_acquire acquire;
                try {
                  results[comm->rank()] = fn(comm);
                } catch (nb::python_error& e) {
                  // The rank's own exception goes on (run_local rethrows the first one raised),
                  // its type kept; a note says which rank raised it.
                  const nb::object add_note = nb::getattr(e.value(), "add_note", nb::none());
                  if (!add_note.is_none())
                    add_note("raised by rank " + std::to_string(comm->rank()) + " of run_local");
                  throw;
                }
              },
              options("", timeout, check),
              // Ctrl-C: Python runs its signal handlers only when asked, and this thread waits
              // in C++; the KeyboardInterrupt aborts the world and comes back once ranks return.
              [] {
                nb::gil_scoped_acquire acquire;
                if (PyErr_CheckSignals() != 0) throw nb::python_error();
              });
        }
        nb::list out;
        for (const nb::object& result : results) out.append(result);
        return out;
      },
      "size"_a, "fn"_a, "timeout"_a = 300.0, "check"_a = true,
      "Runs fn(communicator) for ranks 0..size-1 on threads of a LocalWorld, joins them and "
      "returns the list of their results, rank by rank; re-raises the exception raised first, as "
      "it was raised (type and message), with a note naming the rank; the other ranks stop "
      "waiting for that one at once (CommunicationFailure). Ctrl-C (KeyboardInterrupt) makes "
      "the ranks waiting in communications fail at once, and is raised once they return. The "
      "communicators stay valid after fn returns (e.g. kept by a MultiDeviceExecutor).");
}

}  // namespace

void bind_distributed(nb::module_& m) {
  m.def(
      "communicator_backends",
      [] {
        std::vector<std::string> names;
        for (CommunicatorBackend b : {CommunicatorBackend::Local, CommunicatorBackend::Gloo,
                                      CommunicatorBackend::Mpi, CommunicatorBackend::Nccl})
          if (communicator_backend_built(b)) names.emplace_back(to_string(b));
        return names;
      },
      "The communicator backends in this build.");
  m.def(
      "nccl_library", &nccl_library,
      "The NCCL library of the nccl backend, e.g. 'NCCL 2.28.3 (libnccl.so.2)': opened at run "
      "time, so a process with torch imported first shares torch's NCCL. Raises meshfuse.Error "
      "when "
      "the build has no nccl backend or no NCCL library loads (MESHFUSE_NCCL_LIBRARY names one).");
  bind_record(m);
  bind_communicator(m);
}

}  // namespace meshfuse::python
