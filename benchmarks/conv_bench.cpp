// CPU convolution backends on ResNet-20's convolutions (CIFAR-10, 32x32): im2col + OpenBLAS
// against oneDNN, forward and forward+backward, float32, in the same run.
//   conv_bench [--batch N] [--reps R]
// Prints one row per layer shape with the median time of each backend and their ratio, and
// the batch-norm and pooling kernels' times on the same activations for scale.
#include <chorus/chorus.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#if CHORUS_HAS_ONEDNN
#include <oneapi/dnnl/dnnl.hpp>
#endif

using namespace chorus;

namespace {
double median_ms(int reps, const std::function<void()>& f) {
  f();  // warm-up (oneDNN builds its primitives here)
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto a = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  std::int64_t batch = 128;
  int reps = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--batch")) batch = std::atoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
  }
  if (!backend::cpu::onednn_available()) {
    std::printf("built without oneDNN: nothing to compare (apt-get install libdnnl-dev, reconfigure)\n");
    return 0;
  }
  struct Shape_ {
    const char* name;
    std::int64_t c, o, hw, stride, k;
  };
  const Shape_ shapes[] = {{"stem 3->16 3x3 @32", 3, 16, 32, 1, 3},    {"stage1 16->16 3x3 @32", 16, 16, 32, 1, 3},
                           {"stage2 16->32 3x3 s2", 16, 32, 32, 2, 3}, {"stage2 32->32 3x3 @16", 32, 32, 16, 1, 3},
                           {"stage3 32->64 3x3 s2", 32, 64, 16, 2, 3}, {"stage3 64->64 3x3 @8", 64, 64, 8, 1, 3},
                           {"shortcut 16->32 1x1 s2", 16, 32, 32, 2, 1}};
  std::printf("batch %lld, float32, median of %d (ms); machine shared, timings noisy\n", (long long)batch, reps);
  std::printf("%-24s %11s %11s %7s | %11s %11s %7s\n", "layer", "fwd im2col", "fwd oneDNN", "ratio", "f+b im2col",
              "f+b oneDNN", "ratio");
  Generator g(1);
  for (const auto& s : shapes) {
    auto x = rand<float>({batch, s.c, s.hw, s.hw}, Device::cpu(), -1, 1, g).requires_grad_(true);
    auto w = rand<float>({s.o, s.c, s.k, s.k}, Device::cpu(), -0.1, 0.1, g).requires_grad_(true);
    const Pair stride{s.stride, s.stride}, pad{s.k / 2, s.k / 2};
    double fwd[2], both[2];
    for (int use : {0, 1}) {
      backend::cpu::set_onednn_enabled(use == 1);
      fwd[use] = median_ms(reps, [&] {
        NoGradGuard ng;
        conv2d(x, w, Tensor<float>(), stride, pad);
      });
      both[use] = median_ms(reps, [&] {
        auto y = conv2d(x, w, Tensor<float>(), stride, pad);
        y.backward(ones_like(y));
      });
    }
    std::printf("%-24s %11.2f %11.2f %6.2fx | %11.2f %11.2f %6.2fx\n", s.name, fwd[0], fwd[1], fwd[0] / fwd[1], both[0],
                both[1], both[0] / both[1]);
  }
  // For scale: chorus's own batch-norm and pooling kernels on the largest activation.
  auto a = rand<float>({batch, 16, 32, 32}, Device::cpu(), -1, 1, g).requires_grad_(true);
  auto gamma = ones<float>({16}).requires_grad_(true), beta = zeros<float>({16}).requires_grad_(true);
  const double bn = median_ms(reps, [&] {
    auto y = batch_norm(a, Tensor<float>(), Tensor<float>(), gamma, beta, true);
    y.backward(ones_like(y));
  });
  const double pool = median_ms(reps, [&] {
    auto y = adaptive_avg_pool2d(a, {1, 1});
    y.backward(ones_like(y));
  });
  std::printf("batch_norm f+b [%lld,16,32,32]: chorus %.2f ms", (long long)batch, bn);
#if CHORUS_HAS_ONEDNN
  {  // the same training-mode batch norm, forward + backward, through oneDNN on NCHW (one thread, as conv)
    using namespace dnnl;
    engine eng(engine::kind::cpu, 0);
    stream st(eng);
    const memory::dims dims{batch, 16, 32, 32};
    memory::desc md(dims, memory::data_type::f32, memory::format_tag::nchw);
    const auto flags = normalization_flags::use_scale_shift;
    batch_normalization_forward::primitive_desc fpd(
        batch_normalization_forward::desc(prop_kind::forward_training, md, 1e-5f, flags), eng);
    batch_normalization_backward::primitive_desc bpd(
        batch_normalization_backward::desc(prop_kind::backward, md, md, 1e-5f, flags), eng, fpd);
    auto y = Tensor<float>::empty(a.shape()), dx = Tensor<float>::empty(a.shape()), dy = ones_like(a);
    auto xd = a.detach();
    auto vec = [&](float* p) { return memory(memory::desc({16}, memory::data_type::f32, memory::format_tag::x), eng, p); };
    auto mean = zeros<float>({16}), var = zeros<float>({16}), ss = ones<float>({2, 16}), dss = zeros<float>({2, 16});
    memory src(md, eng, xd.data()), dst(md, eng, y.data()), ddst(md, eng, dy.data()), dsrc(md, eng, dx.data());
    memory scale_shift(fpd.weights_desc(), eng, ss.data()), dscale_shift(bpd.diff_weights_desc(), eng, dss.data());
    batch_normalization_forward fwd(fpd);
    batch_normalization_backward bwd(bpd);
    const double dnnl_bn = median_ms(reps, [&] {
      fwd.execute(st, {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}, {DNNL_ARG_MEAN, vec(mean.data())},
                       {DNNL_ARG_VARIANCE, vec(var.data())}, {DNNL_ARG_SCALE_SHIFT, scale_shift}});
      bwd.execute(st, {{DNNL_ARG_SRC, src}, {DNNL_ARG_MEAN, vec(mean.data())}, {DNNL_ARG_VARIANCE, vec(var.data())},
                       {DNNL_ARG_DIFF_DST, ddst}, {DNNL_ARG_SCALE_SHIFT, scale_shift}, {DNNL_ARG_DIFF_SRC, dsrc},
                       {DNNL_ARG_DIFF_SCALE_SHIFT, dscale_shift}});
      st.wait();
    });
    std::printf(", oneDNN (nchw) %.2f ms (ratio %.2fx)", dnnl_bn, bn / dnnl_bn);
  }
#endif
  std::printf("; adaptive_avg_pool2d f+b: %.2f ms\n", pool);
  return 0;
}
