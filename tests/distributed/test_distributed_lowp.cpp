// 16-bit gradients across processes (issue 19): the MPI backend's 16-bit sums, DDP over a
// bfloat16 model, and DDP's compression hooks (PyTorch's fp16_compress_hook and
// bf16_compress_hook). Part of the test_distributed binary (mpirun -np 1 … 4).
#include "dist_test_util.hpp"

#include <cmath>
#include <vector>

using namespace chorus;
using namespace dist_test;

namespace {

/// Largest |v| of a list of lists.
template <class T>
double largest(const std::vector<std::vector<T>>& v) {
  double m = 0;
  for (const auto& p : v)
    for (auto x : p) m = std::max(m, std::abs(static_cast<double>(x)));
  return m;
}

/// The gradients of a plain (non-DDP) copy of `model` on this rank's batch.
template <class T>
std::vector<std::vector<T>> local_grads(Mlp<T>& model, const Tensor<T>& x, const Tensor<float>& y) {
  model.zero_grad();
  nn::functional::mse_loss(model.forward(x).template to<float>(), y).backward();
  std::vector<std::vector<T>> out;
  for (const auto& p : model.parameters()) out.push_back(p.template as<T>().grad().to_vector());
  return out;
}

}  // namespace

// A 16-bit sum moves the values as raw 16 bits and adds them in float at each step of MPI's
// reduction, rounding once per step (as NCCL's 16-bit sums do): with two ranks, one rounding.
TEST(ProcessGroup, AllReduceOf16BitTensorsAddsInFloatAndRoundsPerStep) {
  const int w = pg().world_size(), r = pg().rank();
  std::vector<float> mine;
  for (int k = 0; k < 40; ++k) mine.push_back(0.1f * static_cast<float>(r + 1) + 0.013f * static_cast<float>(k));
  std::vector<bfloat16> bf;
  std::vector<half> hf;
  for (float v : mine) {
    bf.push_back(bfloat16(v));
    hf.push_back(half(v));
  }
  auto tb = from_vector(bf);
  auto th = from_vector(hf);
  pg().all_reduce(tb);
  pg().all_reduce(th, dist::ReduceOp::Avg);
  const auto all_b = gather_all(bf);
  const auto all_h = gather_all(hf);
  const auto gb = tb.to_vector();
  const auto gh = th.to_vector();
  for (std::size_t k = 0; k < mine.size(); ++k) {
    double sb = 0, sh = 0;
    for (int q = 0; q < w; ++q) {
      sb += static_cast<double>(all_b[q][k]);
      sh += static_cast<double>(all_h[q][k]);
    }
    if (w <= 2) {  // one addition: the float sum rounded once
      float fb = 0, fh = 0;
      for (int q = 0; q < w; ++q) {
        fb += static_cast<float>(all_b[q][k]);
        fh += static_cast<float>(all_h[q][k]);
      }
      EXPECT_EQ(gb[k].bits(), bfloat16(fb).bits()) << k;
      EXPECT_EQ(gh[k].bits(), (half(fh) / half(static_cast<float>(w))).bits()) << k;
    }
    EXPECT_NEAR(static_cast<double>(gb[k]), sb, w * 0x1p-8 * std::abs(sb)) << k;
    EXPECT_NEAR(static_cast<double>(gh[k]), sh / w, w * 0x1p-11 * std::abs(sh)) << k;
  }
}

// DDP over a bfloat16 model: the all-reduce averages the 16-bit gradients (the result every
// rank holds is the same bits).
TEST(Ddp, Bf16ModelGradientsAreAveraged) {
  const int w = pg().world_size(), r = pg().rank();
  manual_seed(4);
  Mlp<bfloat16> plain(5, 16, 3);
  manual_seed(4);
  DistributedDataParallel<Mlp<bfloat16>> ddp(Mlp<bfloat16>(5, 16, 3));
  manual_seed(60 + r);
  auto x = randn<bfloat16>({6, 5});
  auto y = randn<float>({6, 3});
  const auto mine = local_grads(plain, x, y);
  nn::functional::mse_loss(ddp(x).to<float>(), y).backward();
  const auto got = values<bfloat16>([&] {
    std::vector<AnyTensor> g;
    for (const auto& p : ddp.parameters()) g.push_back(p.grad());
    return g;
  }());
  for (std::size_t i = 0; i < got.size(); ++i) {
    const auto every = gather_all(mine[i]);
    const double scale = largest(every);
    const auto ranks = gather_all(got[i]);
    for (std::size_t k = 0; k < got[i].size(); ++k) {
      double mean = 0;
      for (int q = 0; q < w; ++q) mean += static_cast<double>(every[q][k]) / w;
      ASSERT_NEAR(static_cast<double>(got[i][k]), mean, (w + 1) * 0x1p-8 * scale) << "parameter " << i << " [" << k << "]";
      for (int q = 0; q < w; ++q) ASSERT_EQ(ranks[q][k].bits(), got[i][k].bits());
    }
  }
}

// A model with parameters of three dtypes (bfloat16 and double layers, a float scale): one
// Finalize node per dtype (Note [DDP graph nodes]), the step finalized once, after the last;
// every gradient is the average of the ranks' (exact for double, within rounding for bfloat16).
namespace {
struct Mixed : nn::Module {
  nn::LinearT<bfloat16> low;
  nn::LinearT<double> high;
  Tensor<float> scale;
  Mixed()
      : low(register_module("low", nn::LinearT<bfloat16>(4, 3))),
        high(register_module("high", nn::LinearT<double>(3, 2))),
        scale(register_parameter("scale", full<float>({1}, 1.5f))) {}
  Tensor<double> forward(const Tensor<bfloat16>& x) {
    return high(low(x).to<double>()) * scale.to<double>();
  }
};
}  // namespace

TEST(Ddp, ParametersOfSeveralDtypesAreReducedInOneStep) {
  const int w = pg().world_size(), r = pg().rank();
  manual_seed(8);
  Mixed plain;
  manual_seed(8);
  DistributedDataParallel<Mixed> ddp{Mixed()};
  for (int step = 0; step < 2; ++step) {
    manual_seed(static_cast<std::uint64_t>(80 + 10 * r + step));
    auto x = randn<bfloat16>({5, 4});
    auto y = randn<double>({5, 2});
    plain.zero_grad();
    nn::functional::mse_loss(plain.forward(x), y).backward();
    ddp.zero_grad();
    nn::functional::mse_loss(ddp(x), y).backward();
    auto pp = plain.parameters(), dp = ddp.parameters();
    ASSERT_EQ(pp.size(), 5u);
    for (std::size_t i = 0; i < pp.size(); ++i) {
      pp[i].visit([&](const auto& p) {
        using T = typename std::decay_t<decltype(p)>::value_type;
        std::vector<double> mine, got;
        for (auto v : p.grad().to_vector()) mine.push_back(static_cast<double>(v));
        for (auto v : dp[i].template as<T>().grad().to_vector()) got.push_back(static_cast<double>(v));
        const auto every = gather_all(mine);
        for (std::size_t k = 0; k < got.size(); ++k) {
          double mean = 0, big = 0;
          for (int q = 0; q < w; ++q) {
            mean += every[q][k] / w;
            big = std::max(big, std::abs(every[q][k]));
          }
          const double tol = std::is_same_v<T, double> ? 1e-12 * (1 + big) : (w + 1) * 0x1p-7 * (1 + big);
          ASSERT_NEAR(got[k], mean, tol) << "parameter " << i << " [" << k << "] step " << step;
        }
      });
    }
  }
}

// PyTorch's fp16_compress_hook / bf16_compress_hook: each float32 bucket is converted to 16
// bits, divided by the world size (in 16 bits), summed across the ranks and converted back into
// the bucket. The reference applies the same steps to every rank's local gradients.
template <class Wire>
void check_compress_hook(dist::CommHook hook) {
  const int w = pg().world_size(), r = pg().rank();
  manual_seed(8);
  Mlp<float> plain(5, 16, 3);
  manual_seed(8);
  DistributedDataParallel<Mlp<float>> ddp(Mlp<float>(5, 16, 3));
  ddp.register_comm_hook(hook);
  manual_seed(70 + r);
  auto x = randn<float>({6, 5});
  auto y = randn<float>({6, 3});
  const auto mine = local_grads(plain, x, y);
  nn::functional::mse_loss(ddp(x), y).backward();
  bool compressed_visible = false;
  const auto params = ddp.parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto got = params[i].as<float>().grad().to_vector();
    const auto every = gather_all(mine[i]);
    const double scale = largest(every);
    for (std::size_t k = 0; k < got.size(); ++k) {
      Wire acc(0.0f);
      double exact = 0;
      for (int q = 0; q < w; ++q) {
        acc = Wire(static_cast<float>(acc) + static_cast<float>(Wire(every[q][k]) / Wire(static_cast<float>(w))));
        exact += every[q][k] / w;
      }
      if (w <= 2) {
        ASSERT_EQ(got[k], static_cast<float>(acc)) << "parameter " << i << " [" << k << "]";
      }
      const double tol = (w + 1) * std::ldexp(1.0, 1 - std::numeric_limits<Wire>::digits) * scale;
      ASSERT_NEAR(got[k], exact, tol) << "parameter " << i << " [" << k << "]";
      compressed_visible |= static_cast<double>(got[k]) != static_cast<double>(static_cast<float>(exact));
    }
  }
  EXPECT_TRUE(compressed_visible);  // the 16-bit wire's roundings show
  // Once only, and before the first backward (PyTorch's rule).
  EXPECT_TRUE(throws_with([&] { ddp.register_comm_hook(dist::CommHook::allreduce); }, {"register_comm_hook"}));
}

TEST(Ddp, Fp16CompressHookFollowsPyTorch) { check_compress_hook<half>(dist::CommHook::fp16_compress); }
TEST(Ddp, Bf16CompressHookFollowsPyTorch) { check_compress_hook<bfloat16>(dist::CommHook::bf16_compress); }

// The allreduce hook is the default: the same bits as no hook.
TEST(Ddp, AllreduceHookIsTheDefaultReduction) {
  const int r = pg().rank();
  manual_seed(9);
  DistributedDataParallel<Mlp<float>> a(Mlp<float>(5, 16, 3));
  manual_seed(9);
  DistributedDataParallel<Mlp<float>> b(Mlp<float>(5, 16, 3));
  b.register_comm_hook(dist::CommHook::allreduce);
  manual_seed(80 + r);
  auto x = randn<float>({6, 5});
  nn::functional::mse_loss(a(x), x.narrow(1, 0, 3)).backward();
  nn::functional::mse_loss(b(x), x.narrow(1, 0, 3)).backward();
  const auto pa = a.parameters(), pb = b.parameters();
  for (std::size_t i = 0; i < pa.size(); ++i)
    EXPECT_EQ(pa[i].as<float>().grad().to_vector(), pb[i].as<float>().grad().to_vector()) << i;
}
