// CPU convolution backends on ResNet-20's convolutions (CIFAR-10, 32x32): im2col + OpenBLAS
// against oneDNN, forward and forward+backward, float32, in the same run, in alternating rounds
// (Note [paired rounds] in bench_util.hpp).
//   conv_bench [--batch N] [--rounds R (5)] [--reps N (timed calls per round, 3)]
// Prints one row per layer shape with the median time of each backend and the median of the
// per-round ratios with its min-max, and the batch-norm and pooling kernels' times on the same
// activations for scale.
#include <chorus/chorus.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "peer.hpp"

#if CHORUS_HAS_ONEDNN
#include <oneapi/dnnl/dnnl.hpp>
#endif

using namespace chorus;

namespace {
/// Rounds of a (im2col, say) against b (oneDNN), each a {setup, step} pair (setup runs before
/// every round: the backend switch); returns each side's median ms and the per-round ratio a / b.
struct Paired {
  double a_ms, b_ms;
  bench::Spread ratio;
};
Paired paired(int rounds, int reps, std::function<void()> setup_a, std::function<void()> a,
              std::function<void()> setup_b, std::function<void()> b) {
  auto entry = [](std::function<void()> setup, std::function<void()> step) {
    auto t = std::make_shared<bench::Timed>(std::move(step), 1);  // oneDNN builds its primitives at the first call
    return bench::Entry{{}, [t, setup](int n) {
                          setup();
                          return t->round(n);
                        }};
  };
  const auto s = bench::run_rounds({entry(setup_a, a)}, {entry(setup_b, b)}, rounds, reps);
  std::vector<double> ra, rb;
  for (const auto& r : s[0]) ra.push_back(bench::median(r));
  for (const auto& r : s[1]) rb.push_back(bench::median(r));
  return {bench::median(ra), bench::median(rb), bench::spread(bench::paired_ratios(ra, rb))};
}

std::string fmt(const bench::Spread& s) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.2fx [%.2f-%.2f]", s.median, s.min, s.max);
  return buf;
}
}  // namespace

int main(int argc, char** argv) {
  std::int64_t batch = 128;
  int reps = 3, rounds = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--batch")) batch = std::atoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--rounds")) rounds = std::atoi(argv[i + 1]);
  }
  if (reps < 1 || rounds < 1) {
    std::fprintf(stderr, "conv_bench: --reps and --rounds must be at least 1\n");
    return 2;
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
  std::printf("batch %lld, float32, %d rounds of %d calls, im2col and oneDNN alternating (ms: median of the "
              "rounds; ratio im2col / oneDNN: median of the per-round ratios [min-max])\n",
              (long long)batch, rounds, reps);
  std::printf("%-24s %11s %11s %-20s | %11s %11s %-20s\n", "layer", "fwd im2col", "fwd oneDNN", "ratio", "f+b im2col",
              "f+b oneDNN", "ratio");
  auto im2col = [] { backend::cpu::set_onednn_enabled(false); };
  auto onednn = [] { backend::cpu::set_onednn_enabled(true); };
  Generator g(1);
  for (const auto& s : shapes) {
    auto x = rand<float>({batch, s.c, s.hw, s.hw}, Device::cpu(), -1, 1, g).requires_grad_(true);
    auto w = rand<float>({s.o, s.c, s.k, s.k}, Device::cpu(), -0.1, 0.1, g).requires_grad_(true);
    const Pair stride{s.stride, s.stride}, pad{s.k / 2, s.k / 2};
    auto fwd_step = [&] {
      NoGradGuard ng;
      conv2d(x, w, Tensor<float>(), stride, pad);
    };
    auto both_step = [&] {
      auto y = conv2d(x, w, Tensor<float>(), stride, pad);
      y.backward(ones_like(y));
    };
    const Paired fwd = paired(rounds, reps, im2col, fwd_step, onednn, fwd_step);
    const Paired both = paired(rounds, reps, im2col, both_step, onednn, both_step);
    std::printf("%-24s %11.2f %11.2f %-20s | %11.2f %11.2f %-20s\n", s.name, fwd.a_ms, fwd.b_ms, fmt(fwd.ratio).c_str(),
                both.a_ms, both.b_ms, fmt(both.ratio).c_str());
  }
  backend::cpu::set_onednn_enabled(true);
  // For scale: chorus's own batch-norm and pooling kernels on the largest activation.
  auto a = rand<float>({batch, 16, 32, 32}, Device::cpu(), -1, 1, g).requires_grad_(true);
  auto gamma = ones<float>({16}).requires_grad_(true), beta = zeros<float>({16}).requires_grad_(true);
  auto bn = [&] {
    auto y = batch_norm(a, Tensor<float>(), Tensor<float>(), gamma, beta, true);
    y.backward(ones_like(y));
  };
  auto alone = [&](std::function<void()> step) {  // the median of `rounds` rounds' medians
    bench::Timed t(std::move(step), 1);
    std::vector<double> m;
    for (int r = 0; r < rounds; ++r) m.push_back(bench::median(t.round(reps)));
    return bench::median(m);
  };
  const double pool = alone([&] {
    auto y = adaptive_avg_pool2d(a, {1, 1});
    y.backward(ones_like(y));
  });
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
    auto dnnl_bn = [&] {
      fwd.execute(st, {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}, {DNNL_ARG_MEAN, vec(mean.data())},
                       {DNNL_ARG_VARIANCE, vec(var.data())}, {DNNL_ARG_SCALE_SHIFT, scale_shift}});
      bwd.execute(st, {{DNNL_ARG_SRC, src}, {DNNL_ARG_MEAN, vec(mean.data())}, {DNNL_ARG_VARIANCE, vec(var.data())},
                       {DNNL_ARG_DIFF_DST, ddst}, {DNNL_ARG_SCALE_SHIFT, scale_shift}, {DNNL_ARG_DIFF_SRC, dsrc},
                       {DNNL_ARG_DIFF_SCALE_SHIFT, dscale_shift}});
      st.wait();
    };
    const Paired p = paired(rounds, reps, [] {}, bn, [] {}, dnnl_bn);
    std::printf("batch_norm f+b [%lld,16,32,32]: chorus %.2f ms, oneDNN (nchw) %.2f ms (ratio %s)", (long long)batch,
                p.a_ms, p.b_ms, fmt(p.ratio).c_str());
  }
#else
  std::printf("batch_norm f+b [%lld,16,32,32]: chorus %.2f ms", (long long)batch, alone(bn));
#endif
  std::printf("; adaptive_avg_pool2d f+b: %.2f ms\n", pool);
  return 0;
}
