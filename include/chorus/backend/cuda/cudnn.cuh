#pragma once
// cuDNN 9 for the CUDA convolutions (compiled only by nvcc, when CMake found cuDNN and
// defined CHORUS_HAS_CUDNN; otherwise nn_kernels.cuh's im2col + cuBLAS path runs).
//
// Note [cuDNN convolutions]
// Tensors stay NCHW (cuDNN's NCHW descriptors; it may transform internally). Per device,
// dtype and convolution shape, the descriptors and the three algorithms (forward, backward
// data, backward filter: cuDNN's heuristic ranking, the first one whose workspace fits the
// limit) are chosen once and cached. Workspaces come from chorus's caching allocator on the
// calling stream, so a training step allocates nothing new once the pool is warm. float32
// uses FMA math (no TF32) unless chorus::cuda::set_allow_tf32(true), as matrix products do.
#include <cudnn.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "../../core/storage.hpp"
#include "blas.cuh"
#include "launch.cuh"

#define CHORUS_CUDNN_CHECK(expr)                                                                           \
  do {                                                                                                     \
    cudnnStatus_t chorus_st_ = (expr);                                                                     \
    if (chorus_st_ != CUDNN_STATUS_SUCCESS) [[unlikely]]                                                   \
      ::chorus::detail::throw_error("cuDNN error: ", cudnnGetErrorString(chorus_st_), " in ", #expr, " at ", \
                                    __FILE__, ":", __LINE__);                                              \
  } while (0)

CHORUS_NAMESPACE_BEGIN
namespace backend::cuda::cudnn {

inline constexpr std::size_t kMaxWorkspace = std::size_t{256} << 20;

namespace detail {
inline std::atomic<bool>& enabled_flag() {
  static std::atomic<bool> on{true};
  return on;
}
}  // namespace detail
/// Whether CUDA convolutions use cuDNN (default) or the im2col + cuBLAS kernels (tests compare them).
inline bool enabled() { return detail::enabled_flag().load(); }
inline void set_enabled(bool on) { detail::enabled_flag().store(on); }

/// The cuDNN handle of one stream (made on first use, kept for the process).
inline cudnnHandle_t handle_for(Device d, cudaStream_t stream) {
  static std::mutex m;
  static auto* all = new std::map<cudaStream_t, cudnnHandle_t>();  // lives forever, as the cuBLAS handles
  std::lock_guard<std::mutex> lk(m);
  auto& h = (*all)[stream];
  if (!h) {
    ::chorus::cuda::DeviceGuard g(d.index);
    CHORUS_CUDNN_CHECK(cudnnCreate(&h));
    CHORUS_CUDNN_CHECK(cudnnSetStream(h, stream));
  }
  return h;
}

/// Descriptors and algorithms of one convolution shape (Note [cuDNN convolutions]).
struct ConvPlan {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  cudnnConvolutionFwdAlgo_t fwd{};
  cudnnConvolutionBwdDataAlgo_t bwd_data{};
  cudnnConvolutionBwdFilterAlgo_t bwd_filter{};
  std::size_t fwd_ws = 0, bwd_data_ws = 0, bwd_filter_ws = 0;
};

template <class T>
constexpr cudnnDataType_t data_type() {
  return std::is_same_v<T, float> ? CUDNN_DATA_FLOAT : CUDNN_DATA_DOUBLE;
}

template <class T>
ConvPlan& plan(cudnnHandle_t h, Device d, const Window2d& g, std::int64_t N, std::int64_t O, std::int64_t groups) {
  using Key = std::tuple<int, bool, bool, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                         std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                         std::int64_t, std::int64_t, std::int64_t>;
  static std::mutex m;
  static auto* cache = new std::map<Key, std::unique_ptr<ConvPlan>>();
  const bool tf32 = std::is_same_v<T, float> && ::chorus::cuda::allow_tf32();
  const Key key{d.index, std::is_same_v<T, float>, tf32, N, g.C, g.H, g.W, O, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw,
                g.dh, g.dw, groups};  // (dh*1000 + dw made dilations (1, 1001) and (2, 1) share a plan)
  std::lock_guard<std::mutex> lk(m);
  auto& slot = (*cache)[key];
  if (slot) return *slot;
  auto p = std::make_unique<ConvPlan>();
  const auto dt = data_type<T>();
  auto i = [](std::int64_t v) { return static_cast<int>(v); };
  CHORUS_CUDNN_CHECK(cudnnCreateTensorDescriptor(&p->x));
  CHORUS_CUDNN_CHECK(cudnnCreateTensorDescriptor(&p->y));
  CHORUS_CUDNN_CHECK(cudnnCreateFilterDescriptor(&p->w));
  CHORUS_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&p->conv));
  CHORUS_CUDNN_CHECK(cudnnSetTensor4dDescriptor(p->x, CUDNN_TENSOR_NCHW, dt, i(N), i(g.C), i(g.H), i(g.W)));
  CHORUS_CUDNN_CHECK(cudnnSetTensor4dDescriptor(p->y, CUDNN_TENSOR_NCHW, dt, i(N), i(O), i(g.OH), i(g.OW)));
  CHORUS_CUDNN_CHECK(cudnnSetFilter4dDescriptor(p->w, dt, CUDNN_TENSOR_NCHW, i(O), i(g.C / groups), i(g.kh), i(g.kw)));
  CHORUS_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(p->conv, i(g.ph), i(g.pw), i(g.sh), i(g.sw), i(g.dh), i(g.dw),
                                                     CUDNN_CROSS_CORRELATION, dt));
  CHORUS_CUDNN_CHECK(cudnnSetConvolutionGroupCount(p->conv, i(groups)));
  CHORUS_CUDNN_CHECK(cudnnSetConvolutionMathType(p->conv, tf32 ? CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION : CUDNN_FMA_MATH));
  int n = 0;
  {
    cudnnConvolutionFwdAlgoPerf_t perf[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
    CHORUS_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(h, p->x, p->w, p->conv, p->y,
                                                              CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &n, perf));
    bool found = false;
    for (int k = 0; k < n && !found; ++k)
      if (perf[k].status == CUDNN_STATUS_SUCCESS && perf[k].memory <= kMaxWorkspace) {
        p->fwd = perf[k].algo;
        p->fwd_ws = perf[k].memory;
        found = true;
      }
    CHORUS_CHECK(found, "cuDNN: no forward convolution algorithm for this shape");
  }
  {
    cudnnConvolutionBwdDataAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT];
    CHORUS_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(h, p->w, p->y, p->conv, p->x,
                                                                   CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, &n, perf));
    bool found = false;
    for (int k = 0; k < n && !found; ++k)
      if (perf[k].status == CUDNN_STATUS_SUCCESS && perf[k].memory <= kMaxWorkspace) {
        p->bwd_data = perf[k].algo;
        p->bwd_data_ws = perf[k].memory;
        found = true;
      }
    CHORUS_CHECK(found, "cuDNN: no backward-data convolution algorithm for this shape");
  }
  {
    cudnnConvolutionBwdFilterAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT];
    CHORUS_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, p->x, p->y, p->conv, p->w,
                                                                     CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &n, perf));
    bool found = false;
    for (int k = 0; k < n && !found; ++k)
      if (perf[k].status == CUDNN_STATUS_SUCCESS && perf[k].memory <= kMaxWorkspace) {
        p->bwd_filter = perf[k].algo;
        p->bwd_filter_ws = perf[k].memory;
        found = true;
      }
    CHORUS_CHECK(found, "cuDNN: no backward-filter convolution algorithm for this shape");
  }
  slot = std::move(p);
  return *slot;
}

/// A workspace of `bytes` from the caching allocator (null storage for 0).
inline Storage workspace(Device d, std::size_t bytes) { return bytes ? make_storage(d, bytes) : Storage(); }
inline void* ws_ptr(const Storage& s) { return s ? s->data() : nullptr; }

/// y = conv(x, w) (no bias; ops adds it).
template <class T>
void conv_forward(const Window2d& g, std::int64_t N, std::int64_t O, std::int64_t groups, const T* x, const T* w, T* y,
                  Device d) {
  Launch launch(d);
  auto h = handle_for(d, launch.stream);
  auto& p = plan<T>(h, d, g, N, O, groups);
  auto ws = workspace(d, p.fwd_ws);
  const T one = 1, zero = 0;
  CHORUS_CUDNN_CHECK(cudnnConvolutionForward(h, &one, p.x, x, p.w, w, p.conv, p.fwd, ws_ptr(ws), p.fwd_ws, &zero, p.y, y));
}

/// gx = dL/dx (overwritten).
template <class T>
void conv_backward_data(const Window2d& g, std::int64_t N, std::int64_t O, std::int64_t groups, const T* gy,
                        const T* w, T* gx, Device d) {
  Launch launch(d);
  auto h = handle_for(d, launch.stream);
  auto& p = plan<T>(h, d, g, N, O, groups);
  auto ws = workspace(d, p.bwd_data_ws);
  const T one = 1, zero = 0;
  CHORUS_CUDNN_CHECK(cudnnConvolutionBackwardData(h, &one, p.w, w, p.y, gy, p.conv, p.bwd_data, ws_ptr(ws),
                                                  p.bwd_data_ws, &zero, p.x, gx));
}

/// gw = dL/dw (overwritten).
template <class T>
void conv_backward_filter(const Window2d& g, std::int64_t N, std::int64_t O, std::int64_t groups, const T* x,
                          const T* gy, T* gw, Device d) {
  Launch launch(d);
  auto h = handle_for(d, launch.stream);
  auto& p = plan<T>(h, d, g, N, O, groups);
  auto ws = workspace(d, p.bwd_filter_ws);
  const T one = 1, zero = 0;
  CHORUS_CUDNN_CHECK(cudnnConvolutionBackwardFilter(h, &one, p.x, x, p.y, gy, p.conv, p.bwd_filter, ws_ptr(ws),
                                                    p.bwd_filter_ws, &zero, p.w, gw));
}

}  // namespace backend::cuda::cudnn
CHORUS_NAMESPACE_END
