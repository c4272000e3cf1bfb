// nn::Module: registration, names, modes, moves between devices, deep copies; the layers.
#include <sstream>

#include "test_util.hpp"

using namespace chorus;
using chorus::testing::all_close;
using chorus::testing::throws_with;
using chorus::testing::values_are;

namespace {
struct BlockImpl : nn::Module {
  nn::Linear fc;
  nn::Dropout drop;
  Tensor<float> scale;
  BlockImpl(int in, int out)
      : fc(register_module("fc", nn::Linear(in, out))),
        drop(register_module("drop", nn::Dropout(0.5))),
        scale(register_buffer("scale", full<float>({out}, 2.0f))) {}
  Tensor<float> forward(const Tensor<float>& x) { return drop(relu(fc(x))) * scale; }
};
CHORUS_MODULE(Block);

struct Net : nn::Module {
  Block block;
  nn::Linear head;
  Tensor<std::int64_t> steps;
  Net() : block(register_module("block", Block(4, 8))), head(register_module("head", nn::Linear(8, 2))) {
    steps = register_buffer("steps", zeros<std::int64_t>({1}));
  }
  Tensor<float> forward(const Tensor<float>& x) { return head(block(x)); }
};

struct RawPointerNet : nn::Module {
  std::shared_ptr<nn::LinearImpl<float>> fc;
  RawPointerNet() { fc = register_module("fc", std::make_shared<nn::LinearImpl<float>>(2, 2)); }
};
}  // namespace

TEST(Module, NamedParametersAreDottedAndOrdered) {
  Net net;
  std::vector<std::string> names;
  for (auto& p : net.named_parameters()) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"block.fc.weight", "block.fc.bias", "head.weight", "head.bias"}));
  std::vector<std::string> bufs;
  for (auto& b : net.named_buffers()) bufs.push_back(b.name);
  EXPECT_EQ(bufs, (std::vector<std::string>{"steps", "block.scale"}));
  EXPECT_EQ(net.parameters().size(), 4u);
  EXPECT_EQ(net.parameters(false).size(), 0u);
  EXPECT_EQ(net.named_children().size(), 2u);
  EXPECT_EQ(net.named_children()[0].name, "block");
  for (auto& p : net.parameters()) EXPECT_TRUE(p.requires_grad());
  // The registry and the members are the same tensors.
  EXPECT_EQ(net.named_parameters()[0].tensor.impl_key(), net.block->fc->weight.impl().get());
  EXPECT_EQ(net.find_tensor("block.scale").impl_key(), net.block->scale.impl().get());
  EXPECT_FALSE(net.find_tensor("nope.x").defined());
}

TEST(Module, RegistrationErrors) {
  nn::Module m;
  m.register_parameter("w", zeros<float>({1}));
  EXPECT_TRUE(throws_with([&] { m.register_parameter("w", zeros<float>({1})); }, {"'w'", "already"}));
  EXPECT_TRUE(throws_with([&] { m.register_buffer("a.b", zeros<float>({1})); }, {"a.b", "'.'"}));
  EXPECT_TRUE(throws_with([&] { m.register_parameter("", zeros<float>({1})); }, {"empty"}));
  auto x = ones<float>({1}).requires_grad_();
  EXPECT_TRUE(throws_with([&] { m.register_parameter("y", x * 2.0); }, {"leaf"}));
  EXPECT_TRUE(throws_with([&] { m.register_module("n", nn::Linear(nullptr)); }, {"empty module"}));
}

TEST(Module, TrainEvalIsRecursive) {
  Net net;
  EXPECT_TRUE(net.block->drop->is_training());
  net.eval();
  EXPECT_FALSE(net.is_training());
  EXPECT_FALSE(net.block->drop->is_training());
  auto x = randn<float>({3, 4});
  EXPECT_TRUE(all_close(net.forward(x), net.forward(x), 0));  // dropout off in eval
  net.train();
  EXPECT_TRUE(net.block->fc->is_training());
}

TEST(Module, ToDeviceMovesInPlace) {
  set_cpu_device_count(2);
  Net net;
  auto w = net.head->weight;  // a handle held outside the module
  auto before = w.to_vector();
  net.forward(randn<float>({2, 4})).sum().backward();
  net.to(Device::cpu(1));
  EXPECT_EQ(w.device(), Device::cpu(1));
  EXPECT_EQ(w.grad().device(), Device::cpu(1));
  EXPECT_EQ(net.steps.device(), Device::cpu(1));
  EXPECT_TRUE(values_are(w, before, 0));
  net.eval();
  EXPECT_EQ(net.forward(randn<float>({2, 4}, Device::cpu(1))).device(), Device::cpu(1));
  net.zero_grad();
  EXPECT_FALSE(w.grad().defined());
}

TEST(Module, CloneIsADeepCopyOnAnotherDevice) {
  set_cpu_device_count(2);
  Net net;
  net.eval();
  net.forward(randn<float>({2, 4})).sum().backward();
  Net copy = nn::clone(net, Device::cpu(1));
  auto orig = net.named_tensors();
  auto cp = copy.named_tensors();
  ASSERT_EQ(orig.size(), cp.size());
  for (std::size_t i = 0; i < orig.size(); ++i) {
    EXPECT_EQ(orig[i].name, cp[i].name);
    EXPECT_NE(orig[i].tensor.impl_key(), cp[i].tensor.impl_key());
    EXPECT_EQ(cp[i].tensor.device(), Device::cpu(1));
    EXPECT_EQ(cp[i].tensor.requires_grad(), orig[i].tensor.requires_grad());
  }
  // Members and registry of the copy agree, and the submodules are new objects.
  EXPECT_EQ(copy.named_parameters()[0].tensor.impl_key(), copy.block->fc->weight.impl().get());
  EXPECT_EQ(copy.named_children()[0].module.get(), copy.block.get());
  EXPECT_NE(copy.block.get(), net.block.get());
  EXPECT_EQ(copy.block->named_children()[0].module.get(), copy.block->fc.get());
  EXPECT_FALSE(copy.head->weight.grad().defined());
  EXPECT_FALSE(copy.block->drop->is_training());
  auto x = randn<float>({5, 4});
  EXPECT_TRUE(all_close(copy.forward(x.to(Device::cpu(1))).to(Device::cpu(0)), net.forward(x), 0));
  // Changing the copy leaves the original alone.
  {
    NoGradGuard g;
    copy.head->weight.fill_(0);
  }
  EXPECT_FALSE(values_are(net.head->weight, std::vector<float>(16, 0.0f)));
  // A plain copy (outside clone) shares, like a holder.
  Net shallow = net;
  EXPECT_EQ(shallow.head->weight.impl(), net.head->weight.impl());
}

TEST(Module, CloneReportsSubmodulesHeldByRawSharedPtr) {
  RawPointerNet net;
  EXPECT_TRUE(throws_with([&] { nn::clone(net, Device::cpu(0)); }, {"'fc'", "raw std::shared_ptr"}));
}

TEST(Module, CloneOfAHolderAndOfSequential) {
  nn::Sequential seq(nn::Linear(3, 5), nn::GELU(), nn::Linear(5, 1));
  auto c = nn::clone(seq, Device::cpu(0));
  EXPECT_NE(c.get(), seq.get());
  EXPECT_EQ(c->size(), 3u);
  auto x = randn<float>({4, 3});
  EXPECT_TRUE(all_close(c(x), seq(x), 0));
  EXPECT_NE(c->named_parameters()[0].tensor.impl_key(), seq->named_parameters()[0].tensor.impl_key());
  std::ostringstream os;
  seq->pretty_print(os);
  EXPECT_NE(os.str().find("(1): GELU()"), std::string::npos);
}

template <class T>
class LayersTyped : public ::testing::Test {};
TYPED_TEST_SUITE(LayersTyped, chorus::testing::FloatTypes);

TYPED_TEST(LayersTyped, LinearHasPyTorchsDefaultInitialisation) {
  using T = TypeParam;
  nn::LinearT<T> fc(400, 30);
  EXPECT_EQ(fc->weight.shape(), (Shape{30, 400}));
  EXPECT_EQ(fc->bias.shape(), (Shape{30}));
  const double bound = 1.0 / std::sqrt(400.0);
  double mx = 0, sq = 0;
  auto w = fc->weight.to_vector();
  for (auto v : w) {
    mx = std::max(mx, std::abs(double(v)));
    sq += double(v) * v;
  }
  EXPECT_LE(mx, bound);
  EXPECT_GT(mx, 0.95 * bound);
  EXPECT_NEAR(std::sqrt(sq / w.size()), bound / std::sqrt(3.0), 0.05 * bound);  // U(-b, b) has sd b/sqrt(3)
  for (auto v : fc->bias.to_vector()) EXPECT_LE(std::abs(double(v)), bound);
  nn::LinearT<T> nb(3, 2, nn::LinearOptions{.bias = false});
  EXPECT_FALSE(nb->bias.defined());
  EXPECT_EQ(nb->parameters().size(), 1u);
  auto x = randn<T>({4, 3});
  EXPECT_TRUE(all_close(nb(x), matmul(x, nb->weight.t()), 1e-6));
}

TYPED_TEST(LayersTyped, SequentialMatchesTheComposition) {
  using T = TypeParam;
  nn::LinearT<T> a(3, 4), b(4, 2);
  nn::SequentialT<T> seq(a, nn::ReLU(), nn::Tanh(), b, nn::Sigmoid());
  auto x = randn<T>({5, 3});
  EXPECT_TRUE(all_close(seq(x), sigmoid(b(chorus::tanh(relu(a(x))))), 0));
  std::vector<std::string> names;
  for (auto& p : seq->named_parameters()) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "0.bias", "3.weight", "3.bias"}));
}
