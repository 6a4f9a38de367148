// Running an overlapped segment of a Plan (overlap.h) chunk by chunk: the Interpreter's
// run_segment and its forms.
//
// Every op of the segment runs once per block: the rows of one member's part that a chunk (or a
// ring step) covers. A block's rows are contiguous both in the full tensors, which keep their
// layout (values that later steps read are written in place), and in the chunk's communication
// buffer, which holds the chunk's blocks in the team's order (all_gather's output, reduce_scatter's
// input). So no op reads or writes a permuted copy, and a GEMM on a block is a GEMM on a row range.
// Results summed over rows (weight gradients) are left out of the blocks and computed once over
// all rows after the last block, while the last chunk's reduce_scatter runs: the same GEMM as
// without overlap, one rounding.
//
// Ordering. On the CPU, compute runs on the calling thread and each backend's collectives on its
// own threads (Work), waited before their results are read or their buffers reused. On CUDA, chunk
// c runs on the executor's stream c % number_of_streams (a ring: transfers on the first, compute
// on the second), each waiting for the caller's stream at the start and waited by it at the end;
// buffers are reused only on the stream that last used them, or after an event of the other.
#include <algorithm>
#include <array>
#include <numeric>

#include "exec/interpret.h"
#include "exec/interpreter.h"
#include "meshfuse/core/error.h"
#include "meshfuse/ops/elementwise.h"

namespace meshfuse::detail {

// `rows` rows of member `rank`'s part: rows [offset, offset + rows) of the segment's M rows, at
// row `at` of the chunk's communication buffer.
struct Interpreter::Block {
  int rank = 0;
  std::int64_t offset = 0, rows = 0, at = 0;
};

struct Interpreter::Chunked {
  Chunked(const OverlapSegment& seg, Communicator& team) : seg(seg), team(team) {}
  const OverlapSegment& seg;
  Communicator& team;
  std::vector<const Compute*> ops;
  std::vector<std::int64_t> part_offset;  // per member, the first row of its part
  const Communication* gather = nullptr;
  const Communication* scatter = nullptr;
  bool gathered_escapes = false;  // a later step reads the gathered tensor: it is kept whole
  // This rank's part, and its memory for Work::keep_alive (Interpreter::sendable; a contiguous
  // copy when it was not contiguous).
  Tensor gather_memory;
  TensorView gather_input;
  TensorView gathered, scattered;  // the chunk's communication buffers
};

// At the end of a segment's form, also when it throws: the caller's stream waits for the chunk
// streams (CUDA), so the buffers it frees are no longer in use there, and every communication
// still in flight is waited (its error, once reported, is not thrown again), so none outlives
// the buffers it reads or writes.
struct Interpreter::Settle {
  Settle(Interpreter& in, std::vector<std::vector<Work>*> works) : in(in), works(std::move(works)) {}
  ~Settle() {
    for (std::vector<Work>* list : works)
      for (Work& w : *list) try {
          w.wait();
        } catch (...) {
        }
    if (in.device_.type == DeviceType::CUDA)
      for (const Stream& s : in.chunk_streams_) try {
          wait_stream(in.stream_, s);
        } catch (...) {
        }
  }
  Settle(const Settle&) = delete;
  Settle& operator=(const Settle&) = delete;
  Interpreter& in;
  std::vector<std::vector<Work>*> works;
};

namespace {

// numpy.array_split of n rows into k pieces: piece c's first row and size.
std::pair<std::int64_t, std::int64_t> piece(std::int64_t n, std::int64_t k, std::int64_t c) {
  const std::int64_t q = n / k, r = n % k;
  return {c * q + std::min(c, r), q + (c < r ? 1 : 0)};
}

Tensor rows_like(const PlanValue& v, std::int64_t rows, Device device, const Stream& stream) {
  Shape shape = v.shape;
  shape[0] = rows;
  return Tensor(shape, v.dtype, device, stream);
}

}  // namespace

void Interpreter::run_segment(const OverlapSegment& seg) {
  const auto step = [&](std::int64_t s) -> const PlanStep& {
    return plan_.steps[static_cast<std::size_t>(s)];
  };
  Chunked ch{seg, *teams_[static_cast<std::size_t>(seg.mesh_dim)]};
  const std::int64_t m = std::accumulate(seg.sizes.begin(), seg.sizes.end(), std::int64_t{0});
  if (m == 0) {  // no rows to chunk: the steps as they are
    for (std::int64_t s = seg.first; s <= seg.last; ++s)
      std::visit([&](const auto& st) { run_step(st); }, step(s));
    return;
  }
  for (std::int64_t s = seg.first; s <= seg.last; ++s)
    if (const auto* c = std::get_if<Compute>(&step(s))) ch.ops.push_back(c);
  ch.part_offset.assign(1, 0);
  for (std::int64_t rows : seg.sizes) ch.part_offset.push_back(ch.part_offset.back() + rows);
  if (seg.gather >= 0) {
    ch.gather = &std::get<Communication>(step(seg.gather));
    // Kept whole when a later step reads it, or an op sums over its rows.
    ch.gathered_escapes = facts_.last_use[static_cast<std::size_t>(ch.gather->output)] > seg.last;
    for (const Compute* c : ch.ops) {
      const RowRoles roles = row_roles(c->op);
      const bool sums = std::find(roles.summed_outputs.begin(), roles.summed_outputs.end(),
                                  true) != roles.summed_outputs.end();
      for (std::size_t i = 0; i < c->op.inputs.size(); ++i)
        ch.gathered_escapes |= sums && c->op.inputs[i].defined() &&
                               c->op.inputs[i].id == ch.gather->output;
    }
    ch.gather_input = view(ch.gather->input);
    ch.gather_memory = ch.gather_input.is_contiguous() ? sendable(ch.gather->input)
                                                       : Tensor::copy_of(ch.gather_input, stream_);
    if (ch.gather_memory.defined()) ch.gather_input = ch.gather_memory.view();
    if (ch.gathered_escapes) allocate(ch.gather->output);
  }
  if (seg.scatter >= 0) {
    ch.scatter = &std::get<Communication>(step(seg.scatter));
    MESHFUSE_CHECK(seg.form != Overlap::Ring || *ch.scatter->reduction == ReduceOp::Sum,
                   ErrorCode::Unsupported,
                   "MultiDeviceExecutor: ring overlap sums partial results; {} is not a sum",
                   ch.scatter->to_string());
    allocate(ch.scatter->output);
  }
  for (const Compute* c : ch.ops)
    for (std::size_t j = 0; j < c->op.outputs.size(); ++j) {
      const std::int64_t id = c->op.outputs[j].id;
      if (!unused_result(c->op, j) && !(ch.scatter && id == ch.scatter->input)) allocate(id);
    }
  if (seg.form == Overlap::Collective)
    run_collective_segment(ch);
  else if (ch.gather)
    run_ring_gather(ch);
  else
    run_ring_scatter(ch);
}

void Interpreter::run_block(Chunked& ch, const Block& b, const Stream& stream) {
  if (b.rows == 0) return;
  const auto rows = [&](std::int64_t id) {
    if (ch.gather && id == ch.gather->output) return ch.gathered.narrow(0, b.at, b.rows);
    if (ch.scatter && id == ch.scatter->input) return ch.scattered.narrow(0, b.at, b.rows);
    return view(id).narrow(0, b.offset, b.rows);
  };
  if (ch.gathered_escapes)
    copy(ch.gathered.narrow(0, b.at, b.rows), view(ch.gather->output).narrow(0, b.offset, b.rows),
         stream);
  for (const Compute* c : ch.ops) {
    const RowRoles roles = row_roles(c->op);
    std::vector<TensorView> in, out;
    for (std::size_t i = 0; i < c->op.inputs.size(); ++i) {
      const Value v = c->op.inputs[i];
      in.push_back(!v.defined() ? TensorView() : roles.row_inputs[i] ? rows(v.id) : view(v.id));
    }
    for (std::size_t j = 0; j < c->op.outputs.size(); ++j)
      out.push_back(roles.row_outputs[j] && !unused_result(c->op, j) ? rows(c->op.outputs[j].id)
                                                                     : TensorView());
    run_op(c->op, in, out, stream);
  }
}

void Interpreter::run_sums(const Chunked& ch, const Stream& stream) {
  for (const Compute* c : ch.ops) {
    const RowRoles roles = row_roles(c->op);
    if (std::find(roles.summed_outputs.begin(), roles.summed_outputs.end(), true) ==
        roles.summed_outputs.end())
      continue;
    std::vector<TensorView> in, out;
    for (Value v : c->op.inputs) in.push_back(v.defined() ? view(v.id) : TensorView());
    for (std::size_t j = 0; j < c->op.outputs.size(); ++j)
      out.push_back(roles.summed_outputs[j] ? view(c->op.outputs[j].id) : TensorView());
    run_op(c->op, in, out, stream);
  }
}

void Interpreter::run_collective_segment(Chunked& ch) {
  const OverlapSegment& seg = ch.seg;
  const auto d = static_cast<std::int64_t>(seg.sizes.size());
  const std::int64_t chunks = seg.chunks, me = ch.team.rank();
  const bool cuda = device_.type == DeviceType::CUDA;
  // Chunk c on stream c % number_of_streams, its buffers in slot c % slots: a slot is reused on
  // its own stream (or, on one stream, after the chunk before it), and chunk c + 1's all_gather
  // never lands in the slot chunk c computes from.
  const std::size_t streams = chunk_streams_.size();
  const std::size_t slots = cuda ? std::max<std::size_t>(2, streams) : 2;
  const auto on = [&](std::int64_t c) -> const Stream& {
    return cuda ? chunk_streams_[static_cast<std::size_t>(c) % streams] : stream_;
  };
  const auto sizes_of = [&](std::int64_t c) {
    std::vector<std::int64_t> sizes;
    for (std::int64_t rows : seg.sizes) sizes.push_back(piece(rows, chunks, c).second);
    return sizes;
  };
  const auto total = [](const std::vector<std::int64_t>& sizes) {
    return std::accumulate(sizes.begin(), sizes.end(), std::int64_t{0});
  };
  const std::int64_t most = total(sizes_of(0));  // array_split's first pieces are the largest
  std::vector<Tensor> gather_buf, scatter_buf;
  for (std::size_t k = 0; k < slots; ++k) {
    if (ch.gather)
      gather_buf.push_back(rows_like(plan_.values[static_cast<std::size_t>(ch.gather->output)],
                                     most, device_, stream_));
    if (ch.scatter)
      scatter_buf.push_back(rows_like(plan_.values[static_cast<std::size_t>(ch.scatter->input)],
                                      most, device_, stream_));
  }
  if (cuda)
    for (const Stream& s : chunk_streams_) wait_stream(s, stream_);
  std::vector<StreamEvent> computed(slots);  // per slot, after its last chunk's blocks
  std::vector<Work> gathers(static_cast<std::size_t>(chunks));
  std::vector<Work> scatters(static_cast<std::size_t>(chunks));
  const Settle settle(*this, {&gathers, &scatters});
  const auto gather = [&](std::int64_t c) {
    const std::vector<std::int64_t> sizes = sizes_of(c);
    if (total(sizes) == 0) return;
    const auto [first, rows] = piece(seg.sizes[static_cast<std::size_t>(me)], chunks, c);
    const Tensor& buffer = gather_buf[static_cast<std::size_t>(c) % slots];
    gathers[static_cast<std::size_t>(c)] =
        ch.team
            .all_gather(ch.gather_input.narrow(0, first, rows),
                        buffer.view().narrow(0, 0, total(sizes)), sizes, on(c))
            .keep_alive({ch.gather_memory, buffer});
  };
  if (ch.gather) gather(0);
  for (std::int64_t c = 0; c < chunks; ++c) {
    const auto slot = static_cast<std::size_t>(c) % slots;
    if (ch.gather && c + 1 < chunks) gather(c + 1);  // chunk c + 1's transfer under c's compute
    if (ch.gather) finish(std::move(gathers[static_cast<std::size_t>(c)]));
    // The CPU's reduce_scatter of chunk c - slots still reads this slot's buffer.
    if (ch.scatter && !cuda && c >= static_cast<std::int64_t>(slots))
      scatters[static_cast<std::size_t>(c) - slots].wait();
    if (ch.gather) ch.gathered = gather_buf[slot].view();
    if (ch.scatter) ch.scattered = scatter_buf[slot].view();
    std::int64_t at = 0;
    for (std::int64_t r = 0; r < d; ++r) {
      const auto [first, rows] = piece(seg.sizes[static_cast<std::size_t>(r)], chunks, c);
      run_block(ch, {static_cast<int>(r), ch.part_offset[static_cast<std::size_t>(r)] + first,
                     rows, at},
                on(c));
      at += rows;
    }
    computed[slot].record(on(c));
    if (ch.scatter && at > 0) {
      const auto [first, rows] = piece(seg.sizes[static_cast<std::size_t>(me)], chunks, c);
      scatters[static_cast<std::size_t>(c)] =
          ch.team
              .reduce_scatter(ch.scattered.narrow(0, 0, at),
                              view(ch.scatter->output).narrow(0, first, rows), sizes_of(c),
                              *ch.scatter->reduction, on(c))
              .keep_alive({scatter_buf[slot], owner(ch.scatter->output)});
    }
  }
  // The sums over all rows run while the last reduce_scatters do.
  const Stream& sums = on(chunks);
  for (const StreamEvent& e : computed) e.wait(sums);
  run_sums(ch, sums);
  for (Work& w : scatters) finish(std::move(w));
}

// A ring's neighbours and streams: transfers on T, compute on C (on the CPU both are the caller's),
// and two buffers of the largest part for each tensor that passes, one in hand and one arriving.
struct Interpreter::Ring {
  int d = 0, me = 0, next = 0, prev = 0;
  const Stream& T;
  const Stream& C;
  std::int64_t most = 0;
  std::array<Tensor, 2> buffers(const PlanValue& v, Device device, const Stream& stream) const {
    return {rows_like(v, most, device, stream), rows_like(v, most, device, stream)};
  }
  // After the buffers are allocated on `caller`: T and C may use them from here on.
  void start(const Stream& caller) const {
    wait_stream(T, caller);
    wait_stream(C, caller);
  }
};

Interpreter::Ring Interpreter::ring_of(const Chunked& ch) const {
  const auto d = static_cast<int>(ch.seg.sizes.size());
  const int me = ch.team.rank();
  const bool cuda = device_.type == DeviceType::CUDA;
  return {d,
          me,
          (me + 1) % d,
          (me + d - 1) % d,
          cuda ? chunk_streams_.front() : stream_,
          cuda ? chunk_streams_[std::min<std::size_t>(1, chunk_streams_.size() - 1)] : stream_,
          *std::max_element(ch.seg.sizes.begin(), ch.seg.sizes.end())};
}

void Interpreter::run_ring_gather(Chunked& ch) {
  const OverlapSegment& seg = ch.seg;
  const Ring ring = ring_of(ch);
  const int d = ring.d, me = ring.me, next = ring.next, prev = ring.prev;
  const Stream& T = ring.T;
  const Stream& C = ring.C;
  const auto hold =
      ring.buffers(plan_.values[static_cast<std::size_t>(ch.gather->output)], device_, stream_);
  ring.start(stream_);
  StreamEvent received, computed;
  std::vector<Work> passed(1);
  const Settle settle(*this, {&passed});
  TensorView in_hand = ch.gather_input;
  for (int s = 0; s < d; ++s) {
    const int r = (me - s + d) % d;  // whose part is in hand
    TensorView arriving;
    if (s + 1 < d) {
      // The slot was read at step s - 1: by its compute (on C) and its send (waited here).
      passed[0].wait();
      computed.wait(T);
      arriving = hold[(s + 1) % 2].view().narrow(0, 0, seg.sizes[static_cast<std::size_t>(
                                                        (r + d - 1) % d)]);
      passed[0] = ch.team.send_recv(in_hand, next, arriving, prev, 0, T)
                      .keep_alive({ch.gather_memory, hold[0], hold[1]});
      received.record(T);
    }
    ch.gathered = in_hand;
    run_block(ch, {r, ch.part_offset[static_cast<std::size_t>(r)],
                   seg.sizes[static_cast<std::size_t>(r)], 0},
              C);
    computed.record(C);
    if (s + 1 < d) {
      finish(passed[0]);
      received.wait(C);
      in_hand = arriving;
    }
  }
  run_sums(ch, C);
  passed[0].wait();
}

void Interpreter::run_ring_scatter(Chunked& ch) {
  const OverlapSegment& seg = ch.seg;
  const Ring ring = ring_of(ch);
  const int d = ring.d, me = ring.me, next = ring.next, prev = ring.prev;
  const Stream& T = ring.T;
  const Stream& C = ring.C;
  const PlanValue& partial = plan_.values[static_cast<std::size_t>(ch.scatter->input)];
  const auto part = ring.buffers(partial, device_, stream_);
  const auto sum = ring.buffers(partial, device_, stream_);
  ring.start(stream_);
  StreamEvent received, added;
  std::vector<Work> passed(2);  // per slot: its step's send_recv
  const Settle settle(*this, {&passed});
  // The sum of block b starts at rank b + 1 and passes rank to rank, each adding its term, to end
  // at rank b after d - 1 steps: at step s this rank adds its term of block me - 1 - s.
  for (int s = 0; s < d; ++s) {
    const int r = (me - 1 - s + 2 * d) % d;
    const std::int64_t rows = seg.sizes[static_cast<std::size_t>(r)];
    const TensorView mine = part[s % 2].view().narrow(0, 0, rows);
    // The slot's send of step s - 2 has finished on the device (wait blocks the host until then),
    // so the block may overwrite it; C does not wait for T, which holds step s - 1's transfer
    // that this block is to overlap.
    passed[s % 2].wait();
    ch.scattered = part[s % 2].view();
    run_block(ch, {r, ch.part_offset[static_cast<std::size_t>(r)], rows, 0}, C);
    if (s > 0) {
      finish(passed[(s + 1) % 2]);
      received.wait(C);
      add(mine, sum[s % 2].view().narrow(0, 0, rows), mine, 1.0, C);
    }
    if (s + 1 < d) {
      added.record(C);
      added.wait(T);
      const std::int64_t coming = seg.sizes[static_cast<std::size_t>((r + d - 1) % d)];
      passed[s % 2] =
          ch.team.send_recv(mine, next, sum[(s + 1) % 2].view().narrow(0, 0, coming), prev, 0, T)
              .keep_alive({part[s % 2], sum[(s + 1) % 2]});
      received.record(T);
    } else {
      copy(mine, view(ch.scatter->output), C);
    }
  }
  run_sums(ch, C);
  for (Work& w : passed) w.wait();
}

}  // namespace meshfuse::detail
