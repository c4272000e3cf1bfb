#pragma once
// cuDNN 9 for the CUDA convolutions (compiled only by nvcc, when CMake found cuDNN and
// defined CHORUS_HAS_CUDNN; otherwise nn_kernels.cuh's im2col + cuBLAS path runs).
//
// Note [cuDNN convolutions]
// Tensors stay NCHW (cuDNN's NCHW descriptors; it may transform internally). Per device,
// dtype, math policy and convolution shape, the descriptors and the three algorithms (forward,
// backward data, backward filter: cuDNN's heuristic ranking, Note [cuDNN algorithm choice] in
// host_policy.hpp) are chosen once and cached. Workspaces come from chorus's caching allocator
// on the calling stream, so a training step allocates nothing new once the pool is warm.
// float32 uses FMA math (no TF32) unless chorus::cuda::set_allow_tf32(true), as matrix
// products do; no convolution ever converts float data to half precision. bfloat16 and float16
// tensors are convolved as they are (tensor cores) with float32 accumulation: the convolution
// descriptors' compute type is float (PyTorch's choice for both), and so are alpha and beta.
#include <cudnn.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

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
inline std::atomic<bool>& deterministic_flag() {
  static std::atomic<bool> on{false};
  return on;
}
}  // namespace detail
/// Whether CUDA convolutions use cuDNN (default) or the im2col + cuBLAS kernels (tests compare them).
inline bool enabled() { return detail::enabled_flag().load(); }
inline void set_enabled(bool on) { detail::enabled_flag().store(on); }
/// Only deterministic cuDNN algorithms (torch.backends.cudnn.deterministic; off by default):
/// the same inputs then give bitwise the same gradients, at some cost in speed.
inline bool deterministic() { return detail::deterministic_flag().load(); }
inline void set_deterministic(bool on) { detail::deterministic_flag().store(on); }

static_assert(static_cast<int>(CUDNN_DEFAULT_MATH) == static_cast<int>(ConvMath::Default) &&
                  static_cast<int>(CUDNN_TENSOR_OP_MATH) == static_cast<int>(ConvMath::TensorOp) &&
                  static_cast<int>(CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) ==
                      static_cast<int>(ConvMath::TensorOpAllowConversion) &&
                  static_cast<int>(CUDNN_FMA_MATH) == static_cast<int>(ConvMath::Fma),
              "host_policy.hpp's ConvMath mirrors cudnnMathType_t");

// Note [cuDNN handles]: unlike cuBLAS's, a cuDNN handle must not be used by two threads at once
// (cuDNN's documentation), and a stream is shared between threads (a replica's worker and the
// user's thread issue work on the same device's stream). So each thread has its own handle per
// stream, taken from a per-device pool of idle handles and given back when the thread ends (as
// PyTorch's DeviceThreadHandlePool): threads that come and go reuse handles instead of making
// new ones, and the hot path is one lookup in the thread's own map.
namespace detail {
struct HandlePool {
  std::mutex m;
  std::map<int, std::vector<cudnnHandle_t>> idle;  // per device
  static HandlePool& get() {
    static auto* pool = new HandlePool();  // lives forever, as the handles
    return *pool;
  }
};
struct ThreadHandles {
  struct Entry {
    int device;
    cudnnHandle_t handle;
  };
  std::unordered_map<cudaStream_t, Entry> by_stream;
  ~ThreadHandles() {
    auto& pool = HandlePool::get();
    std::lock_guard<std::mutex> lk(pool.m);
    for (auto& [stream, e] : by_stream) pool.idle[e.device].push_back(e.handle);
  }
};
}  // namespace detail

/// The calling thread's cuDNN handle for `stream` on `d` (Note [cuDNN handles]).
inline cudnnHandle_t handle_for(Device d, cudaStream_t stream) {
  thread_local detail::ThreadHandles mine;
  if (auto it = mine.by_stream.find(stream); it != mine.by_stream.end()) return it->second.handle;
  cudnnHandle_t h = nullptr;
  {
    auto& pool = detail::HandlePool::get();
    std::lock_guard<std::mutex> lk(pool.m);
    auto& idle = pool.idle[d.index];
    if (!idle.empty()) {
      h = idle.back();
      idle.pop_back();
    }
  }
  ::chorus::cuda::DeviceGuard g(d.index);
  if (!h) CHORUS_CUDNN_CHECK(cudnnCreate(&h));
  CHORUS_CUDNN_CHECK(cudnnSetStream(h, stream));
  mine.by_stream.emplace(stream, detail::ThreadHandles::Entry{d.index, h});
  return h;
}

/// Descriptors and algorithms of one convolution shape (Note [cuDNN convolutions]). Each
/// direction has its own convolution descriptor: each carries the math type of its algorithm
/// (Note [cuDNN algorithm choice]).
struct ConvPlan {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv_fwd = nullptr, conv_bwd_data = nullptr, conv_bwd_filter = nullptr;
  cudnnConvolutionFwdAlgo_t fwd{};
  cudnnConvolutionBwdDataAlgo_t bwd_data{};
  cudnnConvolutionBwdFilterAlgo_t bwd_filter{};
  std::size_t fwd_ws = 0, bwd_data_ws = 0, bwd_filter_ws = 0;  // as cudnnGet*WorkspaceSize says
};

template <class T>
constexpr cudnnDataType_t data_type() {
  if constexpr (std::is_same_v<T, bfloat16>) return CUDNN_DATA_BFLOAT16;
  else if constexpr (is_reduced_floating_v<T>) return CUDNN_DATA_HALF;
  else return std::is_same_v<T, float> ? CUDNN_DATA_FLOAT : CUDNN_DATA_DOUBLE;
}
/// What a convolution of T accumulates in: double for double, float otherwise (16-bit data too).
template <class T>
constexpr cudnnDataType_t compute_type() {
  return std::is_same_v<T, double> ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
}
/// The type of alpha and beta: double for double data, float for every other type.
template <class T>
using scale_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

namespace detail {
template <class Perf>
std::vector<ConvAlgoPerf> reduce_perf(const Perf* perf, int n) {
  std::vector<ConvAlgoPerf> out;
  for (int k = 0; k < n; ++k)
    out.push_back({static_cast<int>(perf[k].algo), perf[k].status == CUDNN_STATUS_SUCCESS,
                   static_cast<ConvMath>(perf[k].mathType), perf[k].determinism == CUDNN_DETERMINISTIC});
  return out;
}

/// The first of the heuristic's entries (Note [cuDNN algorithm choice]) whose workspace for its
/// math type fits the limit: sets that math type on `conv` and returns {algo, workspace bytes}.
/// `ws(algo, &bytes)` asks cuDNN for the workspace under the descriptor's current math type.
template <class Algo, class Perf, class Ws>
std::pair<Algo, std::size_t> choose(const Perf* perf, int n, cudnnConvolutionDescriptor_t conv,
                                    const ConvMathPolicy& policy, Ws&& ws, const char* what) {
  const char* refused = nullptr;  // why the last candidate was refused
  for (const auto& c : conv_algo_order(reduce_perf(perf, n), policy)) {
    CHORUS_CUDNN_CHECK(cudnnSetConvolutionMathType(conv, static_cast<cudnnMathType_t>(c.math)));
    std::size_t bytes = 0;
    // An algorithm that cannot run under this math type answers NOT_SUPPORTED (or, in some
    // versions, BAD_PARAM): the next candidate is tried.
    const cudnnStatus_t st = ws(perf[c.index].algo, &bytes);
    if (st != CUDNN_STATUS_SUCCESS) {
      refused = cudnnGetErrorString(st);
      continue;
    }
    if (bytes > kMaxWorkspace) {
      refused = "workspace over the limit";
      continue;
    }
    return {perf[c.index].algo, bytes};
  }
  CHORUS_FAIL("cuDNN: no ", what, " convolution algorithm for this shape",
              policy.deterministic ? " among the deterministic ones (cudnn::set_deterministic)" : "",
              " within the ", kMaxWorkspace >> 20, " MiB workspace limit",
              refused ? std::string(" (last refusal: ") + refused + ")" : std::string());
}
}  // namespace detail

/// Made once per key under plan()'s lock.
template <class T>
std::unique_ptr<ConvPlan> build_plan(cudnnHandle_t h, Device d, const Window2d& g, std::int64_t N, std::int64_t O,
                                     std::int64_t groups, const ConvMathPolicy& policy) {
  (void)d;
  auto p = std::make_unique<ConvPlan>();
  const auto dt = data_type<T>();
  auto i = [](std::int64_t v, const char* what) { return checked_int(v, what); };
  CHORUS_CUDNN_CHECK(cudnnCreateTensorDescriptor(&p->x));
  CHORUS_CUDNN_CHECK(cudnnCreateTensorDescriptor(&p->y));
  CHORUS_CUDNN_CHECK(cudnnCreateFilterDescriptor(&p->w));
  CHORUS_CUDNN_CHECK(cudnnSetTensor4dDescriptor(p->x, CUDNN_TENSOR_NCHW, dt, i(N, "batch"), i(g.C, "channels"),
                                                i(g.H, "height"), i(g.W, "width")));
  CHORUS_CUDNN_CHECK(cudnnSetTensor4dDescriptor(p->y, CUDNN_TENSOR_NCHW, dt, i(N, "batch"), i(O, "out_channels"),
                                                i(g.OH, "output height"), i(g.OW, "output width")));
  CHORUS_CUDNN_CHECK(cudnnSetFilter4dDescriptor(p->w, dt, CUDNN_TENSOR_NCHW, i(O, "out_channels"),
                                                i(g.C / groups, "channels per group"), i(g.kh, "kernel height"),
                                                i(g.kw, "kernel width")));
  for (auto* conv : {&p->conv_fwd, &p->conv_bwd_data, &p->conv_bwd_filter}) {
    CHORUS_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(conv));
    CHORUS_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(*conv, i(g.ph, "padding"), i(g.pw, "padding"),
                                                       i(g.sh, "stride"), i(g.sw, "stride"), i(g.dh, "dilation"),
                                                       i(g.dw, "dilation"), CUDNN_CROSS_CORRELATION,
                                                       compute_type<T>()));
    CHORUS_CUDNN_CHECK(cudnnSetConvolutionGroupCount(*conv, i(groups, "groups")));
    // The ranking is asked for under the widest math chorus allows (Note [cuDNN algorithm choice]).
    CHORUS_CUDNN_CHECK(cudnnSetConvolutionMathType(*conv, static_cast<cudnnMathType_t>(conv_query_math(policy))));
  }
  int n = 0;
  {
    cudnnConvolutionFwdAlgoPerf_t perf[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
    CHORUS_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(h, p->x, p->w, p->conv_fwd, p->y,
                                                              CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &n, perf));
    std::tie(p->fwd, p->fwd_ws) = detail::choose<cudnnConvolutionFwdAlgo_t>(
        perf, n, p->conv_fwd, policy,
        [&](cudnnConvolutionFwdAlgo_t a, std::size_t* bytes) {
          return cudnnGetConvolutionForwardWorkspaceSize(h, p->x, p->w, p->conv_fwd, p->y, a, bytes);
        },
        "forward");
  }
  {
    cudnnConvolutionBwdDataAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT];
    CHORUS_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(h, p->w, p->y, p->conv_bwd_data, p->x,
                                                                   CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, &n, perf));
    std::tie(p->bwd_data, p->bwd_data_ws) = detail::choose<cudnnConvolutionBwdDataAlgo_t>(
        perf, n, p->conv_bwd_data, policy,
        [&](cudnnConvolutionBwdDataAlgo_t a, std::size_t* bytes) {
          return cudnnGetConvolutionBackwardDataWorkspaceSize(h, p->w, p->y, p->conv_bwd_data, p->x, a, bytes);
        },
        "backward-data");
  }
  {
    cudnnConvolutionBwdFilterAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT];
    CHORUS_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, p->x, p->y, p->conv_bwd_filter, p->w,
                                                                     CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &n, perf));
    std::tie(p->bwd_filter, p->bwd_filter_ws) = detail::choose<cudnnConvolutionBwdFilterAlgo_t>(
        perf, n, p->conv_bwd_filter, policy,
        [&](cudnnConvolutionBwdFilterAlgo_t a, std::size_t* bytes) {
          return cudnnGetConvolutionBackwardFilterWorkspaceSize(h, p->x, p->y, p->conv_bwd_filter, p->w, a, bytes);
        },
        "backward-filter");
  }
  return p;
}

template <class T>
ConvPlan& plan(cudnnHandle_t h, Device d, const Window2d& g, std::int64_t N, std::int64_t O, std::int64_t groups) {
  using Key = std::tuple<int, bool, bool, bool, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                         std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                         std::int64_t, std::int64_t, std::int64_t>;
  const ConvMathPolicy policy{std::is_same_v<T, float>, std::is_same_v<T, float> && ::chorus::cuda::allow_tf32(),
                              deterministic()};
  const Key key{d.index, policy.fp32, policy.tf32, policy.deterministic, N, g.C, g.H, g.W, O, g.kh, g.kw, g.sh, g.sw,
                g.ph, g.pw, g.dh, g.dw, groups};  // (dh*1000 + dw made dilations (1, 1001) and (2, 1) share a plan)
  thread_local std::map<Key, ConvPlan*> mine;  // Note [per-thread lookups]
  if (auto it = mine.find(key); it != mine.end()) return *it->second;
  static std::mutex m;
  static auto* cache = new std::map<Key, std::unique_ptr<ConvPlan>>();
  std::lock_guard<std::mutex> lk(m);
  auto& slot = (*cache)[key];
  if (!slot) slot = build_plan<T>(h, d, g, N, O, groups, policy);
  mine.emplace(key, slot.get());
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
  const scale_t<T> one = 1, zero = 0;
  CHORUS_CUDNN_CHECK(
      cudnnConvolutionForward(h, &one, p.x, x, p.w, w, p.conv_fwd, p.fwd, ws_ptr(ws), p.fwd_ws, &zero, p.y, y));
}

/// gx = dL/dx (overwritten).
template <class T>
void conv_backward_data(const Window2d& g, std::int64_t N, std::int64_t O, std::int64_t groups, const T* gy,
                        const T* w, T* gx, Device d) {
  Launch launch(d);
  auto h = handle_for(d, launch.stream);
  auto& p = plan<T>(h, d, g, N, O, groups);
  auto ws = workspace(d, p.bwd_data_ws);
  const scale_t<T> one = 1, zero = 0;
  CHORUS_CUDNN_CHECK(cudnnConvolutionBackwardData(h, &one, p.w, w, p.y, gy, p.conv_bwd_data, p.bwd_data, ws_ptr(ws),
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
  const scale_t<T> one = 1, zero = 0;
  CHORUS_CUDNN_CHECK(cudnnConvolutionBackwardFilter(h, &one, p.x, x, p.y, gy, p.conv_bwd_filter, p.bwd_filter, ws_ptr(ws),
                                                    p.bwd_filter_ws, &zero, p.w, gw));
}

#if CHORUS_CUDA_PRECOMPILED  // Note [precompiled CUDA kernels]
CHORUS_CUDA_CUDNN_INSTANCES(CHORUS_CUDA_EXTERN_INSTANCE)
#endif

}  // namespace backend::cuda::cudnn
CHORUS_NAMESPACE_END
