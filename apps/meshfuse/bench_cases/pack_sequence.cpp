// Sequence packing and MoE routing counts at the recurrent ops' sizes, not the model's: B = 16
// sequences padded to S = 4096 tokens of N x H = 64 x 64 values, with lengths drawn uniformly
// from [S/2, S] (a fixed mt19937_64 stream, the same on every run); continuous_count over
// 16 x 4096 x 8 expert ids (top-8 routing of 65536 tokens) into 64 bins. Outside a transformer
// layer: run only when --ops names them.
#include "meshfuse/ops/pack_sequence.h"

#include <fmt/format.h>

#include <random>

#include "bench_cases/case.h"
#include "meshfuse/ops/continuous_count.h"

namespace meshfuse::cli {
namespace {

constexpr std::int64_t kBatch = 16, kDefaultSeqLen = 4096, kHeads = 64, kHeadDim = 64;
constexpr std::int64_t kExpertIds = 16 * 4096 * 8, kExperts = 64;

// A copy is exact: the reference must agree bitwise.
constexpr Tolerance kExact{0, 0};

std::int64_t seq_len(const BenchSetup& s) { return s.seq_len > 0 ? s.seq_len : kDefaultSeqLen; }

// (B+1,) offsets of sequences of lengths uniform in [S/2, S].
std::vector<std::int64_t> offsets(std::int64_t steps) {
  std::mt19937_64 gen(2024);
  std::vector<std::int64_t> cu = {0};
  for (std::int64_t b = 0; b < kBatch; ++b)
    cu.push_back(cu.back() + steps / 2 + static_cast<std::int64_t>(gen() % (steps / 2 + 1)));
  return cu;
}

Tensor on_device(const BenchSetup& s, const Tensor& host) {
  if (s.device.type == DeviceType::CPU) return host;
  Tensor t(host.shape(), host.dtype(), s.device);
  copy(host, t);
  return t;
}

std::vector<Direction> pack_directions(const BenchSetup& s) {
  const std::int64_t steps = seq_len(s);
  const std::vector<std::int64_t> cu_values = offsets(steps);
  const std::int64_t t = cu_values.back(), r = kHeads * kHeadDim;
  Tensor cu_host({kBatch + 1}, DType::I32);
  for (std::int64_t b = 0; b <= kBatch; ++b)
    cu_host.data_ptr<std::int32_t>()[b] = static_cast<std::int32_t>(cu_values[b]);
  const Tensor cu = on_device(s, cu_host);
  const Shape padded{kBatch, steps, kHeads, kHeadDim}, packed{t, kHeads, kHeadDim};
  const Tensor x = random_tensor(s, padded, 41), grad_packed = random_tensor(s, packed, 42);
  const Tensor out = output_tensor(s, packed), grad_x = output_tensor(s, padded);
  const Stream stream{s.device};  // ops run on the default stream of the tensors' device
  const double e = static_cast<double>(element_size(s.dtype));
  const std::string shape = shape_text({{"x", padded}, {"packed", packed}}) +
                            fmt::format(" (left padding, lengths in [{}, {}])", steps / 2, steps);
  const std::vector<std::string> notes = {
      fmt::format("T = {} of B·S = {} tokens; cu_seqlens is read on the host to check it (on a "
                  "GPU a small copy that waits for the stream, in the timing)",
                  t, kBatch * steps)};

  Direction forward{.kernel = "pack_sequence",
                    .direction = "forward",
                    .shape = shape,
                    .bytes = 2 * static_cast<double>(t * r) * e,
                    .formula = "2·T·N·H·e (read and write the T tokens)",
                    .notes = notes};
  forward.run = [=] { pack_sequence(x, cu, out, PaddingSide::Left, stream); };
  forward.check = [=] {
    const Tensor expected = output_tensor(s, packed);
    on_reference([&] { pack_sequence(x, cu, expected, PaddingSide::Left, stream); });
    return std::vector{compare_output("out", out, expected, kExact)};
  };

  Direction backward{.kernel = "unpack_sequence",
                     .direction = "backward",
                     .shape = shape,
                     .bytes = static_cast<double>((t + kBatch * steps) * r) * e,
                     .formula =
                         "(T + B·S)·N·H·e (read the T tokens; write B·S rows, padding "
                         "zero-filled)",
                     .notes = notes};
  backward.run = [=] { unpack_sequence(grad_packed, cu, grad_x, PaddingSide::Left, stream); };
  backward.check = [=] {
    const Tensor expected = output_tensor(s, padded);
    on_reference([&] { unpack_sequence(grad_packed, cu, expected, PaddingSide::Left, stream); });
    return std::vector{compare_output("grad_x", grad_x, expected, kExact)};
  };
  return {forward, backward};
}

std::vector<Direction> count_directions(const BenchSetup& s) {
  Tensor ids_host({kExpertIds}, DType::I32);
  testing::fill_uniform_int(ids_host, 43, 0, kExperts);
  const Tensor ids = on_device(s, ids_host);
  const Tensor counts = output_tensor(s, {kExperts}, DType::I64);
  const Stream stream{s.device};  // ops run on the default stream of the tensors' device
  Direction forward{.kernel = "continuous_count",
                    .direction = "forward",
                    .shape = shape_text({{"x (i32)", {kExpertIds}}, {"out (i64)", {kExperts}}}),
                    .bytes = static_cast<double>(kExpertIds * 4 + kExperts * 8),
                    .formula = "4·n + 8·bins (read the i32 ids; write the i64 counts)",
                    .notes = {"the ids are i32 whatever --dtype"}};
  forward.run = [=] { continuous_count(ids, counts, stream); };
  forward.check = [=] {
    const Tensor expected = output_tensor(s, {kExperts}, DType::I64);
    on_reference([&] { continuous_count(ids, expected, stream); });
    return std::vector{compare_output("out", counts, expected, kExact)};
  };
  return {forward};
}

}  // namespace

std::vector<BenchCase> pack_sequence_cases() {
  return {{.name = "pack_sequence",
           .group = "",
           .kernels = {"pack_sequence", "unpack_sequence"},
           .make = pack_directions,
           .in_layer = false},
          {.name = "continuous_count",
           .group = "",
           .kernels = {"continuous_count"},
           .make = count_directions,
           .in_layer = false,
           .kernel_dtype = DType::I32}};
}

}  // namespace meshfuse::cli
