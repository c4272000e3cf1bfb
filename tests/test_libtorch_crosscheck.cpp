// chorus against LibTorch (Debian libtorch-dev) on a ResNet basic block with BatchNorm:
// the same weights and input give the same outputs, gradients and running statistics
// (float64, 1e-10), in training and in eval mode. Skips where LibTorch was not found.
#include "resnet_block.hpp"
#include "libtorch_util.hpp"

#include <functional>


using namespace chorus;
using chorus::testing::BasicBlock;
using chorus::testing::fill_pattern;
using chorus::testing::pattern_count;
using chorus::testing::pattern_value;

#if CHORUS_HAVE_LIBTORCH
namespace {
using chorus::testing::from_torch;
using chorus::testing::sizes_of;
using chorus::testing::to_torch;
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

namespace {
using CFn = std::function<Tensor<double>(const std::vector<Tensor<double>>&)>;
using TFn = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;


/// The same op in chorus and LibTorch on the same float64 inputs: outputs and input gradients.
void same_as_torch(const char* name, const CFn& f, const TFn& g, const std::vector<Tensor<double>>& inputs) {
  SCOPED_TRACE(name);
  std::vector<Tensor<double>> ci;
  std::vector<torch::Tensor> ti;
  for (auto& x : inputs) {
    ci.push_back(x.detach().requires_grad_(true));
    ti.push_back(to_torch(x).requires_grad_(true));
  }
  auto yc = f(ci);
  auto yt = g(ti);
  ASSERT_TRUE(chorus::testing::all_close(yc, from_torch(yt), kTol, kTol)) << name << " output";
  Generator gen(5);
  auto w = randn<double>(yc.shape(), Device::cpu(), 0, 1, gen);
  (yc * w).sum().backward();
  (yt * to_torch(w)).sum().backward();
  for (std::size_t i = 0; i < ci.size(); ++i)
    EXPECT_TRUE(chorus::testing::all_close(ci[i].grad(), from_torch(ti[i].grad()), kTol, kTol))
        << name << " gradient of input " << i;
}

Tensor<double> rnd(const Shape& s, std::uint64_t seed, double lo = -1, double hi = 1) {
  Generator g(seed);
  return rand<double>(s, Device::cpu(), lo, hi, g);
}
}  // namespace

TEST(LibTorchCrossCheck, EveryLayerOp) {
  namespace TF = torch::nn::functional;
  using CV = std::vector<Tensor<double>>;
  using TV = std::vector<torch::Tensor>;
  same_as_torch(
      "conv2d strided dilated grouped", [](const CV& x) { return conv2d(x[0], x[1], x[2], {2, 1}, {1, 2}, {2, 1}, 2); },
      [](const TV& x) { return torch::conv2d(x[0], x[1], x[2], {2, 1}, {1, 2}, {2, 1}, 2); },
      {rnd({2, 4, 11, 9}, 1), rnd({6, 2, 3, 3}, 2), rnd({6}, 3)});
  same_as_torch(
      "max_pool2d", [](const CV& x) { return max_pool2d(x[0], {3, 2}, Pair{2, 1}, {1, 1}, {1, 2}, true); },
      [](const TV& x) {
        return TF::max_pool2d(x[0], TF::MaxPool2dFuncOptions({3, 2}).stride({2, 1}).padding(1).dilation({1, 2}).ceil_mode(true));
      },
      {rnd({2, 3, 9, 8}, 4)});
  for (bool include_pad : {true, false})
    same_as_torch(
        "avg_pool2d", [=](const CV& x) { return avg_pool2d(x[0], {3, 3}, Pair{2, 2}, {1, 1}, true, include_pad); },
        [=](const TV& x) {
          return TF::avg_pool2d(
              x[0], TF::AvgPool2dFuncOptions(3).stride(2).padding(1).ceil_mode(true).count_include_pad(include_pad));
        },
        {rnd({2, 3, 8, 9}, 5)});
  same_as_torch(
      "avg_pool2d divisor_override", [](const CV& x) { return avg_pool2d(x[0], {2, 2}, std::nullopt, {0, 0}, false, true, 3); },
      [](const TV& x) { return TF::avg_pool2d(x[0], TF::AvgPool2dFuncOptions(2).divisor_override(3)); }, {rnd({1, 2, 6, 6}, 6)});
  same_as_torch(
      "adaptive_avg_pool2d", [](const CV& x) { return adaptive_avg_pool2d(x[0], {3, 4}); },
      [](const TV& x) { return TF::adaptive_avg_pool2d(x[0], TF::AdaptiveAvgPool2dFuncOptions({3, 4})); },
      {rnd({2, 3, 7, 5}, 7)});
  same_as_torch(
      "batch_norm 1d", [](const CV& x) { return batch_norm(x[0], Tensor<double>(), Tensor<double>(), x[1], x[2], true); },
      [](const TV& x) { return torch::batch_norm(x[0], x[1], x[2], {}, {}, true, 0.1, 1e-5, false); },
      {rnd({9, 4, 3}, 8), rnd({4}, 9), rnd({4}, 10)});
  same_as_torch(
      "layer_norm", [](const CV& x) { return layer_norm(x[0], Shape{3, 4}, x[1], x[2]); },
      [](const TV& x) { return TF::layer_norm(x[0], TF::LayerNormFuncOptions({3, 4}).weight(x[1]).bias(x[2])); },
      {rnd({2, 5, 3, 4}, 11), rnd({3, 4}, 12), rnd({3, 4}, 13)});
  auto idx = from_vector<std::int64_t>({2, 0, 4, 2, 1, 4}, Shape{2, 3});
  auto tidx = torch::tensor(std::vector<int64_t>{2, 0, 4, 2, 1, 4}).reshape({2, 3});
  same_as_torch(
      "embedding padding_idx", [&](const CV& x) { return embedding(idx, x[0], 2); },
      [&](const TV& x) { return TF::embedding(tidx, x[0], TF::EmbeddingFuncOptions().padding_idx(2)); }, {rnd({5, 3}, 14)});
  same_as_torch("gelu", [](const CV& x) { return gelu(x[0]); }, [](const TV& x) { return torch::gelu(x[0]); },
                {rnd({40}, 15, -4, 4)});
  same_as_torch("silu", [](const CV& x) { return silu(x[0]); }, [](const TV& x) { return torch::silu(x[0]); },
                {rnd({40}, 16, -4, 4)});
}
#else
TEST(LibTorchCrossCheck, ResNetBasicBlockWithBatchNorm) { GTEST_SKIP() << CHORUS_LIBTORCH_SKIP; }
#endif
