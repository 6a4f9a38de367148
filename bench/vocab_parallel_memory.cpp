// Peak extra device memory of the vocabulary-parallel fused linear cross-entropy in the executor
// (issue 17's bound: at most chunk_rows x (V / d) x 4 bytes beyond its outputs), on one GPU as a
// one-rank NCCL mesh: the head's weight Shard(0) over the vocabulary, loss (mean) and gradients of
// x and the weight. Measured from the device's meshfuse memory pool (memory.h): peak allocated
// during run() minus what was allocated before it (the inputs). Prints one JSON record.
//
//   vocab_parallel_memory [--tokens N] [--hidden H] [--vocab V]    (default: llama-3.1-8b's head)
#include <fmt/format.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>

#include "meshfuse/meshfuse.h"
#include "meshfuse/testing.h"

int main(int argc, char** argv) {
  using namespace meshfuse;
  std::int64_t tokens = 16384, hidden = 4096, vocab = 128256;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::int64_t& v = !std::strcmp(argv[i], "--tokens")   ? tokens
                      : !std::strcmp(argv[i], "--hidden") ? hidden
                                                          : vocab;
    v = std::atoll(argv[i + 1]);
  }
  if (cuda_device_count() == 0 || !communicator_backend_built(CommunicatorBackend::Nccl)) {
    fmt::print(stderr, "vocab_parallel_memory: needs a GPU and the nccl backend\n");
    return 2;
  }
  const Device gpu{DeviceType::CUDA, 0};
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / fmt::format("meshfuse_vpm_{}", getpid());
  CommOptions options;
  options.backend = "cuda:nccl";
  const auto comm = init_communicator(LaunchInfo{}, std::make_shared<FileStore>(dir), options);

  Program p;
  const Value x = p.define_tensor("x", {tokens, hidden}, DType::BF16);
  const Value w = p.define_tensor("head_weight", {vocab, hidden}, DType::BF16);
  const Value labels = p.define_tensor("labels", {tokens}, DType::I64);
  const Value loss = p.fused_linear_cross_entropy(x, w, {}, labels, {}, DType::F32);
  p.add_output(loss);
  p.set_mesh(DeviceMesh({0}));
  p.set_placements(w, {Shard{0}});
  const Program joint = grad(p, loss, {x, w});

  const CudaStream stream(0);
  std::vector<Tensor> inputs;
  for (Value in : joint.inputs()) {
    const ValueInfo& info = joint.info(in);
    Tensor host(info.shape, info.dtype);
    if (info.name == "labels") {
      testing::fill_uniform_int(host, 1, 0, vocab);
    } else if (info.name == "grad_loss") {
      fill(host, 1.0);
    } else {
      testing::fill_normal(host, 2, 0.0, info.name == "x" ? 1.0 : 0.02);
    }
    inputs.push_back(host.to(gpu, stream));
  }
  MultiDeviceExecutor executor(joint, comm);
  const std::vector<TensorView> views(inputs.begin(), inputs.end());
  executor.run(views, stream);  // the plan, NCCL and cuBLASLt set up
  synchronize(stream);
  const std::int64_t before = device_memory_stats(gpu).allocated;
  reset_peak_memory_stats(gpu);
  std::int64_t output_bytes = 0;
  {
    const std::vector<Tensor> out = executor.run(views, stream);
    synchronize(stream);
    for (const Tensor& t : out)
      output_bytes += t.numel() * static_cast<std::int64_t>(element_size(t.dtype()));
  }
  const std::int64_t peak = device_memory_stats(gpu).peak_allocated - before;
  const std::int64_t chunk = fused_linear_cross_entropy_chunk_rows(DeviceType::CUDA, vocab);
  const std::int64_t bound = chunk * vocab * 4;
  fmt::print(
      "{{\"tokens\": {}, \"hidden\": {}, \"vocab\": {}, \"ranks\": 1, \"dtype\": \"bf16\", "
      "\"chunk_rows\": {}, \"peak_extra_bytes\": {}, \"output_bytes\": {}, "
      "\"beyond_outputs_bytes\": {}, \"bound_bytes\": {}, \"unfused_logits_bytes\": {}}}\n",
      tokens, hidden, vocab, chunk, peak, output_bytes, peak - output_bytes, bound,
      tokens * vocab * 2);
  std::filesystem::remove_all(dir);
  return 0;
}
