// Bad input that once read or wrote out of bounds, gave a silently wrong result or let a
// non-chorus exception escape (issue 10). Each test failed before its fix; the memory ones
// are meant to run under -DCHORUS_SANITIZE=address,undefined too.
#include <sys/stat.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "test_util.hpp"

using namespace chorus;
using chorus::testing::throws_with;
namespace fs = std::filesystem;

namespace {
template <class T>
bool is_nan(T v) {
  return v != v;
}
}  // namespace

// ---- 1. gradient shapes ----

TEST(GradShape, SetGradRejectsAnotherShapeOrDevice) {
  auto p = zeros<float>({1000}).requires_grad_();
  EXPECT_TRUE(throws_with([&] { p.set_grad(ones<float>({1})); },
                          {"set_grad", "gradient of shape [1]", "tensor of shape [1000]"}));
  EXPECT_FALSE(p.grad().defined());
  EXPECT_TRUE(throws_with([&] { p.set_grad(ones<float>({1000, 2}).select(1, 0)); }, {"not contiguous"}));
  EXPECT_TRUE(throws_with([&] { p.set_grad(p); }, {"its own gradient"}));
  set_cpu_device_count(2);
  EXPECT_TRUE(throws_with([&] { p.set_grad(ones<float>({1000}, Device::cpu(1))); }, {"cpu:1", "cpu:0"}));
  p.set_grad(ones<float>({1000}));  // the right shape is accepted, and clearing too
  EXPECT_EQ(p.grad().numel(), 1000);
  p.set_grad({});
  EXPECT_FALSE(p.grad().defined());
}

TEST(GradShape, OptimizerRefusesAGradOfAnotherShape) {
  // A grad put in place behind set_grad's back (as the impl is public) must not be read past its end.
  auto p = zeros<float>({1000}).requires_grad_();
  p.impl()->grad = ones<float>({1}).impl();
  optim::SGD sgd({p}, {.lr = 0.1, .momentum = 0.9});
  EXPECT_TRUE(throws_with([&] { sgd.step(); }, {"gradient of parameter 0 has shape [1]", "[1000]"}));
  optim::Adam adam({p}, {.lr = 0.1});
  EXPECT_TRUE(throws_with([&] { adam.step(); }, {"gradient of parameter 0 has shape [1]"}));
  EXPECT_EQ(p.to_vector(), std::vector<float>(1000, 0.f));
}

// A bad gradient anywhere leaves the whole step undone: parameters before it unchanged, and
// no optimizer state advanced (Adam's step count, SGD's momentum), so the step can be retried.
TEST(GradShape, ABadGradientLeavesTheStepUndone) {
  auto a = ones<double>({3}).requires_grad_();
  auto b = ones<double>({4}).requires_grad_();
  a.set_grad(full<double>({3}, 0.5));
  optim::Adam adam({a, b}, {.lr = 0.1});
  b.impl()->grad = ones<double>({2}).impl();  // behind set_grad's back
  EXPECT_TRUE(throws_with([&] { adam.step(); }, {"gradient of parameter 1 has shape [2]"}));
  EXPECT_EQ(a.to_vector(), std::vector<double>(3, 1.0));
  EXPECT_EQ(a.version(), 0u);
  b.set_grad(full<double>({4}, 0.5));
  adam.step();  // the retried step is the first: Adam's bias correction makes it lr (up to eps)
  for (double v : a.to_vector()) EXPECT_NEAR(v, 0.9, 1e-8);
}

TEST(GradShape, BackwardRefusesToAccumulateIntoAGradOfAnotherShape) {
  auto p = zeros<float>({1000}).requires_grad_();
  p.impl()->grad = ones<float>({1}).impl();
  EXPECT_TRUE(throws_with([&] { (p * 2.0).sum().backward(); }, {"AccumulateGrad", "existing grad", "[1000]"}));
}

// ---- 2. element and byte counts ----

TEST(CheckedSizes, ElementCountOverflowIsAnError) {
  EXPECT_TRUE(throws_with([] { empty<float>({1LL << 32, 1LL << 32}); }, {"[4294967296, 4294967296]", "int64"}));
  EXPECT_TRUE(throws_with([] { zeros<float>({3, 1LL << 62}); }, {"more elements than an int64 can count"}));
  EXPECT_TRUE(throws_with([] { empty<double>({1LL << 61}); }, {"address space"}));
  EXPECT_TRUE(throws_with([] { empty<float>({2, -3}); }, {"negative size -3"}));
  EXPECT_TRUE(throws_with([] { (void)numel_of(Shape{1LL << 40, 1LL << 40}); }, {"int64"}));
  // A zero size means no elements, whatever the others are (PyTorch agrees).
  EXPECT_EQ(numel_of(Shape{0, 1LL << 62, 3}), 0);
  EXPECT_EQ(empty<float>({0, 1LL << 40}).numel(), 0);
  // ... but the product of the nonzero sizes must fit, so that partial products (outer and
  // inner extents around a dimension) cannot overflow in the kernels.
  EXPECT_TRUE(throws_with([] { empty<float>({1LL << 62, 4, 0}); }, {"strides"}));
}

TEST(CheckedSizes, ReshapeAndFlattenProductsAreChecked) {
  auto e = zeros<float>({0});
  EXPECT_TRUE(throws_with([&] { e.view({1LL << 40, 1LL << 40, -1}); }, {"reshape", "invalid"}));
  EXPECT_TRUE(throws_with([&] { e.view({1LL << 40, 1LL << 40, 1LL << 40, 0}); }, {"reshape"}));
  EXPECT_TRUE(throws_with([&] { empty<float>({1LL << 40, 1LL << 40, 1LL << 40, 0}); }, {"strides"}));
  auto a = arange<float>(0, 6);
  EXPECT_TRUE(throws_with([&] { a.view({-1, 0}); }, {"reshape"}));
  EXPECT_EQ(a.view({2, -1}).shape(), (Shape{2, 3}));
}

TEST(CheckedSizes, CatSizesAreChecked) {
  auto big = zeros<float>({0, 1LL << 62});
  EXPECT_TRUE(throws_with([&] { cat(std::vector<Tensor<float>>{big.transpose(0, 1), big.transpose(0, 1)}); },
                          {"cat", "int64"}));
}

TEST(CheckedSizes, BlasRefusesSizesBeyondItsIntInterface) {
  // CBLAS takes int sizes: a larger one must be refused before any pointer is touched.
  float c = 0;
  EXPECT_TRUE(throws_with(
      [&] {
        backend::gemm<float>(false, false, (1LL << 31) + 1, 1, 1, 1.f, nullptr, 1, nullptr, 1, 0.f, &c, 1, Device::cpu());
      },
      {"gemm", "2147483649"}));
}

// ---- 3. narrow bounds ----

TEST(Bounds, NarrowWithAHugeLengthIsAnError) {
  auto t = arange<float>(0, 5);
  EXPECT_TRUE(throws_with([&] { t.narrow(0, 1, INT64_MAX); }, {"narrow", "length 9223372036854775807", "size 5"}));
  EXPECT_TRUE(throws_with([&] { t.narrow(0, INT64_MAX, 1); }, {"narrow"}));
  EXPECT_TRUE(throws_with([&] { t.narrow(0, 6, 0); }, {"narrow"}));
  EXPECT_TRUE(throws_with([&] { t.narrow(0, INT64_MIN, 1); }, {"narrow"}));
  EXPECT_EQ(t.narrow(0, -2, 2).to_vector(), (std::vector<float>{3, 4}));
  EXPECT_EQ(t.narrow(0, 5, 0).numel(), 0);
  EXPECT_EQ(t.slice(0, 1, INT64_MAX).numel(), 4);
}

TEST(Bounds, ChunkPlanOfAHugeBatch) {
  auto plan = parallel::plan_chunks(INT64_MAX, 3);
  ASSERT_EQ(plan.used(), 3u);
  EXPECT_EQ(plan.sizes[0], INT64_MAX / 3 + 1);
  EXPECT_EQ(plan.offsets[2] + plan.sizes[2], INT64_MAX);
}

TEST(Bounds, SplitAndChunkWithHugeCounts) {
  auto t = arange<float>(0, 5);
  EXPECT_EQ(split(t, INT64_MAX).size(), 1u);
  EXPECT_EQ(chunk(t, INT64_MAX).size(), 5u);
  EXPECT_EQ(split(t, 2).size(), 3u);
  EXPECT_EQ(chunk(t, 2).size(), 2u);
}

TEST(Bounds, CopyBetweenOverlappingViews) {
  // memcpy over overlapping ranges is undefined (ASan: memcpy-param-overlap); the result must be
  // the source's values as they were before the copy.
  auto x = arange<float>(0, 6);
  x.narrow(0, 0, 5).copy_(x.narrow(0, 1, 5));
  EXPECT_EQ(x.to_vector(), (std::vector<float>{1, 2, 3, 4, 5, 5}));
  auto y = arange<float>(0, 6);
  y.narrow(0, 1, 5).copy_(y.narrow(0, 0, 5));
  EXPECT_EQ(y.to_vector(), (std::vector<float>{0, 0, 1, 2, 3, 4}));
  auto m = arange<double>(0, 9).view({3, 3});
  m.copy_(m.t());  // strided, fully overlapping
  EXPECT_EQ(m.to_vector(), (std::vector<double>{0, 3, 6, 1, 4, 7, 2, 5, 8}));
  m.copy_(m);
  EXPECT_EQ(m.to_vector(), (std::vector<double>{0, 3, 6, 1, 4, 7, 2, 5, 8}));
}

TEST(Bounds, PrintingAnEmptyTensorWithAHugeDimensionIsQuick) {
  std::ostringstream os;
  os << zeros<float>({1LL << 40, 0});
  EXPECT_EQ(os.str(), "tensor([], shape=[1099511627776, 0], dtype=float32, device=cpu:0)");
}

// ---- 4. 0-dim tensors ----

TEST(ZeroDim, DimensionIndexingIsRefused) {
  auto s = scalar_tensor<float>(3.f);
  EXPECT_TRUE(throws_with([&] { (void)s.size(0); }, {"size", "0-dim"}));
  EXPECT_TRUE(throws_with([&] { (void)s.size(-1); }, {"0-dim"}));
  EXPECT_TRUE(throws_with([&] { (void)s.stride(0); }, {"stride", "0-dim"}));
  EXPECT_TRUE(throws_with([&] { s.select(0, 0); }, {"select", "0-dim"}));
  EXPECT_TRUE(throws_with([&] { s.narrow(0, 0, 1); }, {"narrow", "0-dim"}));
  EXPECT_TRUE(throws_with([&] { s.slice(0, 0, 1); }, {"slice", "0-dim"}));
  EXPECT_TRUE(throws_with([&] { s.index_select(0, from_vector<std::int64_t>({0})); }, {"index_select", "0-dim"}));
  EXPECT_TRUE(throws_with([&] { cat(std::vector<Tensor<float>>{s, s}); }, {"cat", "0-dim"}));
  EXPECT_TRUE(throws_with([&] { chunk(s, 2); }, {"chunk", "0-dim"}));
  // What PyTorch accepts on a 0-dim tensor still works.
  EXPECT_EQ(s.squeeze(0).dim(), 0);
  EXPECT_EQ(s.squeeze(-1).item(), 3.f);
  EXPECT_EQ(s.unsqueeze(0).shape(), (Shape{1}));
  EXPECT_EQ(s.flatten().shape(), (Shape{1}));
  EXPECT_EQ(softmax(s, 0).item(), 1.f);
  // A 1-dim tensor selected down to 0-dim keeps no stale size.
  auto v = arange<float>(0, 3).select(0, 1);
  EXPECT_TRUE(throws_with([&] { (void)v.size(0); }, {"0-dim"}));
}

TEST(ZeroDim, DimsEraseChecksItsPosition) {
  Shape s;
  EXPECT_TRUE(throws_with([&] { s.erase(0); }, {"out of range"}));
  Shape t{2, 3};
  EXPECT_TRUE(throws_with([&] { t.erase(2); }, {"out of range"}));
  t.erase(0);
  EXPECT_EQ(t, (Shape{3}));
}

// ---- 5. version counters ----

TEST(VersionCounter, InPlaceWriteToASavedTensorFailsBackward) {
  auto w = full<float>({3}, 2.f).requires_grad_();
  auto x = full<float>({3}, 5.f);
  auto y = (w * x).sum();
  EXPECT_EQ(x.version(), 0u);
  x.fill_(0.f);
  EXPECT_EQ(x.version(), 1u);
  EXPECT_TRUE(throws_with([&] { y.backward(); },
                          {"modified by an inplace operation", "is at version 1; expected version 0", "MulBackward",
                           "float32 [3]"}));
  EXPECT_FALSE(w.grad().defined());
}

TEST(VersionCounter, ViewsAndDetachShareTheCounter) {
  auto w = full<double>({4}, 2.0).requires_grad_();
  auto x = full<double>({4}, 5.0);
  auto y = (w * x.narrow(0, 0, 4)).sum();
  x.detach().narrow(0, 1, 2).copy_(zeros<double>({2}));  // writes through another view
  EXPECT_TRUE(throws_with([&] { y.backward(); }, {"modified by an inplace operation"}));
  // A saved output written through detach() is caught too.
  auto z = relu(w);
  auto loss = z.sum();
  z.detach().zero_();
  EXPECT_TRUE(throws_with([&] { loss.backward(); }, {"ReluBackward", "modified by an inplace operation"}));
}

TEST(VersionCounter, OptimizerStepBetweenForwardAndBackwardIsCaught) {
  nn::Linear fc(2, 1);
  optim::SGD opt(fc->parameters(), {.lr = 0.1});
  auto loss = fc(ones<float>({4, 2})).sum();
  (fc(ones<float>({4, 2})).sum()).backward();
  opt.step();  // changes the weight that `loss` saved
  EXPECT_TRUE(throws_with([&] { loss.backward(); }, {"LinearBackward", "modified by an inplace operation"}));
}

TEST(VersionCounter, WritesAfterBackwardAndUnsavedInputsAreFine) {
  auto w = full<float>({3}, 2.f).requires_grad_();
  auto x = full<float>({3}, 5.f);
  auto y = (w + x).sum();  // add saves nothing: x may change
  x.fill_(1.f);
  y.backward();
  EXPECT_EQ(w.grad().to_vector(), std::vector<float>(3, 1.f));
  auto y2 = (w * x).sum();
  y2.backward(Tensor<float>(), /*retain_graph=*/true);
  x.fill_(7.f);  // after backward: fine, but a retained second backward now fails
  EXPECT_TRUE(throws_with([&] { y2.backward(); }, {"modified by an inplace operation"}));
}

// ---- 6. NaN propagation, as PyTorch (values checked against LibTorch 1.13) ----

template <class T>
class NanPropagation : public ::testing::Test {};
TYPED_TEST_SUITE(NanPropagation, chorus::testing::FloatTypes);

TYPED_TEST(NanPropagation, ActivationsPropagateNaN) {
  using T = TypeParam;
  const T nan = std::numeric_limits<T>::quiet_NaN(), inf = std::numeric_limits<T>::infinity();
  auto x = from_vector<T>({nan, T(-1), T(2), T(-0.0), inf, -inf}).requires_grad_();
  auto r = relu(x).to_vector();
  EXPECT_TRUE(is_nan(r[0]));
  EXPECT_EQ(r[1], T(0));
  EXPECT_EQ(r[2], T(2));
  EXPECT_EQ(r[4], inf);
  EXPECT_EQ(r[5], T(0));
  // torch: relu's backward passes the gradient where the output is NaN (threshold_backward).
  relu(x).backward(ones<T>({6}));
  EXPECT_EQ(x.grad().to_vector(), (std::vector<T>{1, 0, 1, 0, 1, 0}));
  EXPECT_TRUE(is_nan(gelu(x).to_vector()[0]));
  EXPECT_TRUE(is_nan(chorus::tanh(x).to_vector()[0]));
  EXPECT_TRUE(is_nan(sigmoid(x).to_vector()[0]));
}

TYPED_TEST(NanPropagation, SoftmaxAndLossesPropagateNaN) {
  using T = TypeParam;
  const T nan = std::numeric_limits<T>::quiet_NaN();
  // NaN anywhere in the row (first, middle, last) makes the whole row NaN, as in torch.
  for (int at = 0; at < 3; ++at) {
    std::vector<T> v = {T(1), T(-1), T(2)};
    v[at] = nan;
    auto x = from_vector<T>(v, Shape{1, 3});
    for (auto y : softmax(x, 1).to_vector()) EXPECT_TRUE(is_nan(y)) << at;
    for (auto y : log_softmax(x, 1).to_vector()) EXPECT_TRUE(is_nan(y)) << at;
    EXPECT_TRUE(is_nan(nn::functional::cross_entropy(x, from_vector<std::int64_t>({2})).item())) << at;
    EXPECT_TRUE(is_nan(nn::functional::mse_loss(x, zeros<T>({1, 3})).item())) << at;
    EXPECT_TRUE(is_nan(sum(x).item())) << at;
  }
}

TYPED_TEST(NanPropagation, AmsgradMaxKeepsNaN) {
  using T = TypeParam;
  auto p = zeros<T>({2}).requires_grad_();
  optim::Adam opt({p}, {.lr = 0.1, .amsgrad = true});
  p.set_grad(from_vector<T>({std::numeric_limits<T>::quiet_NaN(), T(1)}));
  opt.step();
  auto vmax = opt.state()[0].at("max_exp_avg_sq").template as<T>().to_vector();
  EXPECT_TRUE(is_nan(vmax[0]));  // torch.maximum keeps the NaN; std::max dropped it
  EXPECT_FALSE(is_nan(vmax[1]));
}

TEST(CheckedSizes, FloatToIntegerConversionSaturates) {
  // static_cast of NaN or 1e30 to int64 is undefined (UBSan reports it): saturate, as CUDA does.
  const double inf = std::numeric_limits<double>::infinity();
  auto v = from_vector<double>({std::nan(""), 1e30, -1e30, inf, -inf, 2.7, -2.7}).to<std::int64_t>().to_vector();
  EXPECT_EQ(v, (std::vector<std::int64_t>{0, INT64_MAX, INT64_MIN, INT64_MAX, INT64_MIN, 2, -2}));
}

TEST(CheckedSizes, RandintOverTheWholeInt64Range) {
  auto r = randint(INT64_MIN, INT64_MAX, {64}).to_vector();  // high - low overflowed int64
  bool negative = false, positive = false;
  for (auto v : r) {
    negative |= v < 0;
    positive |= v > 0;
    EXPECT_LT(v, INT64_MAX);
  }
  EXPECT_TRUE(negative && positive);
  for (auto v : randint(-3, 2, {100}).to_vector()) EXPECT_TRUE(v >= -3 && v < 2);
}

// ---- 7. arange ----

TEST(Arange, HugeOrNonFiniteBoundsAreErrors) {
  EXPECT_TRUE(throws_with([] { arange<float>(0, 1e30); }, {"arange", "more than a tensor can hold"}));
  EXPECT_TRUE(throws_with([] { arange<float>(0, std::numeric_limits<double>::infinity()); }, {"arange", "finite"}));
  EXPECT_TRUE(throws_with([] { arange<float>(0, std::numeric_limits<double>::quiet_NaN()); }, {"arange", "finite"}));
  EXPECT_TRUE(throws_with([] { arange<float>(0, 10, std::numeric_limits<double>::infinity()); }, {"finite"}));
  EXPECT_TRUE(throws_with([] { arange<double>(0, 2e18); }, {"address space"}));
  EXPECT_TRUE(throws_with([] { arange<std::int64_t>(1e19, 1e19 + 1e5, 1e4); }, {"int64"}));
  EXPECT_EQ(arange<float>(0, 3).to_vector(), (std::vector<float>{0, 1, 2}));
  EXPECT_EQ(arange<std::int64_t>(5, 0, -2).to_vector(), (std::vector<std::int64_t>{5, 3, 1}));
}

// ---- 8. DataLoader ----

TEST(DataLoaderBatch, HugeBatchSizeGivesOneBatch) {
  data::TensorDataset<float, float> ds(arange<float>(0, 10).view({10, 1}), zeros<float>({10}));
  data::DataLoaderOptions o;
  using B = decltype(o.batch_size);  // std::size_t or int64: the largest value of either
  for (B b : {std::numeric_limits<B>::max(), static_cast<B>(std::numeric_limits<B>::max() - 1), B(11), B(10)}) {
    o.batch_size = b;
    for (bool drop : {false, true}) {
      o.drop_last = drop;
      data::DataLoader loader(ds, o);
      const std::size_t expect = drop && b > 10 ? 0 : 1;
      EXPECT_EQ(loader.num_batches(), expect) << b;
      std::size_t n = 0;
      for (auto batch : loader) {
        EXPECT_EQ(batch.data.shape(), (Shape{10, 1}));
        ++n;
      }
      EXPECT_EQ(n, expect) << b;
    }
  }
  o.batch_size = 3;
  o.drop_last = false;
  data::DataLoader loader(ds, o);
  std::vector<std::int64_t> sizes;
  for (auto batch : loader) sizes.push_back(batch.data.size(0));
  EXPECT_EQ(sizes, (std::vector<std::int64_t>{3, 3, 3, 1}));
}

// ---- 13. only chorus::Error leaves the library ----

namespace {
struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("chorus_safety_" + std::to_string(::getpid()) + "_" +
                                        std::to_string(reinterpret_cast<std::uintptr_t>(this)));
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

void write_bytes(const std::string& path, const std::string& b) {
  std::ofstream out(path, std::ios::binary);
  out.write(b.data(), static_cast<std::streamsize>(b.size()));
}

struct Fc : nn::Module {
  nn::Linear fc;
  Fc() : fc(register_module("fc", nn::Linear(3, 2))) {}
  Tensor<float> forward(const Tensor<float>& x) { return fc(x); }
};

/// A node whose backward throws a std exception (as a user's node, or an allocation, may).
template <class T>
struct ThrowingBackward final : autograd::Node<T> {
  std::string name() const override { return "ThrowingBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&&) override {
    throw std::out_of_range("vector index 7 past the end");
  }
};

template <class T>
Tensor<T> throwing_op(const Tensor<T>& x, Stream* stream = nullptr) {
  auto out = x.detach().clone();
  auto node = autograd::make_node<ThrowingBackward<T>, T>({&x});
  if (stream) node->set_stream(stream);
  autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  return out;
}
}  // namespace

TEST(ErrorBoundary, LoadingADirectoryIsAChorusError) {
  TempDir dir;
  Fc m;
  EXPECT_TRUE(throws_with([&] { load(m, dir.path.string()); }, {"is a directory", dir.path.string().c_str()}));
  EXPECT_TRUE(throws_with([&] { (void)io::read(dir.path.string()); }, {"is a directory"}));
  optim::SGD opt(m.parameters(), {});
  EXPECT_TRUE(throws_with([&] { load(opt, dir.path.string()); }, {"is a directory"}));
  EXPECT_TRUE(throws_with([&] { load(m, dir.file("absent")); }, {"cannot open", "No such file"}));
}

TEST(ErrorBoundary, OptimizerFileWithAHugeIndexIsAChorusError) {
  TempDir dir;
  Fc m;
  optim::SGD opt(m.parameters(), {.lr = 0.1, .momentum = 0.9});
  // A valid optimizer file whose tensor name carries a 23-digit parameter index.
  nn::Module::NamedTensor t{"12345678901234567890123.momentum_buffer", AnyTensor(zeros<float>({2, 3}))};
  io::Metadata meta{{"format", "chorus.optimizer"}, {"optimizer", "SGD"}, {"parameters", "2"}};
  io::detail::write_atomically(dir.file("opt.safetensors"), io::detail::serialise({t}, meta));
  EXPECT_TRUE(throws_with([&] { load(opt, dir.file("opt.safetensors")); },
                          {"names parameter 12345678901234567890123", "optimizer has 2"}));
  t.name = "2.momentum_buffer";  // one past the end
  io::detail::write_atomically(dir.file("opt.safetensors"), io::detail::serialise({t}, meta));
  EXPECT_TRUE(throws_with([&] { load(opt, dir.file("opt.safetensors")); }, {"names parameter 2"}));
}

TEST(ErrorBoundary, StdExceptionInABackwardNodeNamesNodeAndDevice) {
  auto x = ones<float>({3}).requires_grad_();
  EXPECT_TRUE(throws_with([&] { throwing_op(x).sum().backward(); },
                          {"in backward of ThrowingBackward on cpu:0", "vector index 7 past the end"}));
  // The same when the node runs on another device's worker thread (as a replica's does).
  set_cpu_device_count(2);
  auto y = ones<float>({3}, Device::cpu(1)).requires_grad_();
  Tensor<float> out;
  {
    StreamGuard g(get_stream(Device::cpu(1)));
    out = throwing_op(y, &get_stream(Device::cpu(1)));
  }
  EXPECT_TRUE(throws_with([&] { out.to(Device::cpu(0)).sum().backward(); },
                          {"in backward of ThrowingBackward on cpu:1", "vector index 7"}));
}

namespace {
/// A node whose backward returns a gradient of the wrong shape.
template <class T>
struct WrongShapeBackward final : autograd::Node<T> {
  std::string name() const override { return "WrongShapeBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&&) override {
    return {ones<T>({1})};
  }
};
}  // namespace

TEST(GradShape, ANodeReturningAGradientOfAnotherShapeIsRefused) {
  auto x = ones<float>({1000}).requires_grad_();
  auto a = x * 2.0;  // a non-leaf: the bad gradient is summed with another before reaching x
  auto out = a.detach().clone();
  auto node = autograd::make_node<WrongShapeBackward<float>, float>({&a});
  autograd::set_history(out, std::shared_ptr<autograd::Node<float>>(node));
  EXPECT_TRUE(throws_with([&] { (out.sum() + a.sum()).backward(); },
                          {"WrongShapeBackward returned a float32 gradient of shape [1]", "expected float32 of shape [1000]"}));
}

namespace {
/// A node between dtypes (Note [one graph over every dtype]) that hands on the wrong one.
struct WrongDtypeBackward final : autograd::Node<float> {
  std::string name() const override { return "WrongDtypeBackward"; }
  TensorList apply(TensorList&& g) override { return {std::move(g[0])}; }
  std::vector<AnyTensor> apply_any(std::vector<std::vector<AnyTensor>>&& arrived) override {
    (void)arrived;
    return {AnyTensor(ones<bfloat16>({4}))};  // its input is float64
  }
};
}  // namespace

TEST(GradShape, ANodeReturningAGradientOfAnotherDtypeIsRefused) {
  auto x = ones<double>({4}).requires_grad_();
  auto out = zeros<float>({4});
  auto node = autograd::make_node<WrongDtypeBackward, double>({&x});
  autograd::set_history(out, node);
  EXPECT_TRUE(throws_with([&] { out.sum().backward(); },
                          {"WrongDtypeBackward returned a bfloat16 gradient", "expected float64 of shape [4]"}));
  // set_history refuses a node of another dtype than the output's.
  auto other = zeros<double>({4});
  EXPECT_TRUE(throws_with([&] { autograd::set_history(other, node); }, {"takes float32 gradients", "float64 output"}));
}

namespace {
struct ThrowsOnSecondReplica : nn::Module {
  nn::Linear fc;
  ThrowsOnSecondReplica() : fc(register_module("fc", nn::Linear(3, 2))) {}
  Tensor<float> forward(const Tensor<float>& x) {
    auto y = fc(x);
    return x.device() == Device::cpu(1) ? throwing_op(y) : y;
  }
};
}  // namespace

TEST(ErrorBoundary, BackwardErrorsNameTheReplicaAsForwardsDo) {
  set_cpu_device_count(2);
  DataParallel<ThrowsOnSecondReplica> dp(ThrowsOnSecondReplica(), {Device::cpu(0), Device::cpu(1)});
  auto loss = dp(ones<float>({4, 3})).sum();
  EXPECT_TRUE(throws_with([&] { loss.backward(); },
                          {"in backward of ThrowingBackward in replica 1 on cpu:1", "vector index 7 past the end"}));
}

TEST(ErrorBoundary, SavingANonUtf8NameIsAChorusError) {
  TempDir dir;
  nn::Module::NamedTensor t{std::string("bad\xff"), AnyTensor(zeros<float>({1}))};
  EXPECT_TRUE(throws_with([&] { io::detail::serialise({t}, {}); }, {"cannot write the header"}));
}

// ---- 14. the safetensors header is checked before the file is read ----

TEST(SafetensorsRead, ALargeNonCheckpointIsRefusedAfterEightBytes) {
  TempDir dir;
  // 64 MiB of text: the first 8 bytes, read as the header length, are far beyond the limit.
  {
    std::ofstream out(dir.file("big.txt"), std::ios::binary);
    std::string line(1 << 20, 'x');
    for (int i = 0; i < 64; ++i) out << line;
  }
  Fc m;
  const auto before = m.fc->weight.to_vector();
  EXPECT_TRUE(throws_with([&] { load(m, dir.file("big.txt")); }, {"header length", "100 MiB", "big.txt"}));
  EXPECT_EQ(m.fc->weight.to_vector(), before);
  // A file no longer than its length field is refused as truncated.
  write_bytes(dir.file("short"), "abc");
  EXPECT_TRUE(throws_with([&] { load(m, dir.file("short")); }, {"truncated", "3 bytes"}));
}

TEST(SafetensorsRead, TensorsAreReadFromTheOpenFileIntoTheirStorage) {
  TempDir dir;
  manual_seed(1);
  Fc a;
  save(a, dir.file("a.safetensors"));
  auto f = io::read(dir.file("a.safetensors"));
  EXPECT_TRUE(f.bytes.empty());  // only the header was read
  ASSERT_TRUE(f.file != nullptr);
  manual_seed(2);
  Fc b;
  const float* storage = b.fc->weight.data();
  const auto v0 = b.fc->weight.version();
  io::load_into(b, f);
  EXPECT_EQ(b.fc->weight.data(), storage);  // written in place
  EXPECT_EQ(b.fc->weight.to_vector(), a.fc->weight.to_vector());
  EXPECT_EQ(b.fc->bias.to_vector(), a.fc->bias.to_vector());
  EXPECT_GT(b.fc->weight.version(), v0);  // a load is an in-place write (Note [version counter])
  // The file shrinking after validation is reported, not read past.
  fs::resize_file(dir.file("a.safetensors"), f.data_start + 4);
  EXPECT_TRUE(throws_with([&] { io::load_into(b, f); }, {"ended early", "partly loaded"}));
}

TEST(SafetensorsRead, MinorMessagesNameTheFileAndTheOverflow) {
  TempDir dir;
  Fc m;
  auto put = [&](const std::string& header, std::size_t data) {
    std::string s(8, '\0');
    const std::uint64_t n = header.size();
    std::memcpy(s.data(), &n, 8);
    write_bytes(dir.file("f.safetensors"), s + header + std::string(data, '\0'));
  };
  put(R"({"w":{"dtype":"I16","shape":[2],"data_offsets":[0,4]}})", 4);  // BF16 and F16 are read now
  EXPECT_TRUE(throws_with([&] { load(m, dir.file("f.safetensors")); }, {"f.safetensors", "I16"}));
  put(R"({"w":{"dtype":"F32","shape":[281474976710656,281474976710656],"data_offsets":[0,4]}})", 4);
  auto overflow = throws_with([&] { load(m, dir.file("f.safetensors")); }, {"overflows", "span 4 bytes"});
  EXPECT_TRUE(overflow);
  EXPECT_FALSE(throws_with([&] { load(m, dir.file("f.safetensors")); }, {"(0 bytes)"}));
}

// ---- 15. missing keys name both sides and a common prefix ----

TEST(SafetensorsNames, PyTorchDataParallelPrefixIsNamedAndCanBeStripped) {
  TempDir dir;
  manual_seed(3);
  Fc a;
  // What PyTorch's nn.DataParallel(model).state_dict() holds: every name under "module.".
  std::vector<nn::Module::NamedTensor> named;
  for (auto& t : a.named_tensors()) named.push_back({"module." + t.name, t.tensor});
  io::detail::write_atomically(dir.file("dp.safetensors"), io::detail::serialise(named, {}));
  manual_seed(4);
  Fc b;
  const auto before = b.fc->weight.to_vector();
  EXPECT_TRUE(throws_with([&] { load(b, dir.file("dp.safetensors")); },
                          {"the file lacks 2 tensor(s) of the module: 'fc.weight', 'fc.bias'",
                           "the file has 2 tensor(s) the module lacks: 'module.fc.bias', 'module.fc.weight'",
                           "prefixed with 'module.'", "nn.DataParallel", "strip_prefix = \"module.\""}));
  EXPECT_EQ(b.fc->weight.to_vector(), before);
  load(b, dir.file("dp.safetensors"), io::LoadOptions{.strip_prefix = "module."});
  EXPECT_EQ(b.fc->weight.to_vector(), a.fc->weight.to_vector());
  // A prefix that only some names carry is stripped from those (consume_prefix semantics).
  named[1].name = "fc.bias";
  io::detail::write_atomically(dir.file("mixed.safetensors"), io::detail::serialise(named, {}));
  load(b, dir.file("mixed.safetensors"), io::LoadOptions{.strip_prefix = "module."});
  // Both a prefixed and a bare copy of one name is ambiguous.
  named.push_back({"module.fc.bias", named[1].tensor});
  io::detail::write_atomically(dir.file("dup.safetensors"), io::detail::serialise(named, {}));
  EXPECT_TRUE(throws_with([&] { load(b, dir.file("dup.safetensors"), io::LoadOptions{.strip_prefix = "module."}); },
                          {"both load into 'fc.bias'"}));
}

TEST(SafetensorsNames, BothSidesAreNamedWithoutAPrefix) {
  TempDir dir;
  Fc a;
  std::vector<nn::Module::NamedTensor> named = {{"fc.weight", a.fc->weight}, {"head.bias", a.fc->bias}};
  io::detail::write_atomically(dir.file("x.safetensors"), io::detail::serialise(named, {}));
  EXPECT_TRUE(throws_with([&] { load(a, dir.file("x.safetensors")); },
                          {"the file lacks 1 tensor(s) of the module: 'fc.bias'",
                           "the file has 1 tensor(s) the module lacks: 'head.bias'"}));
  // The module is a level deeper than the file: say so.
  struct Outer : nn::Module {
    nn::Linear body;
    Outer() : body(register_module("body", nn::Linear(3, 2))) {}
  } outer;
  save(nn::Linear(3, 2), dir.file("bare.safetensors"));  // names "weight" and "bias"
  EXPECT_TRUE(throws_with([&] { load(outer, dir.file("bare.safetensors")); }, {"prefixed with 'body.'", "submodule"}));
  load(outer.body, dir.file("bare.safetensors"));
}

// ---- 16. minor ----

TEST(Minor, OptimizersRefuseAnEmptyParameterList) {
  EXPECT_TRUE(throws_with([] { optim::SGD opt(std::vector<AnyTensor>{}, {}); }, {"empty parameter list"}));
  EXPECT_TRUE(throws_with([] { optim::Adam opt(std::vector<AnyTensor>{}, {}); }, {"empty parameter list"}));
}

TEST(Minor, ADeviceBeyondAReducedCountIsRefused) {
  set_cpu_device_count(4);
  auto t = zeros<float>({2}, Device::cpu(3));  // cpu:3's allocator and stream now exist
  (void)get_stream(Device::cpu(3));
  set_cpu_device_count(2);
  EXPECT_TRUE(throws_with([] { zeros<float>({2}, Device::cpu(3)); }, {"cpu:3 is not available", "2 virtual CPU"}));
  EXPECT_TRUE(throws_with([] { (void)get_stream(Device::cpu(3)); }, {"cpu:3 is not available"}));
  EXPECT_EQ(t.to_vector(), (std::vector<float>{0, 0}));  // existing tensors stay usable
}

// ---- 17. window geometry (issue 16) ----

TEST(CheckedSizes, ConvolutionWindowGeometryIsChecked) {
  // Note [checked window geometry]: in + 2p - d(k-1) - 1 was computed unchecked.
  constexpr std::int64_t kHuge = std::int64_t(1) << 62;
  auto x = ones<double>({1, 1, 8, 8});
  // Dilation 2^62 with a 5-tap kernel: d(k-1) wrapped to 0 and the convolution was accepted.
  EXPECT_TRUE(throws_with([&] { conv2d(x, ones<double>({1, 1, 1, 5}), {}, 1, 0, {1, kHuge}); },
                          {"conv2d", "width window geometry overflows int64", "dilation 4611686018427387904"}));
  EXPECT_TRUE(throws_with([&] { conv2d(x, ones<double>({1, 1, 5, 1}), {}, 1, 0, {kHuge, 1}); },
                          {"conv2d", "height window geometry overflows int64"}));
  // Padding 2^62: 2p overflowed (undefined), then a misleading "smaller than the kernel".
  EXPECT_TRUE(throws_with([&] { conv2d(x, ones<double>({1, 1, 3, 3}), {}, 1, {kHuge, 0}); },
                          {"conv2d", "height window geometry overflows int64", "padding 4611686018427387904"}));
  EXPECT_TRUE(throws_with([&] { nn::Conv2d(1, 1, 3, {.padding = kHuge})(x.to<float>()); }, {"overflows int64"}));
  // A huge groups wrapped weight.shape()[1] * groups to the channel count (here 4 * 2^62 = 0).
  EXPECT_TRUE(throws_with([] { conv2d(ones<double>({1, 0, 3, 3}), zeros<double>({0, 4, 1, 1}), {}, 1, 0, 1, kHuge); },
                          {"conv2d", "groups=4611686018427387904", "more than int64 holds"}));
  // The column matrix's C*kh*kw rows overflowed (the weight only bounds C/groups*kh*kw).
  const std::int64_t c = std::int64_t(1) << 32, k = std::int64_t(1) << 16;
  EXPECT_TRUE(throws_with([&] { conv2d(zeros<double>({0, c, 1, 1}), zeros<double>({0, 1, k, k}), {}, 1, k / 2, 1, c); },
                          {"conv2d", "channels times kernel", "more elements than an int64"}));
}

TEST(CheckedSizes, PoolingWindowGeometryIsChecked) {
  constexpr std::int64_t kHuge = std::int64_t(1) << 62;
  auto x = ones<double>({1, 1, 4, 4});
  // Dilation 2^62 with 5 taps was accepted as if it were 1 (d(k-1) wrapped to 0).
  EXPECT_TRUE(throws_with([&] { max_pool2d(x, {1, 5}, 1, 0, {1, kHuge}); }, {"max_pool2d", "width window geometry"}));
  EXPECT_TRUE(throws_with([&] { nn::MaxPool2d({1, 5}, {.stride = 1, .dilation = {1, kHuge}})(x); },
                          {"max_pool2d", "overflows int64"}));
  // A kernel of 2^32 x 2^32: the average's divisor (the window's area) wrapped to 0 and gave inf.
  const std::int64_t k = std::int64_t(1) << 32;
  EXPECT_TRUE(throws_with([] { avg_pool2d(ones<double>({1, 1, 1, 1}), k, std::nullopt, k / 2); },
                          {"avg_pool2d", "kernel [4294967296, 4294967296]", "more elements than an int64"}));
  // Kernel and padding near 2^62: in + 2p + d(k-1) + s no longer fits.
  EXPECT_TRUE(throws_with([&] { max_pool2d(x, {1, kHuge}, std::nullopt, {0, kHuge / 2}, 1, true); },
                          {"max_pool2d", "width window geometry overflows int64"}));
}
