// chorus against LibTorch (Debian libtorch-dev) on a ResNet basic block with BatchNorm:
// the same weights and input give the same outputs, gradients and running statistics
// (float64, 1e-10), in training and in eval mode. Skips where LibTorch was not found.
#include "resnet_block.hpp"
#include "test_util.hpp"

#if CHORUS_HAVE_LIBTORCH
#include <torch/torch.h>
#endif

using namespace chorus;
using chorus::testing::BasicBlock;
using chorus::testing::fill_pattern;
using chorus::testing::pattern_count;
using chorus::testing::pattern_value;

#if CHORUS_HAVE_LIBTORCH
namespace {
struct TorchBlockImpl : torch::nn::Module {
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Sequential downsample{nullptr};
  TorchBlockImpl(int64_t in, int64_t out, int64_t stride) {
    using torch::nn::Conv2dOptions;
    conv1 = register_module("conv1", torch::nn::Conv2d(Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(out));
    conv2 = register_module("conv2", torch::nn::Conv2d(Conv2dOptions(out, out, 3).padding(1).bias(false)));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(out));
    if (stride != 1 || in != out)
      downsample = register_module(
          "downsample", torch::nn::Sequential(torch::nn::Conv2d(Conv2dOptions(in, out, 1).stride(stride).bias(false)),
                                              torch::nn::BatchNorm2d(out)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = torch::relu(bn1(conv1(x)));
    y = bn2(conv2(y));
    return torch::relu(y + (downsample ? downsample->forward(x) : x));
  }
};
TORCH_MODULE(TorchBlock);

torch::Tensor pattern_tensor(const std::string& name, at::IntArrayRef shape) {
  auto t = torch::empty(shape, torch::kFloat64);
  auto* p = t.data_ptr<double>();
  for (int64_t j = 0; j < t.numel(); ++j) p[j] = pattern_value(name, j);
  return t;
}

void fill_torch(TorchBlock& m) {
  torch::NoGradGuard g;
  for (auto& p : m->named_parameters()) p.value().copy_(pattern_tensor(p.key(), p.value().sizes()));
  for (auto& b : m->named_buffers()) {
    if (b.value().scalar_type() == torch::kLong) {
      b.value().fill_(pattern_count(b.key()));
    } else {
      b.value().copy_(pattern_tensor(b.key(), b.value().sizes()));
    }
  }
}

Tensor<double> from_torch(const torch::Tensor& t) {
  auto c = t.detach().contiguous().to(torch::kFloat64);
  std::vector<double> v(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
  Shape s;
  for (auto d : c.sizes()) s.push_back(d);
  return from_vector<double>(v, s);
}

constexpr double kTol = 1e-10;
}  // namespace

TEST(LibTorchCrossCheck, ResNetBasicBlockWithBatchNorm) {
  for (auto [in, out, stride] : {std::tuple{4, 8, 2}, std::tuple{6, 6, 1}}) {
    SCOPED_TRACE("block " + std::to_string(in) + "->" + std::to_string(out) + " stride " + std::to_string(stride));
    // float64 parameters from construction (Module::to(kFloat64) would also cast the int64
    // num_batches_tracked buffers in LibTorch's C++ API).
    torch::set_default_dtype(caffe2::TypeMeta::Make<double>());
    TorchBlock tb(in, out, stride);
    fill_torch(tb);
    BasicBlock<double> cb(in, out, stride);
    fill_pattern(cb);
    // The same names, in the same order, as the PyTorch state dict.
    std::vector<std::string> torch_names, chorus_names;
    for (auto& p : tb->named_parameters()) torch_names.push_back(p.key());
    for (auto& b : tb->named_buffers()) torch_names.push_back(b.key());
    for (auto& t : cb.named_tensors()) chorus_names.push_back(t.name);
    EXPECT_EQ(chorus_names, torch_names);

    Generator gen(42);
    auto x = rand<double>({5, in, 9, 8}, Device::cpu(), -1, 1, gen);
    auto xt = torch::from_blob(x.to_vector().data(), {5, in, 9, 8}, torch::kFloat64).clone().requires_grad_(true);
    auto xc = x.detach().requires_grad_(true);
    for (int step = 0; step < 2; ++step) {
      auto yt = tb->forward(xt);
      auto yc = cb.forward(xc);
      ASSERT_TRUE(chorus::testing::all_close(yc, from_torch(yt), kTol, kTol)) << "output, step " << step;
      auto w = randn<double>(yc.shape(), Device::cpu(), 0, 1, gen);
      auto wt = torch::from_blob(w.to_vector().data(), yt.sizes(), torch::kFloat64).clone();
      cb.zero_grad();
      tb->zero_grad();
      xc.set_grad({});
      if (xt.grad().defined()) xt.mutable_grad().zero_();
      (yc * w).sum().backward();
      (yt * wt).sum().backward();
      EXPECT_TRUE(chorus::testing::all_close(xc.grad(), from_torch(xt.grad()), kTol, kTol)) << "input grad";
      auto tparams = tb->named_parameters();
      for (auto& p : cb.named_parameters()) {
        auto g = p.tensor.as<double>().grad();
        ASSERT_TRUE(g.defined()) << p.name;
        EXPECT_TRUE(chorus::testing::all_close(g, from_torch(tparams[p.name].grad()), kTol, kTol)) << "grad of " << p.name;
      }
      auto tbufs = tb->named_buffers();
      for (auto& b : cb.named_buffers()) {
        if (b.tensor.dtype() == DType::Int64) {
          EXPECT_EQ(b.tensor.as<std::int64_t>().item(), tbufs[b.name].item<int64_t>()) << b.name;
        } else {
          EXPECT_TRUE(chorus::testing::all_close(b.tensor.as<double>(), from_torch(tbufs[b.name]), kTol, kTol)) << b.name;
        }
      }
    }
    tb->eval();
    cb.eval();
    EXPECT_TRUE(chorus::testing::all_close(cb.forward(x), from_torch(tb->forward(xt.detach())), kTol, kTol)) << "eval";
  }
}
#else
#if CHORUS_LIBTORCH_SANITIZED
#define CHORUS_LIBTORCH_SKIP "LibTorch is not built with sanitizers: this test runs in the unsanitized build"
#else
#define CHORUS_LIBTORCH_SKIP \
  "LibTorch was not found when this test was configured (apt-get install libtorch-dev, then reconfigure)"
#endif
TEST(LibTorchCrossCheck, ResNetBasicBlockWithBatchNorm) { GTEST_SKIP() << CHORUS_LIBTORCH_SKIP; }
#endif
