// Each op's argument checks and kernels on arguments drawn from the input: the op, its dtype, its
// sizes (small, zero included), each tensor's layout (contiguous, transposed, padded rows, a
// broadcast dim, an offset), sometimes a mismatched shape, dtype or a view labelled cuda:0 (whose
// data pointer is not host memory), scalars (eps, multipliers, alpha and beta, label smoothing)
// and label values (ignored, out of range). The oracle: the cpu backend throws meshfuse::Error,
// or it succeeds and so does the reference backend on the same arguments, with outputs that agree
// within a loose tolerance (a wrong element, not a last bit) and NaN where the reference has NaN
// (unless a scalar was unusual: see Args::odd_scalar).
// A backward's saved tensors (rstd, lse, y) come from the reference forward where it accepts the
// arguments, so that both backends see what a training step would give them.
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "meshfuse/meshfuse.h"
#include "meshfuse/testing.h"

namespace {

using namespace meshfuse;

constexpr DType kDTypes[] = {DType::F32, DType::BF16, DType::F16, DType::F64,
                             DType::I64, DType::I32, DType::U8};

bool floating(DType d) {
  return d == DType::F32 || d == DType::F64 || d == DType::F16 || d == DType::BF16;
}

// The tensors of one call: every view's storage, kept alive, and the outputs to compare.
struct Args {
  explicit Args(FuzzedDataProvider& data) : in(data) {}
  FuzzedDataProvider& in;
  std::vector<Tensor> storage = {};
  std::vector<TensorView> outputs = {};
  bool on_gpu = false;  // a view is labelled cuda:0 (this build has no GPU: the call must fail)
  std::string described;  // every tensor made, for the report of a finding
  // An unusual scalar (0, -1, NaN, inf, 1e30) was drawn: where the op accepts it, the cpu backend
  // may overflow its dtype where the reference's double does not, so only crashes count then.
  bool odd_scalar = false;

  DType dtype_or(DType usual) {
    return in.ConsumeIntegralInRange(0, 15) == 0 ? kDTypes[in.ConsumeIntegralInRange(0, 6)] : usual;
  }

  Shape shape_or(Shape usual) {
    if (in.ConsumeIntegralInRange(0, 15) != 0) return usual;
    switch (in.ConsumeIntegralInRange(0, 2)) {
      case 0:
        if (!usual.empty()) usual.back() += in.ConsumeBool() ? 1 : -1;
        break;
      case 1:
        usual.insert(usual.begin(), in.ConsumeIntegralInRange(0, 3));
        break;
      default:
        if (!usual.empty()) usual.pop_back();
    }
    for (std::int64_t& d : usual) d = std::max<std::int64_t>(d, 0);
    return usual;
  }

  // A tensor of (about) `shape` and `dtype` in one of several layouts, filled with values normal
  // around 0 (integers in [lo, hi) for integer dtypes), now and then a NaN or an infinity.
  TensorView tensor(Shape shape, DType dtype, double lo = -3, double hi = 3) {
    shape = shape_or(std::move(shape));
    dtype = dtype_or(dtype);
    const std::size_t nd = shape.size();
    Shape strides = contiguous_strides(shape);
    std::int64_t offset = 0;
    switch (in.ConsumeIntegralInRange(0, 7)) {
      case 1:  // the last two dims transposed in memory
        if (nd >= 2) {
          Shape swapped = shape;
          std::swap(swapped[nd - 1], swapped[nd - 2]);
          strides = contiguous_strides(swapped);
          std::swap(strides[nd - 1], strides[nd - 2]);
        }
        break;
      case 2:  // rows padded
        if (nd >= 2) {
          strides[nd - 2] += in.ConsumeIntegralInRange(1, 3);
          for (std::size_t i = nd - 2; i-- > 0;) strides[i] = strides[i + 1] * shape[i + 1];
        }
        break;
      case 3:  // a broadcast (stride 0) dim
        if (nd >= 1) strides[in.ConsumeIntegralInRange<std::size_t>(0, nd - 1)] = 0;
        break;
      case 4:  // not at the start of its storage
        offset = in.ConsumeIntegralInRange(1, 5);
        break;
      default:
        break;
    }
    std::int64_t extent = 1;
    for (std::size_t i = 0; i < nd; ++i)
      if (shape[i] == 0) extent = 0;
    if (extent)
      for (std::size_t i = 0; i < nd; ++i) extent += (shape[i] - 1) * strides[i];
    Tensor t({offset + std::max<std::int64_t>(extent, 1)}, dtype);
    const bool integer = !floating(dtype);
    Tensor values({t.numel()}, integer ? DType::I64 : DType::F64);
    const std::uint32_t seed = in.ConsumeIntegral<std::uint32_t>();
    if (integer) {
      testing::fill_uniform_int(values, seed, static_cast<std::int64_t>(lo),
                                static_cast<std::int64_t>(hi));
    } else {
      testing::fill_normal(values, seed);
      if (in.ConsumeIntegralInRange(0, 7) == 0) {
        const double special[] = {std::numeric_limits<double>::quiet_NaN(),
                                  std::numeric_limits<double>::infinity(),
                                  -std::numeric_limits<double>::infinity()};
        values.data_ptr<double>()[in.ConsumeIntegralInRange<std::int64_t>(0, t.numel() - 1)] =
            special[in.ConsumeIntegralInRange(0, 2)];
      }
    }
    copy(values, t);
    storage.push_back(t);
    void* data = static_cast<char*>(t.view().data()) + offset * static_cast<std::int64_t>(element_size(dtype));
    if (in.ConsumeIntegralInRange(0, 31) == 0) {  // a GPU's view: never to be read on the host
      on_gpu = true;
      return TensorView(reinterpret_cast<void*>(std::uintptr_t{0x1000}), dtype, shape, strides,
                        Device{DeviceType::CUDA, 0});
    }
    described += fmt::format("  {} strides [{}]\n", TensorView(data, dtype, shape).str(),
                             fmt::join(strides, ", "));
    return TensorView(data, dtype, shape, strides);
  }

  TensorView maybe(Shape shape, DType dtype) {
    return in.ConsumeBool() ? tensor(std::move(shape), dtype) : TensorView();
  }

  TensorView output(Shape shape, DType dtype) {
    const TensorView t = tensor(std::move(shape), dtype);
    outputs.push_back(t);
    return t;
  }

  TensorView maybe_output(Shape shape, DType dtype) {
    return in.ConsumeBool() ? output(std::move(shape), dtype) : TensorView();
  }

  double scalar(std::initializer_list<double> usual) {
    const double odd[] = {0.0, -1.0, std::numeric_limits<double>::quiet_NaN(),
                          std::numeric_limits<double>::infinity(), 1e30};
    const bool unusual = in.ConsumeIntegralInRange(0, 15) == 0;
    odd_scalar |= unusual;
    const double x = unusual ? odd[in.ConsumeIntegralInRange(0, 4)]
                             : usual.begin()[in.ConsumeIntegralInRange<std::size_t>(0, usual.size() - 1)];
    described += fmt::format("  scalar {}\n", x);
    return x;
  }
};

// Whether the cpu's output agrees with the reference's: NaN where it has NaN, the same
// infinities, finite values within a tolerance that allows different summation orders.
bool agree(const TensorView& cpu, const TensorView& ref) {
  if (!floating(ref.dtype())) return testing::bitwise_equal(cpu, ref);
  const double tol = ref.dtype() == DType::F32 || ref.dtype() == DType::F64 ? 1e-3 : 0.05;
  const testing::Diff d = testing::compare(cpu, ref, tol, tol);
  return d.violations == 0 && d.mismatched_nonfinite == 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const int op = in.ConsumeIntegralInRange(0, 10);
  const DType dt = kDTypes[in.ConsumeIntegralInRange(0, 3)];  // the op's floating dtype
  const std::int64_t n = in.ConsumeIntegralInRange(0, 5), h = in.ConsumeIntegralInRange(0, 9),
                     v = in.ConsumeIntegralInRange(0, 9);
  Args a{in};
  CrossEntropyOptions ce;
  std::function<void()> call;
  switch (op) {
    case 0: {
      const TensorView x = a.tensor({n, h}, dt), w = a.maybe({h}, dt);
      const TensorView y = a.output({n, h}, dt), rstd = a.maybe_output({n}, rmsnorm_rstd_dtype(dt));
      const double eps = a.scalar({1e-6, 1e-5});
      call = [=] { rmsnorm(x, w, y, rstd, eps); };
      break;
    }
    case 1: {
      const TensorView gy = a.tensor({n, h}, dt), x = a.tensor({n, h}, dt), w = a.maybe({h}, dt);
      const TensorView rstd = a.tensor({n}, rmsnorm_rstd_dtype(dt), 0, 3);
      try {  // the forward's rstd where it exists
        ForceKernelBackend ref(KernelBackend::Reference);
        rmsnorm(x, w, Tensor(x.shape(), x.dtype()), rstd, 1e-6);
      } catch (const Error&) {
      }
      const TensorView dx = a.output({n, h}, dt), dw = w.defined() ? a.maybe_output({h}, dt) : TensorView();
      call = [=] { rmsnorm_backward(gy, x, w, rstd, dx, dw); };
      break;
    }
    case 2: {
      const TensorView x = a.tensor({n, v}, dt), y = a.output({n, v}, dt);
      const double m = a.scalar({1.0, 0.5});
      call = [=] { softmax(x, y, m); };
      break;
    }
    case 3: {
      const TensorView gy = a.tensor({n, v}, dt), y = a.tensor({n, v}, dt, 0, 1);
      if (!a.on_gpu) try {
          ForceKernelBackend ref(KernelBackend::Reference);
          softmax(Tensor::copy_of(y), y);
        } catch (const Error&) {
        }
      const TensorView gx = a.output({n, v}, dt);
      const double m = a.scalar({1.0, 2.0});
      call = [=] { softmax_backward(gy, y, gx, m); };
      break;
    }
    case 4: {
      const TensorView g = a.tensor({n, h}, dt), u = a.tensor({n, h}, dt), o = a.output({n, h}, dt);
      call = [=] { swiglu(g, u, o); };
      break;
    }
    case 5: {
      const TensorView go = a.tensor({n, h}, dt), g = a.tensor({n, h}, dt), u = a.tensor({n, h}, dt);
      const TensorView gg = a.output({n, h}, dt), gu = a.output({n, h}, dt);
      call = [=] { swiglu_backward(go, g, u, gg, gu); };
      break;
    }
    case 6:
    case 7: {
      ce.reduction = static_cast<Reduction>(in.ConsumeIntegralInRange(0, 2));
      ce.ignore_index = in.ConsumeBool() ? -100 : in.ConsumeIntegralInRange(-1, 9);
      ce.label_smoothing = a.scalar({0.0, 0.1});
      ce.z_loss_scale = a.scalar({0.0, 1e-4});
      const TensorView logits = a.tensor({n, v}, dt);
      const TensorView labels = a.tensor({n}, in.ConsumeBool() ? DType::I64 : DType::I32, -101, 11);
      const Shape loss_shape = ce.reduction == Reduction::None ? Shape{n} : Shape{};
      const DType loss_dtype = dt == DType::F64 ? dt : (in.ConsumeBool() ? DType::F32 : dt);
      if (op == 6) {
        const TensorView loss = a.output(loss_shape, loss_dtype);
        const TensorView lse = a.maybe_output({n}, DType::F32);
        call = [=] { cross_entropy(logits, labels, loss, lse, ce); };
        break;
      }
      const TensorView lse = a.tensor({n}, DType::F32);
      try {
        ForceKernelBackend ref(KernelBackend::Reference);
        cross_entropy(logits, labels, Tensor(loss_shape, loss_dtype), lse, ce);
      } catch (const Error&) {
      }
      const TensorView grad_loss = a.tensor(loss_shape, loss_dtype);
      const TensorView grad_logits = a.output({n, v}, dt);
      call = [=] { cross_entropy_backward(grad_loss, logits, labels, lse, grad_logits, ce); };
      break;
    }
    case 8: {
      const TensorView x = a.tensor({n, h}, dt), w = a.tensor({v, h}, dt), b = a.maybe({v}, dt);
      const TensorView y = a.output({n, v}, dt);
      call = [=] { linear(x, w, b, y); };
      break;
    }
    case 9: {
      GemmOptions g;
      g.transpose_a = in.ConsumeBool();
      g.transpose_b = in.ConsumeBool();
      g.alpha = a.scalar({1.0, 0.3});
      g.beta = a.scalar({0.0, 1.0});
      const TensorView x = a.tensor(g.transpose_a ? Shape{h, n} : Shape{n, h}, dt);
      const TensorView w = a.tensor(g.transpose_b ? Shape{v, h} : Shape{h, v}, dt);
      const TensorView c = a.maybe({n, v}, dt), d = a.output({n, v}, dt);
      call = [=] { gemm(x, w, c, d, g); };
      break;
    }
    default: {
      ce.ignore_index = -100;
      ce.reduction = in.ConsumeBool() ? Reduction::Mean : Reduction::Sum;
      const TensorView x = a.tensor({n, h}, dt), w = a.tensor({v, h}, dt), b = a.maybe({v}, dt);
      const TensorView labels = a.tensor({n}, DType::I64, -101, 11);
      const DType loss_dtype = dt == DType::F64 ? dt : DType::F32;
      const TensorView grad_loss = a.maybe({}, loss_dtype), loss = a.output({}, loss_dtype);
      const bool grads = grad_loss.defined();
      const TensorView gx = grads ? a.maybe_output({n, h}, dt) : TensorView();
      const TensorView gw = grads ? a.maybe_output({v, h}, dt) : TensorView();
      const TensorView gb = grads && b.defined() ? a.maybe_output({v}, dt) : TensorView();
      const std::int64_t chunk = in.ConsumeIntegralInRange(0, 3);
      call = [=] { fused_linear_cross_entropy(x, w, b, labels, grad_loss, loss, gx, gw, gb, ce, chunk); };
      break;
    }
  }
  // The outputs as they were (their storage is reused by both calls), the cpu's, the reference's.
  std::vector<Tensor> before, cpu;
  for (const TensorView& o : a.outputs)
    before.push_back(o.device().type == DeviceType::CPU ? Tensor::copy_of(o) : Tensor());
  try {
    ForceKernelBackend force(KernelBackend::CPU);
    call();
  } catch (const Error&) {
    return 0;  // a clear error: the checks did their work
  }
  if (a.on_gpu) std::abort();  // it read or wrote a GPU's view on the host
  for (const TensorView& o : a.outputs) cpu.push_back(Tensor::copy_of(o));
  for (std::size_t i = 0; i < a.outputs.size(); ++i) copy(before[i], a.outputs[i]);
  try {
    ForceKernelBackend force(KernelBackend::Reference);
    call();
  } catch (const Error& e) {
    fmt::print(stderr, "op {}: the cpu backend ran what the reference refuses: {}\n{}", op,
               e.what(), a.described);
    std::abort();
  }
  for (std::size_t i = 0; i < a.outputs.size() && !a.odd_scalar; ++i)
    if (!agree(cpu[i], a.outputs[i])) {
      const testing::Diff d = testing::compare(cpu[i], a.outputs[i], 0, 0);
      fmt::print(stderr, "op {}: output {} differs from the reference (max abs {}, max rel {}, "
                 "{} non-finite mismatches)\n{}", op, i, d.max_abs_err, d.max_rel_err,
                 d.mismatched_nonfinite, a.described);
      std::abort();
    }
  return 0;
}
