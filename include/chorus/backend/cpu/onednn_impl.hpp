#pragma once
// oneDNN's convolutions (backend/cpu/onednn.hpp): onednn.hpp includes this only in the
// header-only form; src/backend/onednn.cpp compiles it into chorus::compiled (Note [compiled
// chorus]), so a unit of the compiled form never reads oneDNN's C++ API.
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "onednn.hpp"
#include "onednn_context.hpp"

CHORUS_NAMESPACE_BEGIN
namespace backend::cpu {

#if CHORUS_ONEDNN_API
namespace onednn {
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

CHORUS_INLINE ConvPlan& plan(const OnednnConv& c) {
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

CHORUS_INLINE void conv_forward(const OnednnConv& c, const float* x, const float* w, const float* b, float* y) {
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

CHORUS_INLINE void conv_backward_data(const OnednnConv& c, const float* gy, const float* w, float* gx) {
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

CHORUS_INLINE void conv_backward_weights(const OnednnConv& c, const float* x, const float* gy, float* gw, float* gb) {
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
