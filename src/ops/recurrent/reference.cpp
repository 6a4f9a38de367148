// Reference RNN and GRU: one sequence, one head, one step at a time, in double.
#include <cmath>
#include <vector>

#include "ops/common.h"
#include "ops/recurrent/recurrent_kernels.h"
#include "ops/recurrent/rows.h"

namespace meshfuse::detail::reference {
namespace {

using Vec = std::vector<double>;

// Reads and writes of head rows: tensor p of `heads` heads, token (or state) row `row`, head k.
template <typename T>
Vec load(const void* p, std::int64_t heads, std::int64_t row, std::int64_t k, std::int64_t h) {
  const T* src = static_cast<const T*>(p) + (row * heads + k) * h;
  Vec v(h);
  for (std::int64_t j = 0; j < h; ++j) v[j] = to_float(src[j]);
  return v;
}

template <typename T>
void store(void* p, std::int64_t heads, std::int64_t row, std::int64_t k, const Vec& v) {
  T* dst = static_cast<T*>(p) + (row * heads + k) * static_cast<std::int64_t>(v.size());
  for (std::size_t j = 0; j < v.size(); ++j) dst[j] = from_double<T>(v[j]);
}

// Head k of a weight tensor (H x H, row-major), in double.
template <typename T>
Vec load_weight(const void* p, std::int64_t k, std::int64_t h) {
  return load<T>(p, 1, k, 0, h * h);
}

// v @ W + x, v @ W^T (row-vector products with an H x H matrix).
Vec vec_mat(const Vec& v, const Vec& w, const Vec& x) {
  Vec a = x;
  const auto h = static_cast<std::int64_t>(v.size());
  for (std::int64_t i = 0; i < h; ++i)
    for (std::int64_t j = 0; j < h; ++j) a[j] += v[i] * w[i * h + j];
  return a;
}
Vec vec_mat_t(const Vec& v, const Vec& w) {
  const auto h = static_cast<std::int64_t>(v.size());
  Vec a(h, 0.0);
  for (std::int64_t i = 0; i < h; ++i)
    for (std::int64_t j = 0; j < h; ++j) a[i] += v[j] * w[i * h + j];
  return a;
}
// dw += u^T v for the H x H block at dw.
void add_outer(double* dw, const Vec& u, const Vec& v) {
  const auto h = static_cast<std::int64_t>(u.size());
  for (std::int64_t i = 0; i < h; ++i)
    for (std::int64_t j = 0; j < h; ++j) dw[i * h + j] += u[i] * v[j];
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// The state before the first step: input_state, or zeros.
template <typename T>
Vec initial_state(const RecurrentShape& s, const void* input_state, std::int64_t b,
                  std::int64_t n) {
  if (input_state == nullptr) return Vec(s.head_dim, 0.0);
  return load<T>(input_state, s.heads, b, n, s.head_dim);
}

// Gradient sums of the inputs and weights (broadcast heads add up), stored once at the end.
struct GradSums {
  std::vector<Vec> input, weight;  // per tensor: rows x heads x H, heads x H x H
  GradSums(const RecurrentShape& s, std::int64_t rows, int tensors) {
    for (int k = 0; k < tensors; ++k) {
      input.emplace_back(rows * s.input_heads[k] * s.head_dim, 0.0);
      weight.emplace_back(s.weight_heads[k] * s.head_dim * s.head_dim, 0.0);
    }
  }
  void add_input(const RecurrentShape& s, int k, std::int64_t row, std::int64_t n, const Vec& v) {
    const std::int64_t base =
        (row * s.input_heads[k] + source_head(s, s.input_heads[k], n)) * s.head_dim;
    for (std::int64_t j = 0; j < s.head_dim; ++j) input[k][base + j] += v[j];
  }
  void add_weight(const RecurrentShape& s, int k, std::int64_t n, const Vec& u, const Vec& v) {
    const std::int64_t h = s.head_dim;
    add_outer(weight[k].data() + source_head(s, s.weight_heads[k], n) * h * h, u, v);
  }
  template <typename T>
  void store_all(void* const* grad_input, void* const* grad_weight) const {
    for (std::size_t k = 0; k < input.size(); ++k) {
      T* gi = static_cast<T*>(grad_input[k]);
      for (std::size_t e = 0; e < input[k].size(); ++e) gi[e] = from_double<T>(input[k][e]);
      T* gw = static_cast<T*>(grad_weight[k]);
      for (std::size_t e = 0; e < weight[k].size(); ++e) gw[e] = from_double<T>(weight[k][e]);
    }
  }
};

std::int64_t token_rows(const RecurrentShape& s) {
  return s.cu_seqlens != nullptr ? s.cu_seqlens[s.batch] : s.batch * s.seq_len;
}

// The upstream gradient of the state after step t plus that of output[t], clamped.
template <typename T>
Vec state_grad(const RecurrentShape& s, const Vec& carry, const void* grad_output, std::int64_t row,
               std::int64_t n, double clip) {
  Vec g = carry;
  if (grad_output != nullptr) {
    const Vec dy = load<T>(grad_output, s.heads, row, n, s.head_dim);
    for (std::size_t j = 0; j < g.size(); ++j) g[j] += dy[j];
  }
  for (double& v : g) v = v < -clip ? -clip : (v > clip ? clip : v);  // NaN stays NaN
  return g;
}

// The GRU's gates at one step from the previous state.
struct GruStep {
  Vec f, r, q, z, h;  // forget, reset, q = h_prev * r, candidate, new state
};

template <typename T>
GruStep gru_step(const RecurrentShape& s, const GruPointers& p, const Vec (&w)[3], const Vec& prev,
                 std::int64_t row, std::int64_t n) {
  const std::int64_t h = s.head_dim;
  Vec x[3];
  for (int k = 0; k < 3; ++k)
    x[k] = load<T>(p.input[k], s.input_heads[k], row, source_head(s, s.input_heads[k], n), h);
  GruStep st;
  st.f = vec_mat(prev, w[1], x[1]);
  st.r = vec_mat(prev, w[2], x[2]);
  st.q = Vec(h);
  for (std::int64_t j = 0; j < h; ++j) {
    st.f[j] = sigmoid(st.f[j]);
    st.r[j] = sigmoid(st.r[j]);
    st.q[j] = prev[j] * st.r[j];
  }
  st.z = vec_mat(st.q, w[0], x[0]);
  st.h = Vec(h);
  for (std::int64_t j = 0; j < h; ++j) {
    st.z[j] = std::tanh(st.z[j]);
    st.h[j] = st.f[j] * prev[j] + (1.0 - st.f[j]) * st.z[j];
  }
  return st;
}

}  // namespace

void rnn_forward(const RecurrentShape& s, const void* input, const void* weight,
                 const void* input_state, void* output, void* final_state, const Stream&) {
  dispatch_float(s.dtype, "rnn", [&](auto tag) {
    using T = decltype(tag);
    const std::int64_t h = s.head_dim, nx = s.input_heads[0], nw = s.weight_heads[0];
    for (std::int64_t b = 0; b < s.batch; ++b) {
      const SequenceRows seq = sequence_rows(s, b);
      for (std::int64_t n = 0; n < s.heads; ++n) {
        const Vec w = load_weight<T>(weight, source_head(s, nw, n), h);
        Vec state = initial_state<T>(s, input_state, b, n);
        for (std::int64_t t = 0; t < seq.length; ++t) {
          const std::int64_t row = seq.first + t;
          state = vec_mat(state, w, load<T>(input, nx, row, source_head(s, nx, n), h));
          for (double& v : state) v = std::tanh(v);
          store<T>(output, s.heads, row, n, state);
        }
        if (final_state != nullptr) store<T>(final_state, s.heads, b, n, state);
      }
    }
  });
}

void rnn_backward(const RecurrentShape& s, const void* grad_output, const void* grad_final_state,
                  const void* output, const void* weight, const void* input_state, void* grad_input,
                  void* grad_weight, void* grad_input_state, double gradient_clipping,
                  const Stream&) {
  dispatch_float(s.dtype, "rnn_backward", [&](auto tag) {
    using T = decltype(tag);
    const std::int64_t h = s.head_dim;
    GradSums sums(s, token_rows(s), 1);
    for (std::int64_t b = 0; b < s.batch; ++b) {
      const SequenceRows seq = sequence_rows(s, b);
      for (std::int64_t n = 0; n < s.heads; ++n) {
        const Vec w = load_weight<T>(weight, source_head(s, s.weight_heads[0], n), h);
        Vec carry =
            grad_final_state != nullptr ? load<T>(grad_final_state, s.heads, b, n, h) : Vec(h, 0.0);
        for (std::int64_t t = seq.length - 1; t >= 0; --t) {
          const std::int64_t row = seq.first + t;
          const Vec y = load<T>(output, s.heads, row, n, h);
          const Vec prev = t > 0 ? load<T>(output, s.heads, row - 1, n, h)
                                 : initial_state<T>(s, input_state, b, n);
          Vec da = state_grad<T>(s, carry, grad_output, row, n, gradient_clipping);
          for (std::int64_t j = 0; j < h; ++j) da[j] *= 1.0 - y[j] * y[j];
          sums.add_input(s, 0, row, n, da);
          sums.add_weight(s, 0, n, prev, da);
          carry = vec_mat_t(da, w);
        }
        if (grad_input_state != nullptr) store<T>(grad_input_state, s.heads, b, n, carry);
      }
    }
    sums.store_all<T>(&grad_input, &grad_weight);
  });
}

void gru_forward(const RecurrentShape& s, const GruPointers& p, const void* input_state,
                 void* output, void* final_state, const Stream&) {
  dispatch_float(s.dtype, "gru", [&](auto tag) {
    using T = decltype(tag);
    const std::int64_t h = s.head_dim;
    for (std::int64_t b = 0; b < s.batch; ++b) {
      const SequenceRows seq = sequence_rows(s, b);
      for (std::int64_t n = 0; n < s.heads; ++n) {
        Vec w[3];
        for (int k = 0; k < 3; ++k)
          w[k] = load_weight<T>(p.weight[k], source_head(s, s.weight_heads[k], n), h);
        Vec state = initial_state<T>(s, input_state, b, n);
        for (std::int64_t t = 0; t < seq.length; ++t) {
          state = gru_step<T>(s, p, w, state, seq.first + t, n).h;
          store<T>(output, s.heads, seq.first + t, n, state);
        }
        if (final_state != nullptr) store<T>(final_state, s.heads, b, n, state);
      }
    }
  });
}

void gru_backward(const RecurrentShape& s, const void* grad_output, const void* grad_final_state,
                  const void* output, const GruPointers& p, const void* input_state,
                  const GruGradPointers& grads, void* grad_input_state, double gradient_clipping,
                  const Stream&) {
  dispatch_float(s.dtype, "gru_backward", [&](auto tag) {
    using T = decltype(tag);
    const std::int64_t h = s.head_dim;
    GradSums sums(s, token_rows(s), 3);
    for (std::int64_t b = 0; b < s.batch; ++b) {
      const SequenceRows seq = sequence_rows(s, b);
      for (std::int64_t n = 0; n < s.heads; ++n) {
        Vec w[3];
        for (int k = 0; k < 3; ++k)
          w[k] = load_weight<T>(p.weight[k], source_head(s, s.weight_heads[k], n), h);
        Vec carry =
            grad_final_state != nullptr ? load<T>(grad_final_state, s.heads, b, n, h) : Vec(h, 0.0);
        for (std::int64_t t = seq.length - 1; t >= 0; --t) {
          const std::int64_t row = seq.first + t;
          const Vec prev = t > 0 ? load<T>(output, s.heads, row - 1, n, h)
                                 : initial_state<T>(s, input_state, b, n);
          const GruStep st = gru_step<T>(s, p, w, prev, row, n);
          const Vec g = state_grad<T>(s, carry, grad_output, row, n, gradient_clipping);
          // h' = f h + (1 - f) z, z = tanh(q W + x), q = h r, f / r = sigmoid(h W_f/r + x_f/r)
          Vec da_z(h), da_f(h);
          for (std::int64_t j = 0; j < h; ++j) {
            da_z[j] = g[j] * (1.0 - st.f[j]) * (1.0 - st.z[j] * st.z[j]);
            da_f[j] = g[j] * (prev[j] - st.z[j]) * st.f[j] * (1.0 - st.f[j]);
          }
          const Vec dq = vec_mat_t(da_z, w[0]);
          Vec da_r(h);
          for (std::int64_t j = 0; j < h; ++j)
            da_r[j] = dq[j] * prev[j] * st.r[j] * (1.0 - st.r[j]);
          const Vec from_f = vec_mat_t(da_f, w[1]), from_r = vec_mat_t(da_r, w[2]);
          for (std::int64_t j = 0; j < h; ++j)
            carry[j] = g[j] * st.f[j] + dq[j] * st.r[j] + from_f[j] + from_r[j];
          const Vec* da[3] = {&da_z, &da_f, &da_r};
          const Vec* u[3] = {&st.q, &prev, &prev};
          for (int k = 0; k < 3; ++k) {
            sums.add_input(s, k, row, n, *da[k]);
            sums.add_weight(s, k, n, *u[k], *da[k]);
          }
        }
        if (grad_input_state != nullptr) store<T>(grad_input_state, s.heads, b, n, carry);
      }
    }
    sums.store_all<T>(grads.input, grads.weight);
  });
}

}  // namespace meshfuse::detail::reference
