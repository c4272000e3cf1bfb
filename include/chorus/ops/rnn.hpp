#pragma once
// One LSTM layer (one direction) over a whole sequence as one autograd node, on the CPU.
//
// Note [fused LSTM layer]
// Built from differentiable ops, an LSTM time step records ~12 nodes (the recurrent GEMM, the
// gate split, three sigmoids, two tanh, products and sums), each allocating its output and,
// in backward, its gradients: over a sequence of 64 steps and 2 layers that is ~1,500 nodes and
// ~3,000 small allocations per step of training, and the weight gradient of W_hh is 64 GEMMs
// of [4H, B] x [B, H] summed by the engine. lstm_layer runs the recurrence in one forward loop
// (per step: one GEMM into that step's slice of the gate buffer, then one pass over the gates)
// and records one node whose backward walks the steps back (per step: one pass over the gates,
// one GEMM for the gradient of h), then forms the gradient of W_hh as one GEMM over all steps
// (two when the first step's h0 is not part of the output buffer) and that of b_hh as one
// column sum. The saved state is the gate activations [S, B, 4H] and the cell states [S, B, H],
// what cuDNN keeps as its reserve space. Gate order i, f, g, o (PyTorch's). The pointwise loops
// compute in float for 16-bit types (double for double), rounding once on store, with the
// vectorizable sigmoid and tanh of backend/cpu/vmath.hpp (Note [vectorizable math]).
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>

#include "../compiled.hpp"
#include "../backend/cpu/vmath.hpp"
#include "common.hpp"
#include "linalg.hpp"

CHORUS_NAMESPACE_BEGIN
namespace ops {
namespace detail {

template <class T>
using lstm_acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// One batch row of one step. The gate blocks of a row [i | f | g | o] are H apart in one
// buffer; passing them as separate restrict pointers tells the compiler they do not overlap,
// and the loops vectorize (an offset of H between a load and a store defeats its analysis).

/// Forward: the pre-activations a[0, 4H) become the activations; writes c and h.
template <class T>
inline void lstm_row_forward(T* __restrict gi, T* __restrict gf, T* __restrict gg, T* __restrict go,
                             const T* __restrict cprev, T* __restrict c, T* __restrict h, std::int64_t H) {
  using A = lstm_acc_t<T>;
  namespace vm = backend::cpu::vmath;
  for (std::int64_t j = 0; j < H; ++j) {
    const A i = vm::sigmoid(A(gi[j])), f = vm::sigmoid(A(gf[j]));
    const A g = vm::tanh(A(gg[j])), o = vm::sigmoid(A(go[j]));
    const A cn = f * A(cprev[j]) + i * g;
    gi[j] = T(i);
    gf[j] = T(f);
    gg[j] = T(g);
    go[j] = T(o);
    c[j] = T(cn);
    h[j] = T(o * vm::tanh(cn));
  }
}

/// Backward: from the activations `a` [4H], the cell state c and the one before, the gradient
/// reaching h (dh, from the next step, plus gout, from the output) and c (dc, updated in place
/// to the gradient of the step before), the gradients of the pre-activations d [4H].
template <class T>
inline void lstm_row_backward_blocks(const T* __restrict ai, const T* __restrict af, const T* __restrict ag,
                                     const T* __restrict ao, const T* __restrict c, const T* __restrict cprev,
                                     const T* __restrict gout, const T* __restrict dh, T* __restrict dc,
                                     T* __restrict di, T* __restrict df, T* __restrict dg, T* __restrict dout,
                                     std::int64_t H) {
  using A = lstm_acc_t<T>;
  for (std::int64_t j = 0; j < H; ++j) {
    const A i = A(ai[j]), f = A(af[j]), g = A(ag[j]), o = A(ao[j]);
    const A tc = backend::cpu::vmath::tanh(A(c[j]));
    const A hgrad = A(dh[j]) + A(gout[j]);
    const A cgrad = A(dc[j]) + hgrad * o * (A(1) - tc * tc);
    di[j] = T(cgrad * g * i * (A(1) - i));
    df[j] = T(cgrad * A(cprev[j]) * f * (A(1) - f));
    dg[j] = T(cgrad * i * (A(1) - g * g));
    dout[j] = T(hgrad * tc * o * (A(1) - o));
    dc[j] = T(cgrad * f);
  }
}

template <class T>
inline void lstm_row_backward(const T* a, const T* c, const T* cprev, const T* gout, const T* dh, T* dc, T* d,
                              std::int64_t H) {
  lstm_row_backward_blocks(a, a + H, a + 2 * H, a + 3 * H, c, cprev, gout, dh, dc, d, d + H, d + 2 * H, d + 3 * H, H);
}

template <class T>
class LSTMLayerBackward final : public autograd::Node<T> {
 public:
  LSTMLayerBackward(Tensor<T> w_hh, bool has_bias, Tensor<T> h0, Tensor<T> c0, Tensor<T> act, Tensor<T> cs,
                    Tensor<T> out, bool reverse)
      : w_hh_(std::move(w_hh)), h0_(std::move(h0)), c0_(std::move(c0)), act_(std::move(act)), cs_(std::move(cs)),
        out_(std::move(out)), bias_(has_bias), reverse_(reverse) {  // out: a detached alias (no cycle)
    // The initial state may be the caller's buffer (a truncated-BPTT loop reuses it): a write
    // to it before backward is refused, as for every tensor a node saves (Note [version counter]).
    this->save_version(w_hh_);
    this->save_version(h0_);
    this->save_version(c0_);
  }
  std::string name() const override { return "LSTMLayerBackward"; }

  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& grads) override {
    const auto S = act_.shape()[0], B = act_.shape()[1], G = act_.shape()[2], H = G / 4;
    const Device dev = act_.device();
    const auto& e = this->next_edges();
    // grads: output [S, B, H], h_n [B, H], c_n [B, H] (zeros where none arrived, contiguous)
    const T* g_out = grads[0].data();
    auto dG = Tensor<T>::empty(Shape{S, B, G}, dev);  // gradients of the gates' pre-activations
    auto dh = Tensor<T>::empty(Shape{B, H}, dev), dc = Tensor<T>::empty(Shape{B, H}, dev);
    if (B * H > 0) {  // an empty batch has no buffers: memcpy's pointers may not be null
      std::memcpy(dh.data(), grads[1].data(), sizeof(T) * B * H);
      std::memcpy(dc.data(), grads[2].data(), sizeof(T) * B * H);
    }
    const T* act = act_.data();
    const T* cs = cs_.data();
    const T* wh = w_hh_.data();
    T* pdh = dh.data();
    T* pdc = dc.data();
    for (std::int64_t k = S - 1; k >= 0; --k) {
      const std::int64_t t = reverse_ ? S - 1 - k : k;
      const std::int64_t tp = reverse_ ? t + 1 : t - 1;  // the step before, in processing order
      const T* cprev = k == 0 ? c0_.data() : cs + tp * B * H;
      const T* a = act + t * B * G;
      const T* c = cs + t * B * H;
      const T* go = g_out + t * B * H;
      T* d = dG.data() + t * B * G;
      backend::cpu::at_cpu_width([&] {
        for (std::int64_t b = 0; b < B; ++b) {
          const std::int64_t r = b * G, x = b * H;
          lstm_row_backward(a + r, c + x, cprev + x, go + x, pdh + x, pdc + x, d + r, H);
        }
      });
      // dh_prev = dG[t] @ W_hh ([B, 4H] x [4H, H])
      backend::gemm(false, false, B, H, G, T(1), d, G, wh, H, T(0), pdh, H, dev);
    }
    Tensor<T> d_w, d_b;
    if (e[1].valid()) {  // dW_hh = sum_t dG[t]^T h_prev(t): the outputs of the steps before, and h0
      d_w = Tensor<T>::empty(Shape{G, H}, dev);
      const T* dg = dG.data();
      const T* o = out_.data();
      const std::int64_t first = reverse_ ? S - 1 : 0;  // the step whose h_prev is h0
      backend::gemm(true, false, G, H, B, T(1), dg + first * B * G, G, h0_.data(), H, T(0), d_w.data(), H, dev);
      if (S > 1) {
        const T* dg_rest = reverse_ ? dg : dg + B * G;  // steps with an h_prev in out_
        const T* h_rest = reverse_ ? o + B * H : o;
        backend::gemm(true, false, G, H, (S - 1) * B, T(1), dg_rest, G, h_rest, H, T(1), d_w.data(), H, dev);
      }
    }
    if (bias_ && e[2].valid()) {
      d_b = Tensor<T>::empty(Shape{G}, dev);
      backend::sum_dim(view_as_shape(dG, Shape{S * B, G}), 1, S * B, G, d_b, 1.0);
    }
    Tensor<T> dh0 = e[bias_ ? 3 : 2].valid() ? dh : Tensor<T>();
    Tensor<T> dc0 = e[bias_ ? 4 : 3].valid() ? dc : Tensor<T>();
    if (bias_) return {dG, d_w, d_b, dh0, dc0};
    return {dG, d_w, dh0, dc0};
  }
  void release_saved() override {
    w_hh_ = h0_ = c0_ = act_ = cs_ = out_ = Tensor<T>();
  }

 private:
  Tensor<T> w_hh_, h0_, c0_, act_, cs_, out_;
  bool bias_, reverse_;
};

}  // namespace detail

/// One LSTM layer in one direction (Note [fused LSTM layer]): `gx` [S, B, 4H] is the input
/// projection W_ih x + b_ih of every step, `w_hh` [4H, H], `b_hh` [4H] (or undefined), `h0` and
/// `c0` [B, H]; the steps run from S-1 down to 0 when `reverse`. Returns (output [S, B, H],
/// h_n, c_n). CPU tensors; differentiable in gx, w_hh, b_hh, h0 and c0.
template <class T>
std::tuple<Tensor<T>, Tensor<T>, Tensor<T>> lstm_layer(const Tensor<T>& gx_in, const Tensor<T>& w_hh_in,
                                                       const Tensor<T>& b_hh, const Tensor<T>& h0_in,
                                                       const Tensor<T>& c0_in, bool reverse) {
  using A = detail::lstm_acc_t<T>;
  CHORUS_CHECK(gx_in.dim() == 3 && gx_in.shape()[2] % 4 == 0, "lstm_layer: expected gx of shape [S, B, 4H], got ",
               gx_in.shape());
  const auto S = gx_in.shape()[0], B = gx_in.shape()[1], G = gx_in.shape()[2], H = G / 4;
  const Device dev = gx_in.device();
  CHORUS_CHECK(dev.is_cpu(), "lstm_layer: CPU tensors only, got ", dev);
  CHORUS_CHECK(S > 0, "lstm_layer: expected a sequence of at least one step, got gx of shape ", gx_in.shape());
  CHORUS_CHECK(w_hh_in.shape() == (Shape{G, H}), "lstm_layer: expected w_hh of shape ", Shape{G, H}, ", got ",
               w_hh_in.shape());
  CHORUS_CHECK(!b_hh.defined() || b_hh.shape() == (Shape{G}), "lstm_layer: expected b_hh of shape ", Shape{G},
               ", got ", b_hh.shape());
  CHORUS_CHECK(h0_in.shape() == (Shape{B, H}) && c0_in.shape() == (Shape{B, H}), "lstm_layer: expected h0 and c0 of shape ",
               Shape{B, H}, ", got ", h0_in.shape(), " and ", c0_in.shape());
  const auto gx = gx_in.detach().contiguous(), w_hh = w_hh_in.detach().contiguous();
  const auto h0 = h0_in.detach().contiguous(), c0 = c0_in.detach().contiguous();
  const auto bias = b_hh.defined() ? b_hh.detach().contiguous() : Tensor<T>();
  auto act = Tensor<T>::empty(Shape{S, B, G}, dev);  // gate activations i, f, g, o
  auto cs = Tensor<T>::empty(Shape{S, B, H}, dev);   // cell states
  auto out = Tensor<T>::empty(Shape{S, B, H}, dev);
  const T* pb = bias.defined() ? bias.data() : nullptr;
  for (std::int64_t k = 0; k < S; ++k) {
    const std::int64_t t = reverse ? S - 1 - k : k, tp = reverse ? t + 1 : t - 1;
    const T* hprev = k == 0 ? h0.data() : out.data() + tp * B * H;
    const T* cprev = k == 0 ? c0.data() : cs.data() + tp * B * H;
    T* a = act.data() + t * B * G;
    const T* x = gx.data() + t * B * G;
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t j = 0; j < G; ++j) a[b * G + j] = pb ? T(A(x[b * G + j]) + A(pb[j])) : x[b * G + j];
    backend::gemm(false, true, B, G, H, T(1), hprev, H, w_hh.data(), H, T(1), a, G, dev);  // + h W_hh^T
    T* c = cs.data() + t * B * H;
    T* h = out.data() + t * B * H;
    backend::cpu::at_cpu_width([&] {
      backend::cpu::at_cpu_width([&] {
        for (std::int64_t b = 0; b < B; ++b) {
          T* r = a + b * G;
          detail::lstm_row_forward(r, r + H, r + 2 * H, r + 3 * H, cprev + b * H, c + b * H, h + b * H, H);
        }
      });
    });
  }
  const std::int64_t last = reverse ? 0 : S - 1;
  auto h_n = Tensor<T>::empty(Shape{B, H}, dev), c_n = Tensor<T>::empty(Shape{B, H}, dev);
  if (B * H > 0) {  // an empty batch has no buffers: memcpy's pointers may not be null
    std::memcpy(h_n.data(), out.data() + last * B * H, sizeof(T) * B * H);
    std::memcpy(c_n.data(), cs.data() + last * B * H, sizeof(T) * B * H);
  }
  if (autograd::needs_grad(gx_in, w_hh_in, b_hh, h0_in, c0_in)) {
    std::shared_ptr<autograd::Node<T>> node;
    if (b_hh.defined())
      node = autograd::make_node<detail::LSTMLayerBackward<T>, T>({&gx_in, &w_hh_in, &b_hh, &h0_in, &c0_in}, w_hh,
                                                                  true, h0, c0, act, cs, out.detach(), reverse);
    else
      node = autograd::make_node<detail::LSTMLayerBackward<T>, T>({&gx_in, &w_hh_in, &h0_in, &c0_in}, w_hh, false, h0,
                                                                  c0, act, cs, out.detach(), reverse);
    autograd::set_history(out, node);
    autograd::set_history(h_n, node);
    autograd::set_history(c_n, node);
  }
  return {out, h_n, c_n};
}

}  // namespace ops
CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_OPS_RNN_FLOAT_INSTANCES(X, T)                                                                                                                        \
  X(std::tuple<Tensor<T>, Tensor<T>, Tensor<T>> ops::lstm_layer<T>(const Tensor<T>&, const Tensor<T>&, const Tensor<T>&, const Tensor<T>&, const Tensor<T>&, bool))
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_RNN_FLOAT_INSTANCES, CHORUS_FLOATING_DTYPES)
