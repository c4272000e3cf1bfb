// Tied parameters (Note [tied parameters] in nn/module.hpp): `head->weight = emb->weight` ties
// as PyTorch's `lm_head.weight = tok_emb.weight` does, wherever parameters are walked: the
// registry, gradients, optimizers, clipping, master weights, copies, DataParallel (replicas,
// flat buffers, the sharded optimizer) and checkpoints.
#include <filesystem>
#include <unistd.h>

#include "data_parallel_util.hpp"

using namespace chorus;
using chorus::testing::all_close;
using chorus::testing::cpus;
using chorus::testing::throws_with;

namespace {

// A language-model head tied to its token embedding (GPT-2's lm_head).
template <class T>
struct TiedLMImpl : nn::Module {
  nn::EmbeddingT<T> emb{nullptr};
  nn::LinearT<T> mid{nullptr}, head{nullptr};
  explicit TiedLMImpl(bool tie = true) {
    emb = register_module("emb", nn::EmbeddingT<T>(7, 4));
    mid = register_module("mid", nn::LinearT<T>(4, 4));
    head = register_module("head", nn::LinearT<T>(4, 7));
    if (tie) head->weight = emb->weight;
  }
  Tensor<T> forward(const Tensor<std::int64_t>& ids) { return head(chorus::tanh(mid(emb(ids)))); }
};
template <class T>
class TiedLM : public nn::ModuleHolder<TiedLMImpl<T>> {
 public:
  using nn::ModuleHolder<TiedLMImpl<T>>::ModuleHolder;
};

Tensor<std::int64_t> batch_ids() { return from_vector(std::vector<std::int64_t>{0, 3, 6, 2, 2, 5, 1, 4, 0}); }

template <class T>
Tensor<T> loss_of(const Tensor<T>& out) {
  return (out * out).mean();
}

std::vector<std::string> names_of(const std::vector<nn::Module::NamedTensor>& named) {
  std::vector<std::string> out;
  for (const auto& t : named) out.push_back(t.name);
  return out;
}

TEST(TiedParameters, AssignmentTiesTheRegistry) {
  manual_seed(1);
  TiedLM<double> m;
  EXPECT_EQ(m->head->weight.impl(), m->emb->weight.impl());
  using V = std::vector<std::string>;
  EXPECT_EQ(names_of(m->named_parameters()), (V{"emb.weight", "mid.weight", "mid.bias", "head.bias"}));
  EXPECT_EQ(names_of(m->named_parameters(true, false)),
            (V{"emb.weight", "mid.weight", "mid.bias", "head.weight", "head.bias"}));
  EXPECT_EQ(names_of(m->named_tensors()), (V{"emb.weight", "mid.weight", "mid.bias", "head.weight", "head.bias"}));
  EXPECT_EQ(m->parameters().size(), 4u);
  EXPECT_EQ(m->find_tensor("head.weight").impl_key(), m->emb->weight.impl().get());
  EXPECT_EQ(m->head->named_parameters()[0].tensor.impl_key(), m->emb->weight.impl().get());
}

// The one tensor gets the gradient of both uses, summed: equal to the untied model's two
// gradients added.
TEST(TiedParameters, OneGradientSummedOverBothUses) {
  manual_seed(2);
  TiedLM<double> tied;
  TiedLM<double> untied(false);
  {
    NoGradGuard g;
    for (const auto& t : tied->named_tensors()) untied->find_tensor(t.name).as<double>().copy_(t.tensor.as<double>());
  }
  loss_of(tied(batch_ids())).backward();
  loss_of(untied(batch_ids())).backward();
  auto expected = untied->emb->weight.grad() + untied->head->weight.grad();
  EXPECT_TRUE(all_close(tied->emb->weight.grad(), expected, 1e-14, 1e-14));
  EXPECT_TRUE(tied->head->weight.grad().same_storage(tied->emb->weight.grad()));
}

TEST(TiedParameters, OptimizerClippingAndMasterWeightsCountItOnce) {
  manual_seed(3);
  TiedLM<double> m;
  optim::SGD opt(m->parameters(), {.lr = 0.1});  // a duplicate would be refused
  EXPECT_EQ(opt.parameters().size(), 4u);
  loss_of(m(batch_ids())).backward();
  double sq = 0;
  for (const auto& p : m->parameters()) {
    auto g = p.as<double>().grad();
    sq += (g * g).sum().item();
  }
  auto norm = nn::utils::clip_grad_norm_(m->parameters(), 1e9);
  EXPECT_NEAR(static_cast<double>(norm), std::sqrt(sq), 1e-12);
  auto twice = m->parameters();
  twice.push_back(twice[0]);
  EXPECT_TRUE(throws_with([&] { nn::utils::clip_grad_norm_(twice, 1.0); }, {"parameter 4", "more than once"}));
  auto before = m->emb->weight.clone();
  opt.step();
  EXPECT_FALSE(all_close(m->emb->weight, before, 0, 0));
  EXPECT_EQ(m->head->weight.impl(), m->emb->weight.impl());

  // bfloat16 with float32 masters: one master for the tied weight, written back to both uses.
  manual_seed(4);
  TiedLM<bfloat16> b;
  amp::MasterWeights master(b->parameters());
  EXPECT_EQ(master.size(), 4u);
  auto dup = b->parameters();
  dup.push_back(dup[0]);
  EXPECT_TRUE(throws_with([&] { amp::MasterWeights bad(dup); }, {"MasterWeights: parameter 4", "more than once"}));
  optim::SGD bopt(master.parameters(), {.lr = 0.5});
  auto start = b->emb->weight.to<float>();
  for (int step = 0; step < 3; ++step) {
    loss_of(b(batch_ids())).to<float>().backward();
    master.step(bopt, {.max_norm = 1.0});
  }
  EXPECT_FALSE(all_close(b->emb->weight.to<float>(), start, 0, 0)) << "the tied weight trains";
  EXPECT_EQ(b->head->weight.impl(), b->emb->weight.impl());
  EXPECT_TRUE(all_close(b->emb->weight.to<float>(), master.parameters()[0].as<float>().to<bfloat16>().to<float>(), 0, 0));
}

TEST(TiedParameters, ANonLeafOrUnsetMemberIsCaught) {
  manual_seed(5);
  TiedLM<double> m;
  m->head->weight = m->emb->weight * 2.0;
  EXPECT_EQ(m->parameters().size(), 5u);  // listed as it is (the product is another tensor) ...
  EXPECT_TRUE(throws_with([&] { optim::SGD opt(m->parameters(), {.lr = 0.1}); },
                          {"parameter 3", "not a leaf"}));  // ... and refused by the optimizer
  m->head->weight = m->emb->weight;
  m->mid->bias = {};  // PyTorch's `mid.bias = None`: no longer a parameter
  EXPECT_EQ(m->parameters().size(), 3u);
  EXPECT_FALSE(m->find_tensor("mid.bias").defined());
}

// A user module registers its own members with their pointers (and only its own).
struct ScaleImpl : nn::Module {
  Tensor<double> w, other;
  ScaleImpl() { register_parameter("w", &ScaleImpl::w, ones<double>({3})); }
  Tensor<double> forward(const Tensor<double>& x) { return x * w; }
};
struct NotScale : nn::Module {
  NotScale() { register_parameter("w", &ScaleImpl::w, ones<double>({3})); }
};

TEST(TiedParameters, UserModulesRegisterMembersByPointer) {
  ScaleImpl a, b;
  b.w = a.w;
  EXPECT_EQ(b.parameters()[0].impl_key(), a.w.impl().get());
  EXPECT_TRUE(throws_with([] { NotScale n; }, {"register 'w'", "a class this module is not"}));
}

TEST(TiedParameters, ClonesKeepTheTie) {
  manual_seed(6);
  TiedLM<double> m;
  auto c = nn::clone(m, Device::cpu(0));
  EXPECT_EQ(c->head->weight.impl(), c->emb->weight.impl());
  EXPECT_NE(c->emb->weight.impl(), m->emb->weight.impl());
  EXPECT_EQ(c->parameters().size(), 4u);
  EXPECT_TRUE(all_close(c->emb->weight, m->emb->weight, 0, 0));
}

// Over 3 devices: the replicas keep the tie (one flat-buffer slot), the reduced gradient
// equals one device's, and SGD (plain and sharded) trains the tied weight as on one device.
TEST(TiedParameters, DataParallelMatchesOneDevice) {
  manual_seed(7);
  TiedLM<double> init;
  for (bool sharded : {false, true}) {
    TiedLM<double> one = nn::clone(init, Device::cpu(0));
    DataParallel<TiedLM<double>> dp(nn::clone(init, Device::cpu(0)), cpus(3));
    EXPECT_EQ(dp.parameters().size(), 4u);
    optim::SGD one_opt(one->parameters(), {.lr = 0.2});
    std::unique_ptr<optim::Optimizer> dp_opt;
    if (sharded) dp_opt = std::make_unique<parallel::ShardedOptimizer<optim::SGD>>(dp, optim::SGDOptions{.lr = 0.2});
    else dp_opt = std::make_unique<optim::SGD>(dp.parameters(), optim::SGDOptions{.lr = 0.2});
    for (int step = 0; step < 3; ++step) {
      one_opt.zero_grad();
      dp_opt->zero_grad();
      loss_of(one(batch_ids())).backward();
      loss_of(dp(batch_ids())).backward();
      chorus::testing::expect_grads_equal<double>(*one, dp.module(), 1e-12, "step " + std::to_string(step));
      one_opt.step();
      dp_opt->step();
    }
    EXPECT_TRUE(all_close(dp.module().emb->weight, one->emb->weight, 1e-12, 1e-12)) << "sharded " << sharded;
    EXPECT_EQ(dp.module().head->weight.impl(), dp.module().emb->weight.impl());
  }
}

// The same seed gives the same bits run to run over 3 devices: the tied weight's gradients
// (two uses on the primary, the replicas' sum) are added in an order fixed by the graph.
TEST(TiedParameters, DataParallelIsReproducible) {
  std::vector<std::vector<float>> finals;
  for (int run = 0; run < 4; ++run) {
    manual_seed(11);
    DataParallel<TiedLM<float>> dp(TiedLM<float>(), cpus(3));
    optim::Adam opt(dp.parameters(), {.lr = 0.01});
    for (int step = 0; step < 5; ++step) {
      opt.zero_grad();
      loss_of(dp(batch_ids())).backward();
      opt.step();
    }
    finals.push_back(dp.module().emb->weight.to_vector());
  }
  for (int run = 1; run < 4; ++run) EXPECT_EQ(finals[run], finals[0]) << "run " << run;
}

// A GPT-style model as a user writes it from the README: token and position embeddings, a
// pre-norm Transformer block under a causal mask, the head tied to the token embedding.
template <class T>
struct TinyGptImpl : nn::Module {
  nn::EmbeddingT<T> tok{nullptr}, pos{nullptr};
  nn::TransformerEncoderLayerT<T> block{nullptr};
  nn::LayerNormT<T> norm{nullptr};
  nn::LinearT<T> head{nullptr};
  TinyGptImpl() {
    tok = register_module("tok", nn::EmbeddingT<T>(11, 16));
    pos = register_module("pos", nn::EmbeddingT<T>(8, 16));
    block = register_module("block", nn::TransformerEncoderLayerT<T>(
                                         16, 2, {.dim_feedforward = 32, .dropout = 0.0, .batch_first = true,
                                                 .norm_first = true}));
    norm = register_module("norm", nn::LayerNormT<T>(16));
    head = register_module("head", nn::LinearT<T>(16, 11, {.bias = false}));
    head->weight = tok->weight;
  }
  // ids [N, L]; the causal mask [L, L] reaches every replica whole (kBroadcast).
  Tensor<T> forward(const Tensor<std::int64_t>& ids, const Tensor<T>& mask) {
    auto h = tok(ids) + pos(arange<std::int64_t>(static_cast<double>(ids.size(1)), ids.device()));
    return head(norm(block(h, mask)));
  }
};
template <class T>
class TinyGpt : public nn::ModuleHolder<TinyGptImpl<T>> {
 public:
  using nn::ModuleHolder<TinyGptImpl<T>>::ModuleHolder;
};

// bfloat16 over 3 devices with float32 master weights, the sharded AdamW, clipping in the
// master step and the mask broadcast to the replicas: it learns its batch, the tie holds, the
// model is its masters rounded, and the same seed gives the same bits.
TEST(TiedParameters, Bf16GptWithMastersAndTheShardedOptimizerTrains) {
  auto ids = from_vector<std::int64_t>({1, 4, 2, 8, 5, 7, 3, 9, 0, 6, 10, 2, 4, 4, 1, 3, 5, 9, 8, 7, 2, 2, 6, 1}, {3, 8});
  auto x = ids.narrow(1, 0, 7).contiguous(), y = ids.narrow(1, 1, 7).contiguous().reshape({21});
  std::vector<std::vector<float>> finals;
  for (int run = 0; run < 2; ++run) {
    manual_seed(12);
    DataParallel<TinyGpt<bfloat16>> dp(TinyGpt<bfloat16>(), {.devices = cpus(3), .scatter_dims = {0, kBroadcast}});
    amp::MasterWeights master(dp.parameters());
    parallel::ShardedOptimizer<optim::AdamW> opt(master.parameters(), {.lr = 0.01}, dp.devices());
    const auto mask = nn::generate_square_subsequent_mask<bfloat16>(7);
    std::vector<float> losses;
    for (int step = 0; step < 30; ++step) {
      opt.zero_grad();
      auto logits = dp(x, mask).reshape({21, 11});
      auto loss = nn::functional::cross_entropy(logits.to<float>(), y);
      loss.backward();
      master.step(opt, {.max_norm = 1.0});
      losses.push_back(loss.item());
    }
    EXPECT_LT(losses.back(), 0.5f * losses.front()) << "run " << run;
    auto& m = dp.module();
    EXPECT_EQ(m.head->weight.impl(), m.tok->weight.impl());
    EXPECT_TRUE(all_close(m.tok->weight.to<float>(), master.parameters()[0].as<float>().to<bfloat16>().to<float>(), 0, 0));
    finals.push_back(m.tok->weight.to<float>().to_vector());
  }
  EXPECT_EQ(finals[0], finals[1]);
}

TEST(TiedParameters, TyingAfterWrappingIsRefused) {
  manual_seed(8);
  DataParallel<TiedLM<double>> dp(TiedLM<double>(false), cpus(2));
  loss_of(dp(batch_ids())).backward();
  dp.module().head->weight = dp.module().emb->weight;
  EXPECT_TRUE(throws_with([&] { dp(batch_ids()); }, {"DataParallel: 'head.weight' is not the tensor it was",
                                                       "tie or replace parameters before building"}));
}

// Saved under both names (PyTorch's state_dict); a file holding it once (as Hugging Face's
// GPT-2 files do) loads, and so does a tied model's file into an untied model.
TEST(TiedParameters, CheckpointsSaveBothNamesAndLoadFromEither) {
  const auto dir = std::filesystem::temp_directory_path() / ("chorus_tied_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  manual_seed(9);
  TiedLM<double> m;
  const std::string path = (dir / "tied.safetensors").string();
  save(m, path);
  auto file = io::read(path);
  EXPECT_EQ(file.tensors.size(), 5u);
  EXPECT_TRUE(file.tensors.count("head.weight") && file.tensors.count("emb.weight"));

  manual_seed(10);
  TiedLM<double> loaded;
  load(loaded, path);
  EXPECT_TRUE(all_close(loaded->emb->weight, m->emb->weight, 0, 0));
  EXPECT_EQ(loaded->head->weight.impl(), loaded->emb->weight.impl());

  // Without head.weight in the file (the tie supplies it); an untied model needs both.
  TiedLM<double> untied_src(false);
  {
    NoGradGuard g;
    untied_src->emb->weight.copy_(m->emb->weight);
  }
  untied_src->head->weight = Tensor<double>();  // drop it from the registry
  const std::string once = (dir / "once.safetensors").string();
  save(untied_src, once);
  EXPECT_EQ(io::read(once).tensors.count("head.weight"), 0u);
  TiedLM<double> from_once;
  load(from_once, once);
  EXPECT_TRUE(all_close(from_once->head->weight, m->emb->weight, 0, 0));
  TiedLM<double> untied(false);
  EXPECT_TRUE(throws_with([&] { load(untied, once); }, {"lacks 1 tensor(s) of the module: 'head.weight'"}));
  load(untied, path);
  EXPECT_TRUE(all_close(untied->head->weight, m->emb->weight, 0, 0));
  EXPECT_NE(untied->head->weight.impl(), untied->emb->weight.impl());
  std::filesystem::remove_all(dir);
}

}  // namespace
