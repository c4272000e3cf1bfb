#pragma once
// oneDNN (the library behind PyTorch's CPU convolutions) for float32 convolutions on the CPU,
// when chorus was built with it (CMake finds libdnnl and defines CHORUS_HAS_ONEDNN).
//
// Note [oneDNN convolutions]
// The API is NCHW; inside, oneDNN picks its own blocked layouts (nChw8c/16c, blocked
// weights) for the fastest kernel of the machine: inputs are reordered into them and the
// results reordered back to NCHW. The primitives and the blocked scratch memories are built
// once per shape and kept per thread (each virtual CPU device runs on its own thread), so a
// training step's convolutions reuse them. float64 is not supported by oneDNN and uses
// im2col + OpenBLAS (nn_kernels.hpp), as do shapes oneDNN would need negative padding for.
// set_onednn_enabled(false) (or CHORUS_ONEDNN=0 in the environment) selects im2col for
// float32 too — the benchmark compares the two.
//
// Note [oneDNN threads]
// Debian's libdnnl runs its kernels on OpenMP teams. Each virtual CPU device is already a
// thread of its own, and OpenMP teams that spin-wait on an oversubscribed machine are
// slower than one thread (measured with benchmarks/conv_bench on the shared 2-core machine:
// 2 threads were 5-50x slower than 1 on most ResNet-20 shapes). A thread calling oneDNN
// therefore runs it on one thread by default, like chorus's own CPU kernels: DataParallel's
// device workers always do. A program that trains on one device asks for more on its own
// thread with chorus::set_num_threads(n) (backend/cpu/threads.hpp; PyTorch's
// torch::set_num_threads), which sizes that thread's team, the team chorus's own loops run on
// too (Note [intra-op threads]); CHORUS_NUM_THREADS sets the default of every thread (ResNet-20 on 2 cores, one device, 2 BLAS threads: 529 ms a step with
// one thread for oneDNN, 359 ms with two; benchmarks/README.md, "Intra-op threads").
//
// Note [oneDNN primitive creation]
// oneDNN 2.6 (Debian's) keeps one process-wide primitive cache. Two virtual devices' backward
// passes creating reorder primitives at once raced inside it: ThreadSanitizer saw one thread
// compare a cache key against memory another thread had just allocated, with nothing ordering
// the two (CI; reproduced in 2 of 15 runs of PyTorchDataParallel.ConvNetTwoIterations under
// TSan, 0 of 30 with this rule). Every primitive chorus builds (a plan's convolutions and its
// reorders) is therefore created under one process-wide mutex, and only once per thread, shape
// and team size: the reorders live in the plan next to the convolutions, so a training step
// creates nothing and takes no lock. Execution stays concurrent.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "nn_kernels.hpp"

#ifndef CHORUS_HAS_ONEDNN
#define CHORUS_HAS_ONEDNN 0
#endif
// nvcc's front end stops with an internal error on oneDNN's C++ API (CUDA 13.0, g++ 12
// headers): translation units with the CUDA backend (nvcc's, and the C++ ones linking
// chorus::cuda_kernels, which must agree with the library's ABI v0_1_cuda) use im2col for CPU
// convolutions.
#if CHORUS_HAS_ONEDNN && !CHORUS_CUDA
#define CHORUS_ONEDNN_API 1
#else
#define CHORUS_ONEDNN_API 0
#endif

#if CHORUS_ONEDNN_API
#include <oneapi/dnnl/dnnl.hpp>
#endif

CHORUS_NAMESPACE_BEGIN
namespace backend::cpu {

namespace detail {
inline std::atomic<int>& onednn_switch() {
  static std::atomic<int> on{[] {
    const char* e = std::getenv("CHORUS_ONEDNN");
    return (e && std::strcmp(e, "0") == 0) ? 0 : 1;
  }()};
  return on;
}

}  // namespace detail

/// True when this build has oneDNN.
constexpr bool onednn_available() { return CHORUS_ONEDNN_API != 0; }
/// Whether float32 CPU convolutions use oneDNN (default: yes, where available).
inline bool onednn_enabled() { return onednn_available() && detail::onednn_switch().load() != 0; }
inline void set_onednn_enabled(bool on) { detail::onednn_switch().store(on ? 1 : 0); }

/// The convolution geometry oneDNN sees (one image group of N).
struct OnednnConv {
  Window2d g;
  std::int64_t N, O, groups;
  bool bias;
  auto key() const {
    return std::make_tuple(N, g.C, g.H, g.W, O, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw, groups, bias);
  }
  /// Right padding that makes oneDNN's output size equal PyTorch's floor rule (may be negative).
  std::int64_t pad_r(int i) const {
    return i == 0 ? (g.OH - 1) * g.sh + (g.kh - 1) * g.dh + 1 - g.H - g.ph
                  : (g.OW - 1) * g.sw + (g.kw - 1) * g.dw + 1 - g.W - g.pw;
  }
  bool supported() const { return pad_r(0) >= 0 && pad_r(1) >= 0 && N > 0; }
};

#if CHORUS_ONEDNN_API
namespace onednn {
using dnnl::memory;
using tag = memory::format_tag;
using dt = memory::data_type;

struct Context {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
};
/// This thread's oneDNN engine and stream, with its OpenMP team size set (Note [oneDNN threads]).
inline Context& context() {
  thread_local Context c;
#if DNNL_CPU_RUNTIME == DNNL_RUNTIME_OMP  // libgomp, which libdnnl links (CMake adds it)
  detail::set_omp_team_size(detail::intra_op_threads());
#endif
  return c;
}

/// What one convolution shape keeps: the three primitives and the memories of oneDNN's layouts.
struct ConvPlan {
  dnnl::convolution_forward::primitive_desc fwd_pd;
  dnnl::convolution_backward_data::primitive_desc bwd_data_pd;
  dnnl::convolution_backward_weights::primitive_desc bwd_w_pd;
  dnnl::convolution_forward fwd;
  dnnl::convolution_backward_data bwd_data;
  dnnl::convolution_backward_weights bwd_w;
  memory::desc src_plain, w_plain, dst_plain, bias_plain;
  struct Reorder {
    memory::desc from, to;
    dnnl::reorder prim;
  };
  std::vector<Reorder> reorders;  // between the plain layouts and oneDNN's, built on first use
};

/// Held while creating any oneDNN primitive (Note [oneDNN primitive creation]).
inline std::mutex& creation_mutex() {
  static std::mutex m;
  return m;
}

inline ConvPlan make_plan(const OnednnConv& c) {
  auto& ctx = context();
  const auto& g = c.g;
  const memory::dims src{c.N, g.C, g.H, g.W}, dst{c.N, c.O, g.OH, g.OW}, bias{c.O};
  const memory::dims w = c.groups == 1 ? memory::dims{c.O, g.C, g.kh, g.kw}
                                       : memory::dims{c.groups, c.O / c.groups, g.C / c.groups, g.kh, g.kw};
  const memory::dims strides{g.sh, g.sw}, dil{g.dh - 1, g.dw - 1}, pl{g.ph, g.pw}, pr{c.pad_r(0), c.pad_r(1)};
  auto any = [](const memory::dims& d) { return memory::desc(d, dt::f32, tag::any); };
  const memory::desc bias_md = c.bias ? memory::desc(bias, dt::f32, tag::x) : memory::desc();
  ConvPlan p;
  p.src_plain = memory::desc(src, dt::f32, tag::nchw);
  p.dst_plain = memory::desc(dst, dt::f32, tag::nchw);
  p.w_plain = memory::desc(w, dt::f32, c.groups == 1 ? tag::oihw : tag::goihw);
  p.bias_plain = bias_md;
  dnnl::convolution_forward::desc fd(dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, any(src),
                                     any(w), bias_md, any(dst), strides, dil, pl, pr);
  p.fwd_pd = dnnl::convolution_forward::primitive_desc(fd, ctx.engine);
  dnnl::convolution_backward_data::desc bd(dnnl::algorithm::convolution_direct, any(src), any(w), any(dst), strides,
                                           dil, pl, pr);
  p.bwd_data_pd = dnnl::convolution_backward_data::primitive_desc(bd, ctx.engine, p.fwd_pd);
  dnnl::convolution_backward_weights::desc wd(dnnl::algorithm::convolution_direct, any(src), any(w), bias_md, any(dst),
                                              strides, dil, pl, pr);
  p.bwd_w_pd = dnnl::convolution_backward_weights::primitive_desc(wd, ctx.engine, p.fwd_pd);
  p.fwd = dnnl::convolution_forward(p.fwd_pd);
  p.bwd_data = dnnl::convolution_backward_data(p.bwd_data_pd);
  p.bwd_w = dnnl::convolution_backward_weights(p.bwd_w_pd);
  return p;
}

/// The plan of a shape, built on first use (per thread: see Note [oneDNN convolutions]), and per
/// team size: oneDNN fixes a primitive's work split for the OpenMP team it was created under, so
/// a plan made with one thread would run on one thread after set_num_threads(2).
inline ConvPlan& plan(const OnednnConv& c) {
  thread_local std::map<std::pair<decltype(c.key()), int>, std::unique_ptr<ConvPlan>> cache;
  auto& slot = cache[{c.key(), detail::intra_op_threads()}];
  if (!slot) {
    std::lock_guard<std::mutex> lock(creation_mutex());
    slot = std::make_unique<ConvPlan>(make_plan(c));
  }
  return *slot;
}

/// The plan's reorder from layout `from` to `to`, created on first use.
inline dnnl::reorder reorder_of(ConvPlan& p, const memory::desc& from, const memory::desc& to) {
  for (const auto& r : p.reorders)
    if (r.from == from && r.to == to) return r.prim;
  auto& ctx = context();
  std::lock_guard<std::mutex> lock(creation_mutex());
  p.reorders.push_back({from, to, dnnl::reorder(dnnl::reorder::primitive_desc(ctx.engine, from, ctx.engine, to))});
  return p.reorders.back().prim;
}

/// `user` (plain layout) as memory of layout `want`: the same memory, or a reordered copy.
inline memory as_layout(ConvPlan& p, const memory& user, const memory::desc& want, bool copy_in) {
  if (user.get_desc() == want) return user;
  auto& ctx = context();
  memory m(want, ctx.engine);
  if (copy_in) reorder_of(p, user.get_desc(), want).execute(ctx.stream, const_cast<memory&>(user), m);
  return m;
}
inline void copy_back(ConvPlan& p, memory& from, memory& user) {
  if (from.get(true) == user.get(true)) return;
  auto& ctx = context();
  reorder_of(p, from.get_desc(), user.get_desc()).execute(ctx.stream, from, user);
}

inline memory wrap(const memory::desc& d, const float* p) {
  return memory(d, context().engine, const_cast<float*>(p));
}

/// y = conv(x, w) + b, all NCHW float32.
inline void conv_forward(const OnednnConv& c, const float* x, const float* w, const float* b, float* y) {
  auto& p = plan(c);
  auto& ctx = context();
  auto src = as_layout(p, wrap(p.src_plain, x), p.fwd_pd.src_desc(), true);
  auto wei = as_layout(p, wrap(p.w_plain, w), p.fwd_pd.weights_desc(), true);
  auto user_dst = wrap(p.dst_plain, y);
  auto dst = as_layout(p, user_dst, p.fwd_pd.dst_desc(), false);
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}};
  if (c.bias) args.insert({DNNL_ARG_BIAS, wrap(p.bias_plain, b)});
  p.fwd.execute(ctx.stream, args);
  copy_back(p, dst, user_dst);
  ctx.stream.wait();
}

/// gx = conv_backward_data(gy, w) (overwrites gx).
inline void conv_backward_data(const OnednnConv& c, const float* gy, const float* w, float* gx) {
  auto& p = plan(c);
  auto& ctx = context();
  auto dd = as_layout(p, wrap(p.dst_plain, gy), p.bwd_data_pd.diff_dst_desc(), true);
  auto wei = as_layout(p, wrap(p.w_plain, w), p.bwd_data_pd.weights_desc(), true);
  auto user_gx = wrap(p.src_plain, gx);
  auto ds = as_layout(p, user_gx, p.bwd_data_pd.diff_src_desc(), false);
  p.bwd_data.execute(ctx.stream, {{DNNL_ARG_DIFF_DST, dd}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DIFF_SRC, ds}});
  copy_back(p, ds, user_gx);
  ctx.stream.wait();
}

/// gw = dL/dw and gb = dL/db (when given) from x and gy (overwrite gw, gb).
inline void conv_backward_weights(const OnednnConv& c, const float* x, const float* gy, float* gw, float* gb) {
  auto& p = plan(c);
  auto& ctx = context();
  auto src = as_layout(p, wrap(p.src_plain, x), p.bwd_w_pd.src_desc(), true);
  auto dd = as_layout(p, wrap(p.dst_plain, gy), p.bwd_w_pd.diff_dst_desc(), true);
  auto user_gw = wrap(p.w_plain, gw);
  auto dw = as_layout(p, user_gw, p.bwd_w_pd.diff_weights_desc(), false);
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, src}, {DNNL_ARG_DIFF_DST, dd}, {DNNL_ARG_DIFF_WEIGHTS, dw}};
  memory bias_scratch;
  if (c.bias) {
    // oneDNN computes the bias gradient with the weights'; a caller not wanting it gets scratch.
    bias_scratch = gb ? wrap(p.bias_plain, gb) : memory(p.bias_plain, ctx.engine);
    args.insert({DNNL_ARG_DIFF_BIAS, bias_scratch});
  }
  p.bwd_w.execute(ctx.stream, args);
  copy_back(p, dw, user_gw);
  ctx.stream.wait();
}
}  // namespace onednn
#endif

}  // namespace backend::cpu
CHORUS_NAMESPACE_END
