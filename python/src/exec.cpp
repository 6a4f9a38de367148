// The multi-device executor in the _meshfuse extension (include/meshfuse/exec/*.h): the Program
// builder and its Values, DeviceMesh, the placements, CommunicatorBackend,
// MultiDeviceExecutorParams, MultiDeviceExecutor and its Plan, grad, shard_tensor, gather_tensor.
// run() and gather_tensor() release the GIL: the ranks of run_local are threads of this process,
// and a rank waiting in a collective must let the others reach it.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "arrays.h"
#include "meshfuse/exec/autodiff.h"
#include "meshfuse/exec/executor.h"
#include "options.h"

namespace meshfuse::python {
namespace {

using namespace nb::literals;
using In = nb::ndarray<nb::ro>;

// A Value and the Python Program it belongs to. The C++ Value is an index alone, so a value of
// another program would be taken for whatever has its index here; holding the program lets the
// builder refuse it and lets repr() describe the value.
struct PyValue {
  Value value;
  nb::object program;
};

const Program& program_of(const PyValue& v) { return nb::cast<const Program&>(v.program); }

PyValue wrap(const Program& p, Value v) { return {v, nb::find(p)}; }

// `v` as an operand of `op` on `p`: undefined when absent (an optional operand given None).
Value operand(const Program& p, std::string_view op, std::string_view arg,
              const std::optional<PyValue>& v) {
  if (!v) return {};
  MESHFUSE_CHECK(v->program.is(nb::find(p)), ErrorCode::InvalidArgument,
                 "Program.{}: '{}' ({}) is a Value of another Program", op, arg,
                 program_of(*v).describe(v->value));
  return v->value;
}

template <typename T>
nb::tuple as_tuple(const std::vector<T>& items) {
  return nb::tuple(nb::cast(items));
}

// A dtype as Python spells it: meshfuse's names ('f32', 'bf16'; what Value.dtype and
// CommRecord.dtype return) or PyTorch's ('float32', 'bfloat16'), a torch.dtype, or anything
// numpy.dtype() takes (np.float32, np.dtype('int64')).
DType dtype_from(nb::handle h, std::string_view what) {
  std::string name;
  if (nb::isinstance<nb::str>(h)) {
    name = nb::cast<std::string>(h);
  } else if (kind_of(h) == ArrayKind::Torch) {  // torch.dtype: str() is "torch.float32"
    name = nb::cast<std::string>(nb::str(h));
    if (name.rfind("torch.", 0) == 0) name = name.substr(6);
  } else {
    try {
      name = nb::cast<std::string>(nb::module_::import_("numpy").attr("dtype")(h).attr("name"));
    } catch (nb::python_error&) {
      // Not a numpy dtype either; the error below names what came.
    }
  }
  const std::optional<DType> dtype = parse_dtype(name);
  MESHFUSE_CHECK(dtype.has_value(), ErrorCode::InvalidArgument,
                 "{}: dtype must be one of f32, f64, bf16, f16, i32, i64, u8, u32, bool (or "
                 "their numpy / torch names and dtypes), got {}",
                 what, nb::cast<std::string>(nb::repr(h)));
  return *dtype;
}

std::optional<DType> optional_dtype(nb::handle h, std::string_view what) {
  if (h.is_none()) return std::nullopt;
  return dtype_from(h, what);
}

// Placements as Python passes them: a list or tuple with one per mesh dimension, or a single one
// (a 1-D mesh's).
std::vector<Placement> placements_from(nb::handle h, std::string_view what) {
  Placement one;
  if (nb::try_cast(h, one)) return {one};
  std::vector<Placement> all;
  if ((nb::isinstance<nb::list>(h) || nb::isinstance<nb::tuple>(h)) && nb::try_cast(h, all))
    return all;
  throw Error(ErrorCode::InvalidArgument,
              std::string(what) +
                  ": placements must be Shard, Replicate or Partial, or a list of them (one per "
                  "mesh dimension), got " +
                  nb::cast<std::string>(nb::repr(h)));
}

std::vector<Placement> optional_placements(nb::handle h, std::string_view what) {
  if (h.is_none()) return {};
  return placements_from(h, what);
}

// A communicator backend as Python passes it: a CommunicatorBackend, its name, or None (none).
std::optional<CommunicatorBackend> backend_from(nb::handle h) {
  if (h.is_none()) return std::nullopt;
  if (nb::isinstance<nb::str>(h)) return parse_communicator_backend(nb::cast<std::string>(h));
  CommunicatorBackend b;
  if (nb::try_cast(h, b)) return b;
  throw Error(ErrorCode::InvalidArgument,
              "communicator_backend must be a CommunicatorBackend, 'local', 'gloo', 'mpi', "
              "'nccl' or None, got " +
                  nb::cast<std::string>(nb::repr(h)));
}

std::string quoted_input_names(const Program& p) {
  std::string names;
  for (Value in : p.inputs()) names += (names.empty() ? "'" : ", '") + p.info(in).name + "'";
  return names;
}

// run()'s inputs in Program::inputs() order: a list or tuple as given, or a dict by input name.
std::vector<nb::object> ordered_inputs(const Program& p, nb::handle inputs) {
  std::vector<nb::object> ordered;
  if (nb::isinstance<nb::dict>(inputs)) {
    const nb::dict d = nb::borrow<nb::dict>(inputs);
    // The keys that name no input (a typo, a stray array), named with the missing input.
    std::string unknown;
    for (auto [key, value] : d) {
      bool known = false;
      for (Value in : p.inputs())
        known = known ||
                (nb::isinstance<nb::str>(key) && nb::cast<std::string>(key) == p.info(in).name);
      if (!known) unknown += (unknown.empty() ? "" : ", ") + nb::cast<std::string>(nb::repr(key));
    }
    const std::string not_inputs =
        unknown.empty() ? "" : fmt::format("; given, not inputs: {}", unknown);
    for (Value in : p.inputs()) {
      const std::string& name = p.info(in).name;
      MESHFUSE_CHECK(d.contains(name), ErrorCode::InvalidArgument,
                     "MultiDeviceExecutor.run: no array for input {} (the program's inputs: {}{})",
                     p.describe(in), quoted_input_names(p), not_inputs);
      ordered.push_back(d[name.c_str()]);
    }
    MESHFUSE_CHECK(unknown.empty(), ErrorCode::InvalidArgument,
                   "MultiDeviceExecutor.run: {} arrays given by name, the program's inputs are "
                   "{}{}",
                   d.size(), quoted_input_names(p), not_inputs);
    return ordered;
  }
  // A single array is iterable too (by rows): only lists and tuples are taken as sequences.
  MESHFUSE_CHECK(nb::isinstance<nb::list>(inputs) || nb::isinstance<nb::tuple>(inputs),
                 ErrorCode::InvalidArgument,
                 "MultiDeviceExecutor.run: inputs must be a list of arrays (in the order of the "
                 "program's inputs {}) or a dict name -> array, got {}",
                 quoted_input_names(p), nb::cast<std::string>(nb::repr(inputs.type())));
  for (nb::handle h : inputs) ordered.push_back(nb::borrow(h));
  return ordered;
}

// `a` as a DLPack array; `what` names it in the error.
In array_from(nb::handle a, const std::function<std::string()>& what) {
  In array;
  MESHFUSE_CHECK(nb::try_cast(a, array), ErrorCode::InvalidArgument,
                 "{}: expected a DLPack array (torch, NumPy, CuPy, ...), got {}", what(),
                 nb::cast<std::string>(nb::repr(a.type())));
  return array;
}

template <typename P>
void bind_placement(nb::class_<P>& c) {
  c.def("__repr__", [](const P& p) { return to_string(Placement{p}); })
      .def(
          "__eq__", [](const P& a, const P& b) { return a == b; }, nb::is_operator())
      .def("__hash__",
           [](const P& p) { return std::hash<std::string>()(to_string(Placement{p})); });
}

void bind_mesh_and_placements(nb::module_& m) {
  nb::class_<DeviceMesh>(m, "DeviceMesh",
                         "Ranks in an n-dimensional grid (DTensor's DeviceMesh), the space "
                         "placements lay tensors on. DeviceMesh(ranks) is 1-D; with shape, the "
                         "ranks fill it in row-major order. Raises meshfuse.Error on an empty "
                         "mesh, sizes < 1, ranks that repeat or do not fill the shape.")
      .def(
          "__init__",
          [](DeviceMesh* self, std::vector<int> ranks,
             std::optional<std::vector<std::int64_t>> shape) {
            if (shape)
              new (self) DeviceMesh(std::move(ranks), std::move(*shape));
            else
              new (self) DeviceMesh(std::move(ranks));
          },
          "ranks"_a, "shape"_a = nb::none())
      .def_static("of_shape", &DeviceMesh::of_shape, "shape"_a,
                  "Ranks 0 .. product(shape) - 1 over shape, e.g. of_shape([2, 4]): 2 "
                  "data-parallel replicas of 4 tensor-parallel ranks.")
      .def_prop_ro("ndim", &DeviceMesh::ndim, "The number of mesh dimensions.")
      .def_prop_ro(
          "shape", [](const DeviceMesh& d) { return as_tuple(d.shape()); },
          "Ranks along each mesh dimension.")
      .def_prop_ro("ranks", &DeviceMesh::ranks, "The ranks in row-major order.")
      .def_prop_ro("numel", &DeviceMesh::numel, "The number of ranks.")
      .def("size", &DeviceMesh::size, "dim"_a, "Ranks along mesh dimension dim.")
      .def("__contains__", &DeviceMesh::contains, "rank"_a)
      .def("coordinates", &DeviceMesh::coordinates, "rank"_a,
           "rank's coordinates, one per mesh dimension (meshfuse.Error outside the mesh).")
      .def("rank_at", &DeviceMesh::rank_at, "coordinates"_a, "The rank at coordinates.")
      .def("team", &DeviceMesh::team, "dim"_a, "rank"_a,
           "The ranks that differ from rank only along dim, in coordinate order.")
      .def("__repr__", &DeviceMesh::to_string)
      .def(
          "__eq__", [](const DeviceMesh& a, const DeviceMesh& b) { return a == b; },
          nb::is_operator())
      .def("__hash__", [](const DeviceMesh& d) { return std::hash<std::string>()(d.to_string()); });

  // repr() is the C++ to_string, as the plan and program texts print placements.
  nb::class_<Shard> shard(m, "Shard",
                          "Split along tensor dimension dim (negative counts from the end) over "
                          "the ranks of a mesh dimension; the first n % d parts one row longer "
                          "(numpy.array_split).");
  shard
      .def(
          "__init__", [](Shard* self, std::int64_t dim) { new (self) Shard{dim}; }, "dim"_a)
      .def_ro("dim", &Shard::dim);
  bind_placement(shard);
  nb::class_<Replicate> replicate(m, "Replicate",
                                  "Every rank of a mesh dimension holds the whole tensor.");
  replicate.def(nb::init<>());
  bind_placement(replicate);
  nb::class_<Partial> partial(m, "Partial",
                              "Every rank of a mesh dimension holds a term; the tensor is their "
                              "reduction (op: 'sum', 'avg', 'max', 'min', 'prod').");
  partial
      .def(
          "__init__",
          [](Partial* self, const std::string& op) {
            new (self) Partial{parse_reduce_op_arg(op, "Partial")};
          },
          "op"_a = "sum")
      .def_prop_ro("op", [](const Partial& p) { return std::string(to_string(p.op)); });
  bind_placement(partial);

  m.def(
      "shard_tensor",
      [](nb::handle array, const DeviceMesh& mesh, nb::handle placements, int rank,
         std::uintptr_t stream) {
        const In held = array_from(array, [] { return std::string("shard_tensor: 'array'"); });
        const TensorView v = view(held, "shard_tensor", "array");
        const std::vector<Placement> pl = placements_from(placements, "shard_tensor");
        Tensor part;
        {
          nb::gil_scoped_release release;
          part = shard_tensor(v, mesh, pl, rank, stream_on(v.device(), stream));
        }
        return to_array(std::move(part), kind_of(array));
      },
      "array"_a, "mesh"_a, "placements"_a, "rank"_a, "stream"_a = 0,
      "rank's part of the whole array placed on mesh as placements say (a contiguous copy, of the "
      "array's kind and device). Partial('sum' or 'prod'): the first rank of that mesh dimension "
      "holds the part and the others zeros or ones; Partial('avg', 'max' or 'min'): every rank "
      "holds it (DTensor's partition of a value). Raises ValueError for a rank outside the mesh, "
      "placements not one per mesh dimension, a Shard outside the array, a Partial whose op cannot "
      "reduce the dtype.");
  m.def(
      "gather_tensor",
      [](nb::handle local, std::vector<std::int64_t> shape, const DeviceMesh& mesh,
         nb::handle placements, std::shared_ptr<Communicator> communicator, std::uintptr_t stream) {
        const In held = array_from(local, [] { return std::string("gather_tensor: 'local'"); });
        const TensorView v = view(held, "gather_tensor", "local");
        const std::vector<Placement> pl = placements_from(placements, "gather_tensor");
        Tensor whole;
        {
          nb::gil_scoped_release release;
          whole = gather_tensor(v, shape, mesh, pl, communicator, stream_on(v.device(), stream));
        }
        return to_array(std::move(whole), kind_of(local));
      },
      "local"_a, "shape"_a, "mesh"_a, "placements"_a, "communicator"_a, "stream"_a = 0,
      "The whole array of global shape from every rank's local part placed as placements say "
      "(Partial terms reduced), on every rank. Collective: every rank of the communicator, which "
      "the mesh must be laid over, calls it.");
}

void bind_program(nb::module_& m) {
  nb::class_<PyValue>(m, "Value",
                      "A value of a Program (an input or an op's result), as the builder returns "
                      "it; pass it to later builder calls of the same program.")
      .def_prop_ro(
          "id", [](const PyValue& v) { return v.value.id; },
          "Its index among the program's values (%id in the program's text).")
      .def_prop_ro(
          "name", [](const PyValue& v) { return program_of(v).info(v.value).name; },
          "The input's name; '' for an op's result.")
      .def_prop_ro(
          "shape", [](const PyValue& v) { return as_tuple(program_of(v).info(v.value).shape); },
          "The global shape.")
      .def_prop_ro(
          "dtype",
          [](const PyValue& v) {
            return std::string(to_string(program_of(v).info(v.value).dtype));
          },
          "'f32', 'bf16', ... (as CommRecord.dtype).")
      .def("__repr__",
           [](const PyValue& v) { return "<Value " + program_of(v).describe(v.value) + ">"; })
      .def(
          "__eq__",
          [](const PyValue& a, const PyValue& b) {
            return a.value == b.value && a.program.is(b.program);
          },
          nb::is_operator())
      .def("__hash__", [](const PyValue& v) { return std::hash<std::int64_t>()(v.value.id); });

  using V = const PyValue&;
  using OptV = const std::optional<PyValue>&;
  nb::class_<Program>(
      m, "Program",
      "A graph of meshfuse ops on global shapes, built op by op (static single assignment), that "
      "MultiDeviceExecutor shards over a DeviceMesh, lowers and runs (nvFuser's FusionDefinition). "
      "Each builder call checks shapes and dtypes and raises meshfuse.Error naming the op, the "
      "argument and the value. Usable as a context manager, as FusionDefinition: "
      "`with meshfuse.Program() as p: x = p.define_tensor(...)`; the with block only scopes the "
      "building (__enter__ returns the program, __exit__ finalises nothing). str() prints it. "
      "Ops: include/meshfuse/exec/program.h.")
      .def(nb::init<>())
      .def(
          "__enter__", [](Program& p) { return nb::find(p); }, "Returns the program itself.")
      .def(
          "__exit__", [](Program&, nb::args) {},
          "Does nothing: the program stays usable and exceptions propagate.")
      .def(
          "define_tensor",
          [](Program& p, std::string name, std::vector<std::int64_t> shape, nb::handle dtype) {
            return wrap(p, p.define_tensor(std::move(name), std::move(shape),
                                           dtype_from(dtype, "Program.define_tensor")));
          },
          "name"_a, "shape"_a, "dtype"_a,
          "An input, bound by name when the program runs; shape global; dtype 'f32', 'bf16', "
          "np.float32, torch.bfloat16, ...")
      .def(
          "linear",
          [](Program& p, V x, V weight, OptV bias) {
            return wrap(
                p, p.linear(operand(p, "linear", "x", x), operand(p, "linear", "weight", weight),
                            operand(p, "linear", "bias", bias)));
          },
          "x"_a, "weight"_a, "bias"_a = nb::none(),
          "x (..., K) @ weight (N, K).T + bias (N) -> (..., N).")
      .def(
          "matmul",
          [](Program& p, V a, V b) {
            return wrap(p, p.matmul(operand(p, "matmul", "a", a), operand(p, "matmul", "b", b)));
          },
          "a"_a, "b"_a, "a (M, K) @ b (K, N) -> (M, N); batched: (L, M, K) @ (L, K, N).")
      .def(
          "add",
          [](Program& p, V a, V b) {
            return wrap(p, p.add(operand(p, "add", "a", a), operand(p, "add", "b", b)));
          },
          "a"_a, "b"_a, "a + b, the same shape (no broadcasting).")
      .def(
          "rmsnorm",
          [](Program& p, V x, OptV weight, double eps) {
            return wrap(p, p.rmsnorm(operand(p, "rmsnorm", "x", x),
                                     operand(p, "rmsnorm", "weight", weight), eps));
          },
          "x"_a, "weight"_a.none(), "eps"_a, "RMSNorm of x (..., H); weight (H) or None.")
      .def(
          "fused_residual_add_rmsnorm",
          [](Program& p, V x, V residual, OptV weight, double eps, double multiplier) {
            const std::string_view op = "fused_residual_add_rmsnorm";
            const auto [y, r] = p.fused_residual_add_rmsnorm(
                operand(p, op, "x", x), operand(p, op, "residual", residual),
                operand(p, op, "weight", weight), eps, multiplier);
            return std::pair(wrap(p, y), wrap(p, r));
          },
          "x"_a, "residual"_a, "weight"_a.none(), "eps"_a, "multiplier"_a = 1.0,
          "(y, r): r = x * multiplier + residual, y = rmsnorm(r, weight, eps).")
      .def(
          "swiglu",
          [](Program& p, V gate, V up) {
            return wrap(
                p, p.swiglu(operand(p, "swiglu", "gate", gate), operand(p, "swiglu", "up", up)));
          },
          "gate"_a, "up"_a, "up * silu(gate), the same shape.")
      .def(
          "swiglu_packed",
          [](Program& p, V x, const std::string& layout) {
            return wrap(p, p.swiglu_packed(operand(p, "swiglu_packed", "x", x),
                                           parse_layout(layout, "Program.swiglu_packed")));
          },
          "x"_a, "layout"_a = "halves",
          "x (..., 2I) holding gate and up ('halves' or 'interleaved') -> (..., I).")
      .def(
          "softmax",
          [](Program& p, V x, double logits_multiplier) {
            return wrap(p, p.softmax(operand(p, "softmax", "x", x), logits_multiplier));
          },
          "x"_a, "logits_multiplier"_a = 1.0, "softmax(x * logits_multiplier) over the last dim.")
      .def(
          "cross_entropy",
          [](Program& p, V logits, V labels, const std::string& reduction,
             std::int64_t ignore_index, double label_smoothing, double logits_multiplier,
             double z_loss_scale, nb::handle loss_dtype, const std::string& label_check) {
            return wrap(p, p.cross_entropy(operand(p, "cross_entropy", "logits", logits),
                                           operand(p, "cross_entropy", "labels", labels),
                                           ce_options("Program.cross_entropy", ignore_index,
                                                      reduction, label_smoothing, logits_multiplier,
                                                      z_loss_scale, 0, 0, label_check),
                                           optional_dtype(loss_dtype, "Program.cross_entropy")));
          },
          "logits"_a, "labels"_a, "reduction"_a = "mean", "ignore_index"_a = -100,
          "label_smoothing"_a = 0.0, "logits_multiplier"_a = 1.0, "z_loss_scale"_a = 0.0,
          "loss_dtype"_a = nb::none(), "label_check"_a = "raise",
          "logits (N, V), labels (N) i32/i64 -> loss: () for 'mean' and 'sum', (N) for 'none'; "
          "in the logits' dtype, or loss_dtype 'f32' for 16-bit logits. label_check: how a bad "
          "label fails on CUDA ('raise': from the call, after a host wait; 'device_assert': a "
          "device-side assert, no wait).")
      .def(
          "fused_linear_cross_entropy",
          [](Program& p, V x, V weight, OptV bias, V labels, const std::string& reduction,
             std::int64_t ignore_index, double label_smoothing, double logits_multiplier,
             double z_loss_scale, nb::handle loss_dtype, const std::string& label_check) {
            const std::string_view op = "fused_linear_cross_entropy";
            return wrap(p, p.fused_linear_cross_entropy(
                               operand(p, op, "x", x), operand(p, op, "weight", weight),
                               operand(p, op, "bias", bias), operand(p, op, "labels", labels),
                               ce_options("Program.fused_linear_cross_entropy", ignore_index,
                                          reduction, label_smoothing, logits_multiplier,
                                          z_loss_scale, 0, 0, label_check),
                               optional_dtype(loss_dtype, "Program.fused_linear_cross_entropy")));
          },
          "x"_a, "weight"_a, "bias"_a.none(), "labels"_a, "reduction"_a = "mean",
          "ignore_index"_a = -100, "label_smoothing"_a = 0.0, "logits_multiplier"_a = 1.0,
          "z_loss_scale"_a = 0.0, "loss_dtype"_a = nb::none(), "label_check"_a = "raise",
          "cross_entropy(linear(x (N, H), weight (V, H), bias (V) or None), labels) without the "
          "logits in memory; options as cross_entropy's.")
      .def(
          "add_output",
          [](Program& p, V v, nb::handle placements) {
            p.add_output(operand(p, "add_output", "v", v),
                         optional_placements(placements, "Program.add_output"));
          },
          "v"_a, "placements"_a = nb::none(),
          "Marks v as an output (run() returns them in this order; a value marked twice gives two "
          "tensors). placements: how "
          "it is wanted on the mesh, one per mesh dimension (a single one for a 1-D mesh); None: "
          "as propagated, Partial made Replicate. A Partial the plan does not compute is made by "
          "a partition (DTensor's, docs/DISTRIBUTED.md: sum and prod terms are the value on the "
          "mesh dimension's first rank and 0 or 1 elsewhere; avg, max and min keep it on every "
          "rank, all-gathered or all-reduced first where it is a Shard or another Partial). Raises "
          "ValueError for placements not one "
          "per mesh dimension, a Shard outside v, a Partial op that cannot reduce v's dtype, or "
          "Partials that do not commute (one op, or sum with avg).")
      .def("set_mesh", &Program::set_mesh, "mesh"_a,
           "Puts the program on mesh; placements set before stay and are checked against it.")
      .def(
          "set_placements",
          [](Program& p, V v, nb::handle placements) {
            p.set_placements(operand(p, "set_placements", "v", v),
                             placements_from(placements, "Program.set_placements"));
          },
          "v"_a, "placements"_a,
          "How input v lies on the mesh (set_mesh first): one placement per mesh dimension, or a "
          "single one for a 1-D mesh. Default: Replicate. Raises ValueError as add_output does.")
      .def(
          "placements",
          [](Program& p, V v) -> std::vector<Placement> {
            return p.placements(operand(p, "placements", "v", v));
          },
          "v"_a, "The placements set for input v; [] when none were.")
      .def_prop_ro(
          "mesh", [](const Program& p) { return p.mesh(); }, "The DeviceMesh (a copy), or None.")
      .def_prop_ro(
          "inputs",
          [](Program& p) {
            std::vector<PyValue> values;
            for (Value v : p.inputs()) values.push_back(wrap(p, v));
            return values;
          },
          "The inputs as Values, in run()'s order.")
      .def_prop_ro(
          "outputs",
          [](Program& p) {
            std::vector<PyValue> values;
            for (Value v : p.outputs()) values.push_back(wrap(p, v));
            return values;
          },
          "The outputs as Values, in run()'s order.")
      .def("__str__", &Program::to_string)
      .def("__repr__", [](const Program& p) {
        return "<Program: " + std::to_string(p.inputs().size()) + " inputs, " +
               std::to_string(p.ops().size()) + " ops, " + std::to_string(p.outputs().size()) +
               " outputs>";
      });

  m.def(
      "grad",
      [](const Program& p, V loss, const std::vector<PyValue>& wrt) {
        std::vector<Value> with_respect_to;
        for (const PyValue& w : wrt) with_respect_to.push_back(operand(p, "grad", "wrt", w));
        return grad(p, operand(p, "grad", "loss", loss), with_respect_to);
      },
      "program"_a, "loss"_a, "wrt"_a,
      "The joint forward + backward Program for the gradients of loss with respect to the inputs "
      "wrt. Its inputs: program's, then 'grad_loss' (loss's shape and dtype; 1 for a loss that "
      "ends the computation; placed as the loss is output when given placements, else "
      "Replicate). Its outputs: program's, then one gradient per wrt, placed as that input "
      "(Replicate where it is Partial(sum); another reduction's Partial is Unsupported). Raises "
      "meshfuse.Error (see "
      "include/meshfuse/exec/autodiff.h).");
}

void bind_executor(nb::module_& m) {
  nb::enum_<CommunicatorBackend>(m, "CommunicatorBackend",
                                 "The backends of communicators; where one is taken, its name "
                                 "('gloo') is too.")
      .value("local", CommunicatorBackend::Local, "Ranks as threads of one process (run_local).")
      .value("gloo", CommunicatorBackend::Gloo, "Gloo over TCP; CPU arrays.")
      .value("mpi", CommunicatorBackend::Mpi, "Open MPI under mpirun; CPU arrays.")
      .value("nccl", CommunicatorBackend::Nccl, "NCCL, one GPU per rank; CUDA arrays.");

  nb::class_<MultiDeviceExecutorParams>(
      m, "MultiDeviceExecutorParams",
      "How a MultiDeviceExecutor lowers and runs: communicator_backend, the backend of every "
      "communication (a CommunicatorBackend, its name, or None: the communicator's for the "
      "inputs' device type); overlap, 'none', 'collective' or 'ring': communication overlapped "
      "with the GEMMs, the stretches from an all_gather over tokens to a reduce_scatter run in "
      "row chunks (collective: `chunks` per rank's part, 0 for the team size; ring: send/recv "
      "around the team); number_of_streams: on CUDA, the executor's streams for the chunks.")
      .def(
          "__init__",
          [](MultiDeviceExecutorParams* self, nb::handle backend, const std::string& overlap,
             int chunks, int number_of_streams) {
            const OverlapParams o{parse_overlap(overlap), chunks, number_of_streams};
            check_overlap_params(o);  // here, not at the first run on every rank
            new (self) MultiDeviceExecutorParams{};
            self->lowering.communicator_backend = backend_from(backend);
            self->overlap = o;
          },
          "communicator_backend"_a = nb::none(), "overlap"_a = "none", "chunks"_a = 0,
          "number_of_streams"_a = 2)
      .def_prop_rw(
          "communicator_backend",
          [](const MultiDeviceExecutorParams& p) { return p.lowering.communicator_backend; },
          [](MultiDeviceExecutorParams& p, nb::handle backend) {
            p.lowering.communicator_backend = backend_from(backend);
          },
          nb::arg("backend").none())
      .def_prop_rw(
          "overlap",
          [](const MultiDeviceExecutorParams& p) {
            return std::string(to_string(p.overlap.overlap));
          },
          [](MultiDeviceExecutorParams& p, const std::string& o) {
            p.overlap.overlap = parse_overlap(o);
          })
      .def_prop_rw(
          "chunks", [](const MultiDeviceExecutorParams& p) { return p.overlap.chunks; },
          [](MultiDeviceExecutorParams& p, int chunks) {
            check_overlap_params({p.overlap.overlap, chunks, p.overlap.number_of_streams});
            p.overlap.chunks = chunks;
          })
      .def_prop_rw(
          "number_of_streams",
          [](const MultiDeviceExecutorParams& p) { return p.overlap.number_of_streams; },
          [](MultiDeviceExecutorParams& p, int n) {
            check_overlap_params({p.overlap.overlap, p.overlap.chunks, n});
            p.overlap.number_of_streams = n;
          })
      .def(
          "__eq__",
          [](const MultiDeviceExecutorParams& a, const MultiDeviceExecutorParams& b) {
            return a == b;
          },
          nb::is_operator())
      .def("__repr__", [](const MultiDeviceExecutorParams& p) {
        const auto& b = p.lowering.communicator_backend;
        return "MultiDeviceExecutorParams(communicator_backend=" +
               (b ? "'" + std::string(to_string(*b)) + "'" : std::string("None")) +
               ", overlap='" + std::string(to_string(p.overlap.overlap)) +
               "', chunks=" + std::to_string(p.overlap.chunks) +
               ", number_of_streams=" + std::to_string(p.overlap.number_of_streams) + ")";
      });

  nb::class_<Plan>(m, "Plan",
                   "One rank's lowered program: its compute steps and communications, each "
                   "value with its placements and local shape. str() prints it.")
      .def_ro("rank", &Plan::rank)
      .def_ro("mesh", &Plan::mesh)
      .def_ro("backend", &Plan::backend, "The backend of its communications.")
      .def_prop_ro(
          "input_shapes",
          [](const Plan& p) {
            std::vector<nb::tuple> shapes;
            for (std::int64_t i : p.inputs)
              shapes.push_back(as_tuple(p.values[static_cast<std::size_t>(i)].shape));
            return shapes;
          },
          "This rank's shape of each input, in run()'s order: what run() takes.")
      .def_prop_ro(
          "output_shapes",
          [](const Plan& p) {
            std::vector<nb::tuple> shapes;
            for (std::int64_t i : p.outputs)
              shapes.push_back(as_tuple(p.values[static_cast<std::size_t>(i)].shape));
            return shapes;
          },
          "This rank's shape of each output, as run() returns them.")
      .def_prop_ro(
          "output_placements",
          [](const Plan& p) {
            std::vector<std::vector<Placement>> placements;
            for (std::int64_t i : p.outputs)
              placements.push_back(p.values[static_cast<std::size_t>(i)].placements);
            return placements;
          },
          "Each output's placements, one per mesh dimension.")
      .def_prop_ro(
          "communications",
          [](const Plan& p) {
            std::vector<std::string> lines;
            for (const PlanStep& s : p.steps)
              if (const auto* c = std::get_if<Communication>(&s)) lines.push_back(c->to_string());
            return lines;
          },
          "Each communication as text, e.g. 'all_gather(dim 0) on gloo, mesh dim 0, team [0 1 2 "
          "3], sizes [3 3 2 2]'.")
      .def("__str__", &Plan::to_string)
      .def("__repr__", [](const Plan& p) {
        return "<Plan of rank " + std::to_string(p.rank) + " on " +
               std::string(to_string(p.backend)) + ", " + std::to_string(p.steps.size()) +
               " steps>";
      });

  nb::class_<MultiDeviceExecutor>(
      m, "MultiDeviceExecutor",
      "Runs a Program on the ranks of its DeviceMesh, each rank with its parts of the inputs "
      "(nvFuser's MultiDeviceExecutor). Every rank of the communicator's team makes one of the "
      "same program and calls run() as often; the mesh must be laid over the team's ranks "
      "0 .. size - 1 (meshfuse.Error otherwise). The program is copied: later builder calls do "
      "not reach the executor. Plans are lowered once per (backend, device type) and cached.")
      .def(
          "__init__",
          [](MultiDeviceExecutor* self, const Program& program,
             std::shared_ptr<Communicator> communicator,
             std::optional<MultiDeviceExecutorParams> params) {
            new (self) MultiDeviceExecutor(program, std::move(communicator),
                                           params.value_or(MultiDeviceExecutorParams{}));
          },
          "program"_a, "communicator"_a, "params"_a = nb::none())
      .def(
          "run",
          [](MultiDeviceExecutor& e, nb::handle inputs, std::uintptr_t stream) {
            const Program& p = e.program();
            std::vector<nb::object> objects;
            // The arrays stay held until run() returns; the views point into them.
            std::vector<In> arrays;
            std::vector<TensorView> views;
            try {
              objects = ordered_inputs(p, inputs);
              for (std::size_t i = 0; i < objects.size(); ++i) {
                const auto named = [&] {
                  return "MultiDeviceExecutor.run: input " +
                         (i < p.inputs().size() ? p.describe(p.inputs()[i]) : std::to_string(i));
                };
                arrays.push_back(array_from(objects[i], named));
                views.push_back(view(arrays.back(), named()));
              }
            } catch (...) {  // refused here on this rank: the peers must not pair with the next run
              try {
                e.count_failed_run(views.empty() ? std::nullopt
                                                 : std::optional(views[0].device().type));
              } catch (...) {  // the conversion's error is the one to report
              }
              throw;
            }
            const Stream s = views.empty() ? Stream{} : stream_on(views[0].device(), stream);
            std::vector<Tensor> outputs;
            {
              nb::gil_scoped_release release;
              outputs = e.run(views, s);
            }
            const ArrayKind kind = objects.empty() ? ArrayKind::DLPack : kind_of(objects[0]);
            nb::list result;
            for (Tensor& t : outputs) result.append(to_array(std::move(t), kind));
            return result;
          },
          "inputs"_a, "stream"_a = 0,
          "This rank's parts of the outputs, in the program's output order, from its parts of the "
          "inputs: a list in the program's input order, or a dict name -> array. Arrays: DLPack "
          "(torch, NumPy, CuPy), all on one device, each of the shape plan().input_shapes gives "
          "and the program's dtype. Returns arrays of the first input's kind (torch in, torch "
          "out; else DLPack-exporting ndarrays) on that device, owning their memory. stream: a "
          "cudaStream_t as an integer (0: the default). Raises meshfuse.Error naming the input "
          "(count, shape, dtype, device) and the ops' and communicators' errors.")
      .def(
          "plan",
          [](MultiDeviceExecutor& e, const std::string& device) {
            return e.plan(Device::parse(device).type);
          },
          "device"_a = "cpu",
          "The Plan run() uses for inputs on device ('cpu', 'cuda'), lowered now if not yet.")
      .def_prop_ro("cached_plans", &MultiDeviceExecutor::cached_plans,
                   "How many plans are lowered (one per backend and device type).")
      .def_prop_rw(
          "params", [](const MultiDeviceExecutor& e) { return e.params(); },
          &MultiDeviceExecutor::set_params,
          "The MultiDeviceExecutorParams (a copy: assign to change them, e.g. executor.params = "
          "MultiDeviceExecutorParams('gloo'), on every rank: the next run() compares them across "
          "ranks). Another backend lowers again at the next plan() or run().");
}

}  // namespace

void bind_exec(nb::module_& m) {
  bind_mesh_and_placements(m);
  bind_program(m);
  bind_executor(m);
}

}  // namespace meshfuse::python
