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
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <tuple>

#include "../../compiled.hpp"
#include "nn_kernels.hpp"

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
/// What one convolution shape keeps (its primitives and layouts; onednn_impl.hpp).
struct ConvPlan;
/// The plan of a shape, built on first use (per thread: see Note [oneDNN convolutions]), and per
/// team size: oneDNN fixes a primitive's work split for the OpenMP team it was created under, so
/// a plan made with one thread would run on one thread after set_num_threads(2).
CHORUS_INLINE ConvPlan& plan(const OnednnConv& c);
/// y = conv(x, w) + b, all NCHW float32.
CHORUS_INLINE void conv_forward(const OnednnConv& c, const float* x, const float* w, const float* b, float* y);
/// gx = conv_backward_data(gy, w) (overwrites gx).
CHORUS_INLINE void conv_backward_data(const OnednnConv& c, const float* gy, const float* w, float* gx);
/// gw = dL/dw and gb = dL/db (when given) from x and gy (overwrite gw, gb).
CHORUS_INLINE void conv_backward_weights(const OnednnConv& c, const float* x, const float* gy, float* gw, float* gb);
}  // namespace onednn
#endif

}  // namespace backend::cpu
CHORUS_NAMESPACE_END

// The oneDNN calls (and oneDNN's C++ API): compiled into chorus::compiled
// (src/backend/onednn.cpp), or here in the header-only form (Note [compiled chorus]).
#if !CHORUS_COMPILED
#include "onednn_impl.hpp"
#endif
