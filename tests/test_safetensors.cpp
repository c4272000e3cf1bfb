// Checkpoints: the safetensors format, optimizer state, atomic writes, bad files.
#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "test_util.hpp"

using namespace chorus;
using chorus::testing::throws_with;
namespace fs = std::filesystem;

namespace {
struct Net : nn::Module {
  nn::Linear fc1;
  nn::LinearT<double> fc2;
  Tensor<std::int64_t> counter;
  Net() : fc1(register_module("fc1", nn::Linear(3, 4))), fc2(register_module("fc2", nn::LinearT<double>(4, 2))) {
    counter = register_buffer("counter", from_vector<std::int64_t>({7, -1}));
  }
};

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("chorus_test_" + std::to_string(::getpid()) + "_" +
                                        std::to_string(reinterpret_cast<std::uintptr_t>(this)));
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

std::vector<std::uint8_t> bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::vector<std::uint8_t>& b) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

/// A file made of `header` (JSON text) and `data` bytes.
std::vector<std::uint8_t> make_file(const std::string& header, std::size_t data_bytes, std::uint64_t declared = 0) {
  std::vector<std::uint8_t> f(8 + header.size() + data_bytes, 0);
  const std::uint64_t n = declared ? declared : header.size();
  std::memcpy(f.data(), &n, 8);
  std::memcpy(f.data() + 8, header.data(), header.size());
  return f;
}

std::vector<float> snapshot(const Net& n) { return n.fc1->weight.to_vector(); }
}  // namespace

TEST(Safetensors, RoundTripsEveryDtypeWithMetadata) {
  TempDir dir;
  manual_seed(1);
  Net a;
  save(a, dir.file("a.safetensors"), {{"epoch", "3"}});
  manual_seed(2);
  Net b;
  ASSERT_NE(snapshot(a), snapshot(b));
  load(b, dir.file("a.safetensors"));
  auto ta = a.named_tensors(), tb = b.named_tensors();
  for (std::size_t i = 0; i < ta.size(); ++i) {
    ta[i].tensor.visit([&](const auto& x) {
      using T = typename std::decay_t<decltype(x)>::value_type;
      EXPECT_EQ(x.to_vector(), tb[i].tensor.template as<T>().to_vector()) << ta[i].name;
    });
  }
  auto f = io::read(dir.file("a.safetensors"));
  EXPECT_EQ(f.metadata.at("epoch"), "3");
  EXPECT_EQ(f.tensors.size(), 5u);
  EXPECT_EQ(f.tensors.at("fc1.weight").dtype, DType::Float32);
  EXPECT_EQ(f.tensors.at("fc2.bias").dtype, DType::Float64);
  EXPECT_EQ(f.tensors.at("counter").shape, (Shape{2}));
  EXPECT_EQ(f.data_start % 8, 0u);  // header padded so the data is aligned
  // The header is plain JSON readable by any safetensors implementation.
  auto raw = bytes_of(dir.file("a.safetensors"));
  std::uint64_t n;
  std::memcpy(&n, raw.data(), 8);
  auto header = nlohmann::json::parse(raw.begin() + 8, raw.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  EXPECT_EQ(header["fc1.weight"]["dtype"], "F32");
  EXPECT_EQ(header["fc1.weight"]["shape"], nlohmann::json::array({4, 3}));
  EXPECT_EQ(header["counter"]["dtype"], "I64");
}

TEST(Safetensors, DataParallelSavesTheWrappedModulesNames) {
  TempDir dir;
  set_cpu_device_count(2);
  struct Single : nn::Module {
    nn::Linear fc;
    Single() : fc(register_module("fc", nn::Linear(2, 2))) {}
    Tensor<float> forward(const Tensor<float>& x) { return fc(x); }
  };
  DataParallel<Single> dp(Single(), {Device::cpu(0), Device::cpu(1)});
  save(dp, dir.file("dp.safetensors"));
  auto f = io::read(dir.file("dp.safetensors"));
  EXPECT_TRUE(f.tensors.count("fc.weight"));
  EXPECT_TRUE(f.tensors.count("fc.bias"));
  EXPECT_EQ(f.tensors.size(), 2u);
  Single plain;
  load(plain, dir.file("dp.safetensors"));
  EXPECT_EQ(plain.fc->weight.to_vector(), dp.module().fc->weight.to_vector());
  load(dp, dir.file("dp.safetensors"));
}

namespace {
struct Mlp : nn::Module {
  nn::LinearT<double> a, b;
  Mlp() : a(register_module("a", nn::LinearT<double>(4, 8))), b(register_module("b", nn::LinearT<double>(8, 1))) {}
  Tensor<double> forward(const Tensor<double>& x) { return b(chorus::tanh(a(x))); }
};

template <class Opt, class Options>
void train(Mlp& m, Opt& opt, const std::vector<Tensor<double>>& xs, const std::vector<Tensor<double>>& ys, int from,
           int to) {
  (void)sizeof(Options);
  for (int i = from; i < to; ++i) {
    auto loss = nn::functional::mse_loss(m.forward(xs[i]), ys[i]);
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
}

template <class Opt, class Options>
void check_resume(Options options) {
  TempDir dir;
  std::vector<Tensor<double>> xs, ys;
  manual_seed(3);
  for (int i = 0; i < 10; ++i) {
    xs.push_back(randn<double>({5, 4}));
    ys.push_back(randn<double>({5, 1}));
  }
  manual_seed(4);
  Mlp straight;
  Mlp first = nn::clone(straight, Device::cpu(0));
  Opt opt_straight(straight.parameters(), options);
  train<Opt, Options>(straight, opt_straight, xs, ys, 0, 10);

  Opt opt_first(first.parameters(), options);
  train<Opt, Options>(first, opt_first, xs, ys, 0, 6);
  save(first, dir.file("model.safetensors"));
  save(opt_first, dir.file("optim.safetensors"));

  manual_seed(99);
  Mlp resumed;  // fresh objects
  Opt opt_resumed(resumed.parameters(), options);
  load(resumed, dir.file("model.safetensors"));
  load(opt_resumed, dir.file("optim.safetensors"));
  train<Opt, Options>(resumed, opt_resumed, xs, ys, 6, 10);
  auto p = straight.named_parameters(), q = resumed.named_parameters();
  for (std::size_t i = 0; i < p.size(); ++i)
    EXPECT_EQ(p[i].tensor.as<double>().to_vector(), q[i].tensor.as<double>().to_vector()) << p[i].name;
}
}  // namespace

TEST(Safetensors, OptimizerStateResumesExactly) {
  check_resume<optim::SGD>(optim::SGDOptions{.lr = 0.05, .momentum = 0.9, .nesterov = true});
  check_resume<optim::Adam>(optim::AdamOptions{.lr = 0.01, .amsgrad = true});
  check_resume<optim::AdamW>(optim::AdamWOptions{.lr = 0.01});
}

TEST(Safetensors, OptimizerCheckpointMismatchesAreRefused) {
  TempDir dir;
  Mlp m;
  optim::SGD sgd(m.parameters(), {.lr = 0.1, .momentum = 0.9});
  optim::Adam adam(m.parameters());
  save(sgd, dir.file("sgd.safetensors"));
  EXPECT_TRUE(throws_with([&] { load(adam, dir.file("sgd.safetensors")); }, {"SGD state", "not Adam"}));
  EXPECT_TRUE(throws_with([&] { load(m, dir.file("sgd.safetensors")); }, {"lacks"}));
  optim::SGD fewer(m.a->parameters(), {.lr = 0.1});
  EXPECT_TRUE(throws_with([&] { load(fewer, dir.file("sgd.safetensors")); }, {"4 parameters", "has 2"}));
  save(m, dir.file("model.safetensors"));
  EXPECT_TRUE(throws_with([&] { load(sgd, dir.file("model.safetensors")); }, {"not an optimizer checkpoint"}));
}

TEST(Safetensors, AFailedSaveLeavesThePreviousCheckpointIntact) {
  TempDir dir;
  const auto path = dir.file("ckpt.safetensors");
  Net a;
  save(a, path);
  const auto before = bytes_of(path);
  // Make the next write fail part-way: a file-size limit smaller than the checkpoint.
  std::signal(SIGXFSZ, SIG_IGN);
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit small = old;
  small.rlim_cur = 64;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  manual_seed(77);
  Net b;
  const bool threw = throws_with([&] { save(b, path); }, {"failed", "previous file is intact"});
  setrlimit(RLIMIT_FSIZE, &old);
  EXPECT_TRUE(threw);
  EXPECT_EQ(bytes_of(path), before);
  int files = 0;
  for (auto& e : fs::directory_iterator(dir.path)) files += e.is_regular_file();
  EXPECT_EQ(files, 1) << "a temporary file was left behind";
  Net c;
  load(c, path);  // still a valid checkpoint
  EXPECT_EQ(snapshot(c), snapshot(a));
}

TEST(Safetensors, BadFilesAreRefusedAndLeaveTheModuleUnchanged) {
  TempDir dir;
  const auto path = dir.file("bad.safetensors");
  struct One : nn::Module {
    Tensor<float> w;
    One() { w = register_parameter("w", from_vector<float>({1, 2, 3, 4}, {2, 2})); }
  } m;
  const auto original = m.w.to_vector();
  auto expect_refused = [&](const std::vector<std::uint8_t>& file, std::initializer_list<const char*> parts) {
    write_bytes(path, file);
    EXPECT_TRUE(throws_with([&] { load(m, path); }, parts));
    EXPECT_EQ(m.w.to_vector(), original);
  };
  const std::string ok = R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  write_bytes(path, make_file(ok, 16));
  load(m, path);  // the well-formed file loads (zeros)
  EXPECT_EQ(m.w.to_vector(), std::vector<float>(4, 0.0f));
  {
    NoGradGuard g;
    m.w.copy_(from_vector<float>(original, {2, 2}));
  }
  expect_refused({1, 2, 3}, {"truncated", "3 bytes"});
  expect_refused(make_file(ok, 16, 1000), {"header length 1000", "past the end"});
  expect_refused(make_file("{\"w\": [", 0), {"not valid JSON"});
  expect_refused(make_file("[1, 2]", 0), {"not a JSON object"});
  expect_refused(make_file(R"({"w":{"dtype":"Q7","shape":[2,2],"data_offsets":[0,16]}})", 16),
                 {"unknown dtype 'Q7'"});
  expect_refused(make_file(R"({"w":{"dtype":"I16","shape":[2,2],"data_offsets":[0,8]}})", 8), {"I16", "does not hold"});
  expect_refused(make_file(R"({"w":{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]}})", 8),
                 {"'w' is float16", "float32 in the module", "convert_dtype = true"});
  expect_refused(make_file(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,32]}})", 16), {"out of range"});
  expect_refused(make_file(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[8,24]},
                               "v":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})",
                           24),
                 {"overlap"});
  expect_refused(make_file(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})", 20),
                 {"[16, 20)", "belong to no tensor"});
  expect_refused(make_file(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[4,20]}})", 20),
                 {"[0, 4)", "belong to no tensor"});
  expect_refused(make_file(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,16]}})", 16),
                 {"[2, 3]", "span 16 bytes"});
  expect_refused(make_file(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},
                               "w":{"dtype":"F32","shape":[2,2],"data_offsets":[16,32]}})",
                           32),
                 {"'w' appears twice"});
  expect_refused(make_file(R"({"v":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})", 16),
                 {"lacks 1 tensor", "'w'"});
  expect_refused(make_file(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},
                               "extra":{"dtype":"F32","shape":[1],"data_offsets":[16,20]}})",
                           20),
                 {"the module lacks", "'extra'"});
  expect_refused(make_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 16),
                 {"'w' has shape [4]", "[2, 2]"});
  expect_refused(make_file(R"({"w":{"dtype":"F64","shape":[2,2],"data_offsets":[0,32]}})", 32),
                 {"float64", "float32"});
  expect_refused(make_file(R"({"w":{"dtype":"F32","shape":[2,-2],"data_offsets":[0,16]}})", 16),
                 {"non-negative integers"});
  expect_refused(make_file(R"({"w":{"dtype":"F32","shape":[2,2]}})", 16), {"needs dtype, shape and data_offsets"});
  expect_refused(make_file(R"({"__metadata__":{"a":1},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})", 16),
                 {"metadata 'a' is not a string"});
  EXPECT_TRUE(throws_with([&] { load(m, dir.file("missing.safetensors")); }, {"cannot open"}));
}

TEST(Safetensors, GroupsAndSchedulerResumeExactly) {
  TempDir dir;
  auto make = [](Mlp& m) {
    return std::make_unique<optim::SGD>(optim::weight_decay_groups<optim::SGDOptions>(
        m.parameters(), {.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-3}));
  };
  std::vector<Tensor<double>> xs, ys;
  manual_seed(3);
  for (int i = 0; i < 10; ++i) {
    xs.push_back(randn<double>({5, 4}));
    ys.push_back(randn<double>({5, 1}));
  }
  auto run = [&](Mlp& m, optim::SGD& opt, optim::LRScheduler& s, int from, int to) {
    for (int i = from; i < to; ++i) {
      auto loss = nn::functional::mse_loss(m.forward(xs[i]), ys[i]);
      opt.zero_grad();
      loss.backward();
      opt.step();
      s.step();
    }
  };
  manual_seed(4);
  Mlp straight;
  Mlp first = nn::clone(straight, Device::cpu(0));
  auto opt_s = make(straight);
  optim::OneCycleLR sched_s(*opt_s, {.max_lr = 0.2, .total_steps = 10});
  run(straight, *opt_s, sched_s, 0, 10);

  auto opt_f = make(first);
  optim::OneCycleLR sched_f(*opt_f, {.max_lr = 0.2, .total_steps = 10});
  run(first, *opt_f, sched_f, 0, 6);
  save(first, dir.file("model.safetensors"));
  save(*opt_f, dir.file("optim.safetensors"), {.scheduler = &sched_f});

  manual_seed(99);
  Mlp resumed;
  auto opt_r = make(resumed);
  optim::OneCycleLR sched_r(*opt_r, {.max_lr = 0.2, .total_steps = 10});
  load(resumed, dir.file("model.safetensors"));
  load(*opt_r, dir.file("optim.safetensors"), {.scheduler = &sched_r});
  EXPECT_EQ(sched_r.last_epoch(), 6);
  EXPECT_EQ(sched_r.get_last_lr(), sched_f.get_last_lr());
  EXPECT_EQ(opt_r->momentum(1), opt_f->momentum(1));
  run(resumed, *opt_r, sched_r, 6, 10);
  auto p = straight.named_parameters(), q = resumed.named_parameters();
  for (std::size_t i = 0; i < p.size(); ++i)
    EXPECT_EQ(p[i].tensor.as<double>().to_vector(), q[i].tensor.as<double>().to_vector()) << p[i].name;

  // Without a scheduler, the lrs still come back; a scheduler of another kind, or none in the file, is refused.
  optim::SGD plain(resumed.parameters(), {.lr = 1.0, .momentum = 0.5});
  auto opt_lr = make(resumed);
  opt_lr->set_lr(0, 7.0);
  load(*opt_lr, dir.file("optim.safetensors"));
  EXPECT_EQ(opt_lr->lr(0), opt_f->lr(0));
  optim::StepLR other(*opt_lr, 2);
  EXPECT_TRUE(throws_with([&] { load(*opt_lr, dir.file("optim.safetensors"), {.scheduler = &other}); }, {"OneCycleLR", "not StepLR"}));
  save(*opt_f, dir.file("nosched.safetensors"));
  EXPECT_TRUE(throws_with([&] { load(*opt_lr, dir.file("nosched.safetensors"), {.scheduler = &other}); }, {"no learning-rate scheduler"}));
  EXPECT_TRUE(throws_with([&] { load(plain, dir.file("optim.safetensors")); }, {"2 parameter groups", "has 1"}));

  // A scheduler that refuses the saved epoch (6 of a 5-step cycle): nothing is loaded, not the
  // momentum buffers, the lrs or the momenta either.
  Mlp fresh;
  auto opt_x = make(fresh);
  optim::OneCycleLR short_cycle(*opt_x, {.max_lr = 0.2, .total_steps = 5});
  const double lr0 = opt_x->lr(0), m0 = opt_x->momentum(0);
  EXPECT_TRUE(throws_with([&] { load(*opt_x, dir.file("optim.safetensors"), {.scheduler = &short_cycle}); },
                          {"OneCycleLR"}));
  EXPECT_EQ(opt_x->lr(0), lr0);
  EXPECT_EQ(opt_x->momentum(0), m0);
  EXPECT_EQ(short_cycle.last_epoch(), 0);
  for (const auto& st : opt_x->state()) EXPECT_TRUE(st.empty());
}

// ---- 16-bit checkpoints (issue 19) ----
namespace {
template <class W, class H>
struct LowpNet : nn::Module {
  Tensor<W> w;
  Tensor<H> h;
  Tensor<std::int64_t> steps;
  explicit LowpNet(float shift = 0) {
    std::vector<W> wv;
    std::vector<H> hv;
    for (int i = 0; i < 6; ++i) wv.push_back(W(static_cast<float>(i - 7) / 3.0f + shift));
    for (int i = 0; i < 4; ++i) hv.push_back(H(static_cast<float>(i) * 1000.5f + shift));
    w = register_parameter("w", from_vector(wv, {2, 3}));
    h = register_parameter("h", from_vector(hv));
    steps = register_buffer("steps", from_vector<std::int64_t>({3, 4}));
  }
};
template <class T>
std::vector<std::uint16_t> bits_of(const Tensor<T>& t) {
  std::vector<std::uint16_t> r;
  for (T x : t.to_vector()) r.push_back(x.bits());
  return r;
}
}  // namespace

TEST(Safetensors, BFloat16AndFloat16RoundTripBitForBit) {
  TempDir dir;
  const auto path = dir.file("lowp.safetensors");
  LowpNet<bfloat16, half> a(0.25f), b;
  save(a, path);
  auto f = io::read(path);
  EXPECT_EQ(f.tensors.at("w").dtype, DType::BFloat16);
  EXPECT_EQ(f.tensors.at("h").dtype, DType::Float16);
  EXPECT_EQ(f.tensors.at("w").end - f.tensors.at("w").begin, 12u);
  load(b, path);
  EXPECT_EQ(bits_of(b.w), bits_of(a.w));
  EXPECT_EQ(bits_of(b.h), bits_of(a.h));
  // The header names the dtypes as safetensors does.
  const auto bytes = bytes_of(path);
  const std::string text(bytes.begin(), bytes.end());
  EXPECT_NE(text.find(R"("dtype":"BF16")"), std::string::npos);
  EXPECT_NE(text.find(R"("dtype":"F16")"), std::string::npos);
}

TEST(Safetensors, A16BitFileLoadsIntoAFloatModuleOnlyWhenAsked) {
  TempDir dir;
  const auto path = dir.file("lowp.safetensors");
  LowpNet<bfloat16, half> lowp(0.25f);
  save(lowp, path);
  LowpNet<float, double> wide;
  const auto before = wide.w.to_vector();
  EXPECT_TRUE(throws_with([&] { load(wide, path); }, {"'h' is float16", "float64 in the module", "convert_dtype"}) ||
              throws_with([&] { load(wide, path); }, {"'w' is bfloat16", "float32 in the module", "convert_dtype"}));
  EXPECT_EQ(wide.w.to_vector(), before);  // unchanged
  load(wide, path, io::LoadOptions{.convert_dtype = true});
  auto w = wide.w.to_vector();
  auto lw = lowp.w.to_vector();
  for (std::size_t i = 0; i < w.size(); ++i) EXPECT_EQ(w[i], static_cast<float>(lw[i]));  // exact widening
  auto h = wide.h.to_vector();
  auto lh = lowp.h.to_vector();
  for (std::size_t i = 0; i < h.size(); ++i) EXPECT_EQ(h[i], static_cast<double>(static_cast<float>(lh[i])));
  // And back: a float checkpoint into a 16-bit module rounds each value once to nearest even.
  const auto wide_path = dir.file("wide.safetensors");
  LowpNet<float, double> src(0.1f);
  save(src, wide_path);
  LowpNet<bfloat16, half> dst;
  EXPECT_TRUE(throws_with([&] { load(dst, wide_path); }, {"in the module", "convert_dtype = true"}));
  load(dst, wide_path, io::LoadOptions{.convert_dtype = true});
  auto sw = src.w.to_vector();
  for (std::size_t i = 0; i < sw.size(); ++i) EXPECT_EQ(dst.w.to_vector()[i].bits(), bfloat16(sw[i]).bits());
  auto sh = src.h.to_vector();
  for (std::size_t i = 0; i < sh.size(); ++i) EXPECT_EQ(dst.h.to_vector()[i].bits(), half(sh[i]).bits());
}

TEST(Safetensors, IntegerTensorsAreNeverConverted) {
  TempDir dir;
  const auto path = dir.file("ints.safetensors");
  struct Ints : nn::Module {
    Tensor<std::int64_t> steps;
    Ints() { steps = register_buffer("steps", from_vector<std::int64_t>({1, 2})); }
  };
  struct Floats : nn::Module {
    Tensor<float> steps;
    Floats() { steps = register_buffer("steps", zeros<float>({2})); }
  };
  save(Ints(), path);
  Floats f;
  EXPECT_TRUE(throws_with([&] { load(f, path, io::LoadOptions{.convert_dtype = true}); },
                          {"'steps' is int64", "float32 in the module"}));
}
