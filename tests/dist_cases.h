// The communicator checks shared by the local (threads, CPU and CUDA tensors) and the gloo / mpi
// (processes) tests. Every rank of a team calls the same function; each EXPECTs its own result
// against values computed from all ranks' inputs. Inputs are small integers, so sums, products and
// averages over a few ranks are exact in bf16 too and every result is compared exactly.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "meshfuse/distributed/communicator.h"
#include "test_util.h"

namespace meshfuse::test::dist {

// Where a rank's checks put their tensors and queue their operations: the CPU, unless the rank's
// thread sets a stream of its GPU (the local backend on CUDA tensors).
inline Stream& place() {
  thread_local Stream stream;
  return stream;
}

inline Tensor zeros(Shape shape, DType dtype) {
  return Tensor::zeros(std::move(shape), dtype, place().device, place());
}

inline const std::vector<DType> kDTypes = {DType::F32, DType::BF16, DType::I64};
inline const std::vector<ReduceOp> kReduceOps = {ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min,
                                                 ReduceOp::Max, ReduceOp::Avg};

// Rank r's element i: integers in [-6, 6]; for products, factors in {-2, -1, 1, 2}.
inline double value(int rank, std::int64_t i, ReduceOp op = ReduceOp::Sum) {
  if (op == ReduceOp::Prod) {
    static const double kFactors[] = {-2, -1, 1, 2};
    return kFactors[(rank + i) % 4];
  }
  return static_cast<double>((rank * 7 + i * 3) % 13 - 6);
}

inline std::vector<double> values(int rank, std::int64_t n, ReduceOp op = ReduceOp::Sum,
                                  std::int64_t first = 0) {
  std::vector<double> v(n);
  for (std::int64_t i = 0; i < n; ++i) v[i] = value(rank, first + i, op);
  return v;
}

inline Tensor tensor_of(const std::vector<double>& v, DType dtype, Shape shape) {
  Tensor d(shape, DType::F64);
  std::copy(v.begin(), v.end(), d.data_ptr<double>());
  Tensor t(std::move(shape), dtype, place().device, place());
  copy(d, t, place());
  return t;
}

inline std::vector<double> values_of(const TensorView& t) {
  Tensor d(t.shape(), DType::F64);
  copy(t, d, place());  // from a GPU: waits for the stream
  return {d.data_ptr<double>(), d.data_ptr<double>() + d.numel()};
}

inline double reduce_values(ReduceOp op, const std::vector<double>& xs) {
  double acc = xs[0];
  for (std::size_t i = 1; i < xs.size(); ++i) {
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg:
        acc += xs[i];
        break;
      case ReduceOp::Prod:
        acc *= xs[i];
        break;
      case ReduceOp::Min:
        acc = std::min(acc, xs[i]);
        break;
      case ReduceOp::Max:
        acc = std::max(acc, xs[i]);
        break;
    }
  }
  return op == ReduceOp::Avg ? acc / static_cast<double>(xs.size()) : acc;
}

// Element i reduced over the ranks' values(rank, ...) starting at `first`.
inline std::vector<double> reduced(int size, std::int64_t n, ReduceOp op, std::int64_t first = 0) {
  std::vector<double> out(n);
  for (std::int64_t i = 0; i < n; ++i) {
    std::vector<double> xs;
    for (int r = 0; r < size; ++r) xs.push_back(value(r, first + i, op));
    out[i] = reduce_values(op, xs);
  }
  return out;
}

inline std::string where(const Communicator& c, DType dtype, const std::string& what) {
  return fmt::format("{} {} on rank {} of {}", what, to_string(dtype), c.rank(), c.size());
}

inline std::vector<std::int64_t> prefix_sums(const std::vector<std::int64_t>& v) {
  std::vector<std::int64_t> out(v.size() + 1, 0);
  std::partial_sum(v.begin(), v.end(), out.begin() + 1);
  return out;
}

inline void check_all_reduce(Communicator& c, DType dtype, ReduceOp op) {
  if (op == ReduceOp::Avg && !is_floating_point(dtype)) return;
  const std::int64_t n = 37;  // not a multiple of the team size
  Tensor t = tensor_of(values(c.rank(), n, op), dtype, {n});
  c.all_reduce(t, op, place()).wait();
  EXPECT_EQ(values_of(t), reduced(c.size(), n, op))
      << where(c, dtype, fmt::format("all_reduce({})", to_string(op)));
}

inline void check_broadcast(Communicator& c, DType dtype) {
  const int root = c.size() - 1;
  Tensor t = tensor_of(values(c.rank(), 11), dtype, {11});
  c.broadcast(t, root, place()).wait();
  EXPECT_EQ(values_of(t), values(root, 11)) << where(c, dtype, "broadcast");
}

inline void check_reduce(Communicator& c, DType dtype, ReduceOp op) {
  if (op == ReduceOp::Avg && !is_floating_point(dtype)) return;
  const int root = 1 % c.size();
  Tensor t = tensor_of(values(c.rank(), 13, op), dtype, {13});
  c.reduce(t, root, op, place()).wait();
  EXPECT_EQ(values_of(t), c.rank() == root ? reduced(c.size(), 13, op) : values(c.rank(), 13, op))
      << where(c, dtype, "reduce");
}

// Equal: 3 rows of 2 per rank. Uneven: r % 3 rows per rank (ranks with none included).
inline void check_all_gather(Communicator& c, DType dtype, bool uneven) {
  std::vector<std::int64_t> rows(c.size(), 3);
  if (uneven)
    for (int r = 0; r < c.size(); ++r) rows[r] = r % 3;
  const auto starts = prefix_sums(rows);
  Tensor in = tensor_of(values(c.rank(), rows[c.rank()] * 2), dtype, {rows[c.rank()], 2});
  Tensor out = zeros({starts.back(), 2}, dtype);
  (uneven ? c.all_gather(in, out, rows, place()) : c.all_gather(in, out, place())).wait();
  std::vector<double> expected;
  for (int r = 0; r < c.size(); ++r) {
    const auto v = values(r, rows[r] * 2);
    expected.insert(expected.end(), v.begin(), v.end());
  }
  EXPECT_EQ(values_of(out), expected)
      << where(c, dtype, uneven ? "uneven all_gather" : "all_gather");
}

// Equal: 2 rows of 3 per rank. Uneven: (r + 2) % 3 rows for rank r.
inline void check_reduce_scatter(Communicator& c, DType dtype, bool uneven, ReduceOp op) {
  if (op == ReduceOp::Avg && !is_floating_point(dtype)) return;
  std::vector<std::int64_t> rows(c.size(), 2);
  if (uneven)
    for (int r = 0; r < c.size(); ++r) rows[r] = (r + 2) % 3;
  const auto starts = prefix_sums(rows);
  Tensor in = tensor_of(values(c.rank(), starts.back() * 3, op), dtype, {starts.back(), 3});
  Tensor out = zeros({rows[c.rank()], 3}, dtype);
  (uneven ? c.reduce_scatter(in, out, rows, op, place()) : c.reduce_scatter(in, out, op, place()))
      .wait();
  EXPECT_EQ(values_of(out), reduced(c.size(), rows[c.rank()] * 3, op, starts[c.rank()] * 3))
      << where(c, dtype,
               fmt::format("{}reduce_scatter({})", uneven ? "uneven " : "", to_string(op)));
}

// The in-place forms: all_gather from this rank's block of its output, reduce_scatter into this
// rank's block of its input (mpi passes MPI_IN_PLACE or a copy: aliased buffers are erroneous
// there). Uneven: r % 3 + 1 rows of 2 for rank r.
inline void check_in_place(Communicator& c, DType dtype) {
  std::vector<std::int64_t> rows(c.size());
  for (int r = 0; r < c.size(); ++r) rows[r] = r % 3 + 1;
  const auto starts = prefix_sums(rows);
  const std::int64_t mine = rows[c.rank()] * 2, first = starts[c.rank()] * 2;
  const auto block = [&](Tensor& whole) {
    auto* data = static_cast<std::uint8_t*>(whole.view().data());
    return TensorView(data + first * static_cast<std::int64_t>(element_size(dtype)), dtype,
                      {rows[c.rank()], 2}, whole.device());
  };
  std::vector<double> given(starts.back() * 2, -1.0);
  const auto v = values(c.rank(), mine);
  std::copy(v.begin(), v.end(), given.begin() + first);
  Tensor gathered = tensor_of(given, dtype, {starts.back(), 2});
  c.all_gather(block(gathered), gathered, rows, place()).wait();
  std::vector<double> expected;
  for (int r = 0; r < c.size(); ++r) {
    const auto w = values(r, rows[r] * 2);
    expected.insert(expected.end(), w.begin(), w.end());
  }
  EXPECT_EQ(values_of(gathered), expected) << where(c, dtype, "in-place all_gather");
  Tensor summed = tensor_of(values(c.rank(), starts.back() * 2), dtype, {starts.back(), 2});
  c.reduce_scatter(summed, block(summed), rows, ReduceOp::Sum, place()).wait();
  EXPECT_EQ(values_of(block(summed)), reduced(c.size(), mine, ReduceOp::Sum, first))
      << where(c, dtype, "in-place reduce_scatter");
}

inline void check_gather(Communicator& c, DType dtype) {
  const int root = c.size() / 2;
  Tensor in = tensor_of(values(c.rank(), 5), dtype, {5});
  Tensor out = c.rank() == root ? zeros({5 * c.size()}, dtype) : Tensor();
  c.gather(in, out.view(), root, place()).wait();
  if (c.rank() != root) return;
  std::vector<double> expected;
  for (int r = 0; r < c.size(); ++r) {
    const auto v = values(r, 5);
    expected.insert(expected.end(), v.begin(), v.end());
  }
  EXPECT_EQ(values_of(out), expected) << where(c, dtype, "gather");
}

inline void check_scatter(Communicator& c, DType dtype) {
  const int root = c.size() / 2;
  Tensor in =
      c.rank() == root ? tensor_of(values(root, 4 * c.size()), dtype, {4 * c.size()}) : Tensor();
  Tensor out = zeros({4}, dtype);
  c.scatter(in.view(), out, root, place()).wait();
  EXPECT_EQ(values_of(out), values(root, 4, ReduceOp::Sum, 4 * c.rank()))
      << where(c, dtype, "scatter");
}

// Rows of 2 elements. Equal: 2 rows to every rank. Uneven: rank r sends (r + s) % 3 rows to s.
inline void check_all_to_all(Communicator& c, DType dtype, bool uneven) {
  const int n = c.size(), me = c.rank();
  auto rows_from_to = [&](int from, int to) { return uneven ? (from + to) % 3 : 2; };
  std::vector<std::int64_t> in_rows(n), out_rows(n);
  for (int s = 0; s < n; ++s) {
    in_rows[s] = rows_from_to(me, s);
    out_rows[s] = rows_from_to(s, me);
  }
  const auto in_starts = prefix_sums(in_rows), out_starts = prefix_sums(out_rows);
  Tensor in = tensor_of(values(me, in_starts.back() * 2), dtype, {in_starts.back(), 2});
  Tensor out = zeros({out_starts.back(), 2}, dtype);
  (uneven ? c.all_to_all(in, out, in_rows, out_rows, place())
          : c.all_to_all(in, out, {}, {}, place()))
      .wait();
  std::vector<double> expected;
  for (int s = 0; s < n; ++s) {
    std::int64_t first = 0;  // rank s's rows before its block for this rank
    for (int r = 0; r < me; ++r) first += rows_from_to(s, r);
    const auto v = values(s, rows_from_to(s, me) * 2, ReduceOp::Sum, first * 2);
    expected.insert(expected.end(), v.begin(), v.end());
  }
  EXPECT_EQ(values_of(out), expected)
      << where(c, dtype, uneven ? "uneven all_to_all" : "all_to_all");
}

// A ring: every rank sends to the next and receives from the previous (receive posted first, but
// on CUDA tensors, where the local backend's recv waits on the host for its send).
inline void check_send_recv(Communicator& c, DType dtype) {
  const int n = c.size(), next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
  Tensor mine = tensor_of(values(c.rank(), 9), dtype, {9});
  Tensor got = zeros({9}, dtype);
  const bool cuda = place().device.type == DeviceType::CUDA;
  std::optional<Work> s;
  if (cuda) s = c.send(mine, next, 3, place());
  Work r = c.recv(got, prev, 3, place());
  if (!cuda) s = c.send(mine, next, 3, place());
  s->wait();
  r.wait();
  EXPECT_EQ(values_of(got), values(prev, 9)) << where(c, dtype, "send/recv");
}

// send_recv around the ring with parts of different sizes, rank 0's empty: rank r sends 3r
// elements to the next and receives the previous rank's.
inline void check_send_recv_pair(Communicator& c, DType dtype) {
  const int n = c.size(), next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
  Tensor mine = tensor_of(values(c.rank(), 3 * c.rank()), dtype, {3 * c.rank()});
  Tensor got = zeros({3 * prev}, dtype);
  Work w = c.send_recv(mine, next, got, prev, 2, place());
  w.wait();
  EXPECT_EQ(w.record().op, CommOp::SendRecv);
  EXPECT_EQ(w.record().source, prev);
  EXPECT_EQ(values_of(got), values(prev, 3 * prev)) << where(c, dtype, "send_recv");
}

// A tensor passed around the ring in size() - 1 steps (sends first, as check_send_recv does on
// CUDA): rank r ends with rank r + 1's.
inline void check_ring_pass(Communicator& c) {
  const int n = c.size(), next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
  Tensor have = tensor_of(values(c.rank(), 33), DType::F32, {33});
  Tensor got = zeros({33}, DType::F32);
  for (int step = 0; step + 1 < n; ++step) {
    Work s = c.send(have, next, 1, place());
    Work r = c.recv(got, prev, 1, place());
    s.wait();  // `have` is received into next
    r.wait();
    std::swap(have, got);
  }
  EXPECT_EQ(values_of(have), values(next, 33)) << "a ring of " << n - 1 << " steps";
}

// u32 reduces as unsigned: rank 0's 3e9 (past 2^31, negative as an i32) is the maximum, and the
// sum stays exact.
inline void check_u32_reductions(Communicator& c) {
  const double big = 3'000'000'000.0;
  Tensor sum = tensor_of({c.rank() == 0 ? big : 1.0}, DType::U32, {1});
  Tensor max = Tensor::copy_of(sum, place());
  c.all_reduce(sum, ReduceOp::Sum, place()).wait();
  c.all_reduce(max, ReduceOp::Max, place()).wait();
  EXPECT_EQ(values_of(sum), std::vector<double>{big + c.size() - 1})
      << where(c, DType::U32, "all_reduce(sum)");
  EXPECT_EQ(values_of(max), std::vector<double>{big}) << where(c, DType::U32, "all_reduce(max)");
}

// Every collective, dtype and shard kind.
inline void check_every_collective(Communicator& c) {
  for (DType dtype : kDTypes) {
    for (ReduceOp op : kReduceOps) {
      check_all_reduce(c, dtype, op);
      check_reduce(c, dtype, op);
    }
    check_broadcast(c, dtype);
    for (bool uneven : {false, true}) {
      check_all_gather(c, dtype, uneven);
      check_reduce_scatter(c, dtype, uneven, ReduceOp::Sum);
      check_reduce_scatter(c, dtype, uneven, uneven ? ReduceOp::Max : ReduceOp::Avg);
      check_all_to_all(c, dtype, uneven);
    }
    check_in_place(c, dtype);
    check_gather(c, dtype);
    check_scatter(c, dtype);
    check_send_recv(c, dtype);
    check_send_recv_pair(c, dtype);
  }
  check_u32_reductions(c);
  c.barrier(place()).wait();
}

// Asynchronous: several collectives in flight before the first wait, waited in reverse order.
inline void check_many_in_flight(Communicator& c) {
  std::vector<Tensor> ts;
  std::vector<Work> works;
  for (int k = 0; k < 4; ++k) {
    ts.push_back(tensor_of(values(c.rank(), 100 + k), DType::F32, {100 + k}));
    works.push_back(c.all_reduce(ts.back(), ReduceOp::Sum, place()));
  }
  for (int k = 3; k >= 0; --k) {
    works[k].wait();
    EXPECT_TRUE(works[k].is_completed());
    EXPECT_EQ(values_of(ts[k]), reduced(c.size(), 100 + k, ReduceOp::Sum)) << "in flight " << k;
  }
}

// Sub-teams: split by parity with the ranks reversed, and new_group of the first and last rank.
inline void check_sub_teams(Communicator& c) {
  const auto half = c.split(c.rank() % 2, -c.rank());
  ASSERT_NE(half, nullptr);
  std::vector<int> members;
  for (int r = c.size() - 1; r >= 0; --r)
    if (r % 2 == c.rank() % 2) members.push_back(c.team()[r]);
  EXPECT_EQ(half->team(), members);
  EXPECT_EQ(half->team()[half->rank()], c.team()[c.rank()]);
  Tensor t = tensor_of({static_cast<double>(c.rank())}, DType::I64, {1});
  half->all_reduce(t, ReduceOp::Sum, place()).wait();
  double sum = 0;
  for (int r = c.rank() % 2; r < c.size(); r += 2) sum += r;
  EXPECT_EQ(values_of(t), std::vector<double>{sum}) << "all_reduce over the split";

  const auto ends = c.new_group({c.size() - 1, 0});
  const bool member = c.rank() == 0 || c.rank() == c.size() - 1;
  ASSERT_EQ(ends != nullptr, member);
  if (ends) {
    EXPECT_EQ(ends->rank(), c.rank() == 0 ? 1 : 0);
    Tensor b = tensor_of({static_cast<double>(c.rank())}, DType::F32, {1});
    ends->broadcast(b, 0, place()).wait();  // from the last rank of c
    EXPECT_EQ(values_of(b), std::vector<double>{static_cast<double>(c.size() - 1)});
  }
  EXPECT_EQ(c.split(-1), nullptr);  // collective too: every rank opts out
}

// mesh_teams on a 2 x 2 mesh of permuted ranks: each rank's team along a dimension is the line of
// the mesh through it, ordered along that dimension, and communicates; asking again returns the
// same teams (split once) with the communicator's current settings, as with_backends keeps its
// team per spec; a line in rank order is the communicator itself; a mesh of other ranks is an
// error. Needs 4 ranks.
inline void check_mesh_teams(Communicator& c) {
  const DeviceMesh mesh({3, 1, 2, 0}, {2, 2});
  const auto teams = c.mesh_teams(mesh);
  ASSERT_EQ(teams.size(), 2u);
  for (std::int64_t m = 0; m < 2; ++m) {
    const auto& team = teams[static_cast<std::size_t>(m)];
    const std::vector<int> line = mesh.team(m, c.rank());
    std::vector<int> members;
    for (int r : line) members.push_back(c.team()[static_cast<std::size_t>(r)]);
    EXPECT_EQ(team->team(), members) << "dimension " << m;
    Tensor t = tensor_of({static_cast<double>(c.rank())}, DType::I64, {1});
    team->all_reduce(t, ReduceOp::Sum, place()).wait();
    EXPECT_EQ(values_of(t), std::vector<double>{static_cast<double>(line[0] + line[1])})
        << "all_reduce along dimension " << m;
  }
  EXPECT_EQ(c.mesh_teams(mesh), teams) << "a second call splits again";
  // The communicator's settings reach its kept teams when they change; a kept team's own setting
  // stays until then, also when the team is handed out again.
  const auto timeout = c.timeout(), longer = timeout + std::chrono::milliseconds(1234);
  const auto respecced = c.with_backends(c.spec());
  c.set_timeout(longer);
  c.set_checks(false);
  for (const auto& team : teams) {
    EXPECT_EQ(team->timeout(), longer);
    EXPECT_FALSE(team->checks());
  }
  EXPECT_EQ(respecced->timeout(), longer);
  EXPECT_FALSE(respecced->checks());
  teams[0]->set_timeout(timeout);
  EXPECT_EQ(c.mesh_teams(mesh)[0]->timeout(), timeout);
  EXPECT_EQ(c.with_backends(c.spec())->timeout(), longer);
  c.set_timeout(timeout);
  c.set_checks(true);
  EXPECT_TRUE(teams[1]->checks());
  EXPECT_EQ(respecced->timeout(), timeout);
  EXPECT_NE(c.mesh_teams(DeviceMesh({0, 1, 2, 3}, {2, 2}))[0], teams[0]);
  EXPECT_EQ(c.mesh_teams(DeviceMesh::of_shape({c.size()}))[0].get(), &c);
  EXPECT_EQ(c.with_backends(c.spec()), c.with_backends(c.spec()));
  expect_error(
      [&] {
        c.mesh_teams(DeviceMesh::of_shape({2, 3}));
      },
      ErrorCode::InvalidArgument, {"mesh_teams", "DeviceMesh([2, 3]", "ranks 0 .. 3"});
}

// Mismatched calls: every rank gets the same error naming the ranks and what differed, and the
// communicator stays usable. Needs 4 ranks.
inline void check_mismatch(Communicator& c) {
  const std::int64_t n = c.rank() == 2 ? 512 : 1024;
  Tensor t = zeros({n}, DType::F32);
  expect_error(
      [&] { c.all_reduce(t, ReduceOp::Sum, place()); }, ErrorCode::InvalidArgument,
      {"ranks disagree", "rank 0 has all_reduce(sum) f32 x 1024",
       "rank 2 has all_reduce(sum) f32 x 512", "on " + std::string(to_string(c.backend()))});

  Tensor d = zeros({8}, c.rank() == 1 ? DType::I64 : DType::F32);
  if (c.rank() == 3)
    expect_error([&] { c.broadcast(d, 0, place()); }, ErrorCode::InvalidArgument,
                 {"rank 0 has all_reduce(max) f32 x 8", "rank 1 has all_reduce(max) i64 x 8",
                  "rank 3 has broadcast f32 x 8, root 0"});
  else
    expect_error([&] { c.all_reduce(d, ReduceOp::Max, place()); }, ErrorCode::InvalidArgument,
                 {"rank 1 has all_reduce(max) i64 x 8", "rank 3 has broadcast"});

  // Uneven all_gather where rank 3 passes other split sizes.
  const bool odd = c.rank() == 3;
  const std::vector<std::int64_t> sizes =
      odd ? std::vector<std::int64_t>{1, 1, 1, 1} : std::vector<std::int64_t>{1, 1, 1, 2};
  Tensor in = zeros({1}, DType::F32), out = zeros({odd ? 4 : 5}, DType::F32);
  expect_error([&] { c.all_gather(in, out, sizes, place()); }, ErrorCode::InvalidArgument,
               {"rank 0 has all_gather f32 split [1 1 1 2] elements but rank 3 has all_gather f32 "
                "split [1 1 1 1] elements"});

  // all_to_all where rank 1 expects more from rank 2 than rank 2 sends.
  std::vector<std::int64_t> in_rows{1, 1, 1, 1}, out_rows{1, 1, 1, 1};
  if (c.rank() == 1) out_rows[2] = 2;
  Tensor a = zeros({4}, DType::F32);
  Tensor b = zeros({c.rank() == 1 ? 5 : 4}, DType::F32);
  expect_error([&] { c.all_to_all(a, b, in_rows, out_rows, place()); }, ErrorCode::InvalidArgument,
               {"rank 2 sends 1 elements to rank 1, which expects 2"});

  // Still in step.
  Tensor ok = tensor_of(values(c.rank(), 6), DType::F32, {6});
  c.all_reduce(ok, ReduceOp::Sum, place()).wait();
  EXPECT_EQ(values_of(ok), reduced(c.size(), 6, ReduceOp::Sum)) << "after the mismatches";
}

// The last rank never calls: the others get Timeout, with the check (from the call) and without
// it (from wait); afterwards the sub-team refuses work. The world team stays usable.
inline void check_timeout(Communicator& c) {
  const bool absent = c.rank() == c.size() - 1;
  for (bool checks : {true, false}) {
    auto sub = c.split(0, c.rank());
    sub->set_checks(checks);
    // Every backend set up on every rank before one goes missing, with the long timeout (4 ASan
    // ranks on 2 cores could take more than 500 ms to connect); the short one applies after.
    sub->barrier(place()).wait();
    sub->set_timeout(std::chrono::milliseconds(500));
    if (!absent) {
      Tensor t = zeros({16}, DType::F32);
      // Its own deadline, or a peer that timed out first and closed its connections (gloo): either
      // way a clear error naming the operation, never a hang.
      try {
        sub->all_reduce(t, ReduceOp::Sum, place()).wait();
        ADD_FAILURE() << "expected an Error";
      } catch (const Error& e) {
        const std::string what = e.what();
        EXPECT_TRUE(e.code() == ErrorCode::Timeout || e.code() == ErrorCode::CommunicationFailure)
            << what;
        EXPECT_NE(what.find("all_reduce(sum) f32 x 16"), std::string::npos) << what;
        if (e.code() == ErrorCode::Timeout) {
          EXPECT_NE(what.find("not finished after 500 ms"), std::string::npos) << what;
        }
      }
      expect_error([&] { sub->barrier(place()); }, ErrorCode::CommunicationFailure,
                   {"unusable after an earlier failure"});
    }
    c.barrier(place())
        .wait();  // the absent rank keeps its sub-team until the others have timed out
  }
}

// is_completed() answers at once while another thread is inside wait() on the same work. CPU
// tensors (on CUDA, local's recv waits on the host for its send, which comes after a barrier here).
inline void check_is_completed_while_waiting(Communicator& c) {
  using namespace std::chrono_literals;
  Tensor t = Tensor::zeros({4}, DType::F32);
  if (c.rank() == 0 && c.size() > 1) {
    Work recv = c.recv(t, 1, 5);
    std::thread waiter([&] {
      try {
        recv.wait();
      } catch (const Error& e) {
        ADD_FAILURE() << e.what();
      }
    });
    std::this_thread::sleep_for(20ms);  // the waiter is in wait()
    const auto start = std::chrono::steady_clock::now();
    EXPECT_FALSE(recv.is_completed());
    // A waiting is_completed() would take until the send, after the barrier: far past 5 s.
    EXPECT_LT(std::chrono::steady_clock::now() - start, 5s) << "is_completed() waited";
    c.barrier().wait();  // the send comes only now
    waiter.join();
  } else {
    c.barrier().wait();
    if (c.rank() == 1) c.send(t, 0, 5).wait();
  }
}

// A receive whose wait timed out (no send ever comes) is dropped at once, not after the
// backend's own timeout (20 s in these tests). CPU tensors, as the check above.
inline void check_dropping_a_timed_out_recv(Communicator& c) {
  using namespace std::chrono_literals;
  auto sub = c.split(0, c.rank());
  sub->barrier().wait();  // backends set up on every rank
  if (c.rank() == 0 && c.size() > 1) {
    Tensor t = Tensor::zeros({4}, DType::F32);
    std::optional<Work> recv = sub->recv(t, 1, 9);
    expect_error([&] { recv->wait(50ms); }, ErrorCode::Timeout, {"recv"});
    const auto start = std::chrono::steady_clock::now();
    recv.reset();
    EXPECT_LT(std::chrono::steady_clock::now() - start, 2s) << "dropping the work waited";
  }
  c.barrier().wait();
}

// A recv smaller than the matching send fails on the receiving rank and aborts nothing (gloo once
// aborted the process from its own thread); on gloo it matches no send and times out, on local
// and mpi it fails at once. Ranks 0 and 1 of a sub-team, so that the world stays usable.
inline void check_recv_of_another_size(Communicator& c) {
  using namespace std::chrono_literals;
  auto sub = c.split(0, c.rank());
  sub->barrier().wait();  // backends set up on every rank
  if (c.size() > 1 && c.rank() <= 1) {
    Tensor t = Tensor::zeros({c.rank() == 0 ? 3 : 2}, DType::F32);
    std::optional<Work> w = c.rank() == 0 ? sub->send(t, 1, 12) : sub->recv(t, 0, 12);
    if (c.rank() == 1) {
      try {
        w->wait(500ms);
        ADD_FAILURE() << "a recv of 8 bytes from a send of 12 succeeded";
      } catch (const Error& e) {
        EXPECT_TRUE(e.code() == ErrorCode::Timeout || e.code() == ErrorCode::CommunicationFailure)
            << e.what();
        EXPECT_NE(std::string(e.what()).find("recv"), std::string::npos) << e.what();
      }
    }
  }
  c.barrier().wait();
}

// With checks on, the last rank arrives only after the others' metadata exchange has timed out:
// the backend may then complete the abandoned exchange, into buffers that must still be alive
// (this is for ASan), and the others carry on. Gloo's own transfers take the 200 ms too, so a peer
// that timed out first may have closed its connections: a CommunicationFailure then.
inline void check_late_rank_after_timeout(Communicator& c) {
  const bool late = c.rank() == c.size() - 1;
  auto sub = c.split(0, c.rank());
  sub->barrier(place()).wait();  // backends set up with the long timeout
  sub->set_timeout(std::chrono::milliseconds(200));
  Tensor t = zeros({16}, DType::F32);
  if (!late) {
    try {
      sub->all_reduce(t, ReduceOp::Sum, place());
      ADD_FAILURE() << "expected an Error";
    } catch (const Error& e) {
      const std::string what = e.what();
      if (e.code() == ErrorCode::Timeout)
        EXPECT_NE(what.find("not finished after 200 ms"), std::string::npos) << what;
      else
        EXPECT_EQ(e.code(), ErrorCode::CommunicationFailure) << what;
    }
  }
  c.barrier(place()).wait();
  if (late) {
    // Its barrier meets the others' all_reduce: a mismatch (local: the team has given up).
    try {
      sub->barrier(place()).wait();
      ADD_FAILURE() << "expected an Error";
    } catch (const Error& e) {
      EXPECT_TRUE(e.code() == ErrorCode::InvalidArgument ||
                  e.code() == ErrorCode::CommunicationFailure)
          << e.what();
    }
  }
  c.barrier(place()).wait();
}

// The last rank arrives only after the others' waits have timed out (300 ms) while their transfer
// goes on (gloo's own timeout is the communicator's 20 s): gloo then writes into the buffers the
// others gave to Work::keep_alive and dropped (ASan: freed memory otherwise), and the last rank's
// sum has every rank's term. An operation queued behind the timed-out one fails at once instead
// of starting. gloo and local (mpi cannot abandon its second operation), CPU tensors, checks off.
inline void check_buffers_outlive_a_timed_out_wait(Communicator& c) {
  using namespace std::chrono_literals;
  const CommunicatorBackend backend = c.backend();
  if (backend == CommunicatorBackend::Mpi || c.size() < 2) return;
  const bool late = c.rank() == c.size() - 1;
  const auto filled = [&] {
    Tensor t({1 << 16}, DType::F32);
    std::fill_n(t.data_ptr<float>(), t.numel(), static_cast<float>(c.rank() + 1));
    return t;
  };
  auto sub = c.split(0, c.rank());
  sub->set_checks(false);
  sub->barrier().wait();  // backends set up on every rank
  if (!late) {
    Work second;
    {
      const Tensor t = filled(), u = filled();
      Work first = sub->all_reduce(t, ReduceOp::Sum).keep_alive({t});
      second = sub->all_reduce(u, ReduceOp::Sum).keep_alive({u});
      expect_error([&] { first.wait(300ms); }, ErrorCode::Timeout, {"all_reduce(sum) f32"});
    }
    const auto start = std::chrono::steady_clock::now();
    expect_error([&] { second.wait(); }, ErrorCode::CommunicationFailure, {});
    EXPECT_LT(std::chrono::steady_clock::now() - start, 2s) << "the queued operation ran";
  }
  c.barrier().wait();
  if (late) {
    const Tensor t = filled();
    if (backend == CommunicatorBackend::Gloo) {
      sub->all_reduce(t, ReduceOp::Sum).wait();
      const float n = static_cast<float>(c.size());
      EXPECT_EQ(t.data_ptr<float>()[0], n * (n + 1) / 2);
      EXPECT_EQ(t.data_ptr<float>()[t.numel() - 1], n * (n + 1) / 2);
    } else {  // local: the team was aborted when the others timed out
      expect_error([&] { sub->all_reduce(t, ReduceOp::Sum).wait(); },
                   ErrorCode::CommunicationFailure, {});
    }
  }
  c.barrier().wait();
}

// A receive whose Work is dropped before its message comes still takes it (its tensor alive, as
// the header asks), and the team goes on: on gloo the dropped receive buffer was freed while
// posted, and the message then wedged the pair (and spun Gloo's I/O thread), so that the next
// collective timed out.
inline void check_a_dropped_recv_still_takes_its_message(Communicator& c) {
  if (c.size() < 2) return;
  auto sub = c.split(0, c.rank());
  sub->barrier().wait();  // backends set up on every rank
  Tensor kept_elsewhere;  // rank 1's buffer, still readable here after the Work is gone
  if (c.rank() == 1) {
    const Tensor t = Tensor::zeros({1000}, DType::F32);
    kept_elsewhere = t;
    sub->recv(t, 0, 3);  // dropped at once
  }
  sub->barrier().wait();
  if (c.rank() == 0) {
    Tensor t({1000}, DType::F32);
    std::fill_n(t.data_ptr<float>(), 1000, 2.5f);
    sub->send(t, 1, 3).wait();
  }
  Tensor one = Tensor::zeros({4}, DType::F32);
  std::fill_n(one.data_ptr<float>(), 4, 1.0f);
  sub->all_reduce(one, ReduceOp::Sum).wait();
  EXPECT_EQ(one.data_ptr<float>()[3], static_cast<float>(c.size()));
  sub->barrier().wait();  // the message has come: the send completed before the all_reduce
  if (c.rank() == 1) {
    EXPECT_EQ(kept_elsewhere.data_ptr<float>()[0], 2.5f);
    EXPECT_EQ(kept_elsewhere.data_ptr<float>()[999], 2.5f);
  }
}

}  // namespace meshfuse::test::dist
