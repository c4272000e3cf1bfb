// Trains a character-level language model (an LSTM or a small causal Transformer) on a text
// file, with DataParallel over the available devices or one process per device under
// mpirun/torchrun: a progress bar with tokens/s, the validation loss and perplexity after each
// epoch, a checkpoint (model, optimizer, schedule) after each epoch, and a sample at the end.
//
//   train_lm [--model lstm|transformer] [--data FILE] [--cpu N | --gpus | --distributed]
//            [--epochs E] [--steps S] [--batch B] [--seq-len L] [--lr LR] [--hidden H] [--layers N]
//            [--dropout P] [--out DIR] [--resume] [--stop-after E] [--sample N] [--temperature T]
//            [--prompt TEXT] [--seed S] [--checkpoint] [--fsdp] [--memory-limit MIB]
//            [--profile FILE [--profile-steps N]]
//
// The text (by default the GPL-3 licence text every Debian machine has) is read as bytes: the
// vocabulary is the set of distinct bytes, the first 90% trains and the last 10% validates.
// Each step takes B windows of L+1 bytes at random offsets (a function of the seed and the step
// number, so a resumed run sees the batches the uninterrupted one would); an epoch is S steps,
// by default as many as make one pass over the training part. Validation runs over all
// non-overlapping windows of the validation part. --distributed: B is the global batch, each
// of the W processes takes B / W of its windows (the same windows a single process would).
// --stop-after E ends the run after epoch E, as an interruption would (to try --resume).
// --checkpoint (transformer): each encoder layer's activations are recomputed in backward instead
// of kept; the results are the same bit for bit, the peak memory printed after each epoch lower.
// --fsdp (transformer, --distributed): ZeRO-3 (dist::FullyShardedDataParallel), each encoder layer
// a unit: every process keeps 1/W of the parameters, gradients and AdamW state; the model file is
// written from the gathered parameters, the shards and their optimizer state as a sharded
// checkpoint (OUT/sharded, one file a process), which --resume reads on any number of processes.
// --memory-limit MIB caps each training device's memory (set_memory_limit) once the model is
// built: what does not fit then stops with an out-of-memory error naming the device.
// --profile FILE: a Chrome trace of N steps (default 5) after 2 warm-up steps, and their summary
// (examples/profile_option.hpp; under --distributed a file per rank).
#include <chorus/distributed.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <unistd.h>

#include "device_options.hpp"
#include "profile_option.hpp"
#include "lm_models.hpp"

using namespace chorus;
namespace fs = std::filesystem;

namespace {

struct Config {
  std::string model = "lstm", data = "/usr/share/common-licenses/GPL-3", out = "train_lm_out", prompt = "The ";
  std::vector<Device> devices;
  bool distributed = false, resume = false, checkpoint = false, fsdp = false;
  int epochs = 10, stop_after = 0, batch = 32, seq_len = 64, layers = 0, sample = 300;
  std::int64_t steps = 0, hidden = 0;
  double lr = 0, dropout = -1, temperature = 0.8, memory_limit_mib = 0;
  std::uint64_t seed = 1;
  mutable examples::ProfileOption profile;  // --profile: records steps while training
};

/// The text as token ids, and the vocabulary (the distinct bytes, in byte order).
struct Corpus {
  std::string vocab;
  std::vector<std::int64_t> train, val;
};

Corpus read_corpus(const Config& c) {
  std::ifstream in(c.data, std::ios::binary);
  CHORUS_CHECK(in, "--data: cannot read '", c.data, "'");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHORUS_CHECK(!text.empty(), "--data: '", c.data, "' is empty");
  Corpus corpus;
  bool seen[256] = {};
  for (unsigned char ch : text) seen[ch] = true;
  std::int64_t id[256];
  for (int b = 0; b < 256; ++b)
    if (seen[b]) id[b] = static_cast<std::int64_t>(corpus.vocab.size()), corpus.vocab.push_back(static_cast<char>(b));
  const std::size_t n_train = text.size() * 9 / 10;
  for (std::size_t i = 0; i < text.size(); ++i)
    (i < n_train ? corpus.train : corpus.val).push_back(id[static_cast<unsigned char>(text[i])]);
  const std::size_t need = static_cast<std::size_t>(c.seq_len) + 1;
  CHORUS_CHECK(corpus.train.size() >= need && corpus.val.size() >= need, "--seq-len ", c.seq_len, " is too long for '", c.data, "' (", text.size(),
               " bytes): a window of ", need, " bytes must fit into its validation part (the last 10%, ",
               corpus.val.size(), " bytes); use a shorter --seq-len or a longer text");
  return corpus;
}

/// The batch of step `step`: rows [row_begin, row_end) of B windows at offsets drawn from
/// (seed, step); x the inputs [rows, L], y the next bytes [rows, L].
std::pair<Tensor<std::int64_t>, Tensor<std::int64_t>> batch_at(const Corpus& corpus, const Config& c,
                                                               std::int64_t step, int row_begin, int row_end) {
  std::seed_seq seq{c.seed, static_cast<std::uint64_t>(step)};
  std::mt19937_64 rng(seq);
  std::uniform_int_distribution<std::size_t> offset(0, corpus.train.size() - static_cast<std::size_t>(c.seq_len) - 1);
  std::vector<std::int64_t> x, y;
  for (int r = 0; r < c.batch; ++r) {
    const std::size_t o = offset(rng);
    if (r < row_begin || r >= row_end) continue;
    x.insert(x.end(), corpus.train.begin() + o, corpus.train.begin() + o + c.seq_len);
    y.insert(y.end(), corpus.train.begin() + o + 1, corpus.train.begin() + o + c.seq_len + 1);
  }
  const Shape shape{row_end - row_begin, c.seq_len};
  return {from_vector(x, shape), from_vector(y, shape)};
}

/// Cross entropy of logits [N, L, V] against targets [N, L], averaged over the tokens.
Tensor<float> lm_loss(const Tensor<float>& logits, const Tensor<std::int64_t>& target,
                      Reduction reduction = Reduction::Mean) {
  const auto v = logits.size(2);
  return nn::functional::cross_entropy(logits.reshape({-1, v}), target.to(logits.device()).reshape({-1}), reduction);
}

/// One process's view of the run: the whole world (DataParallel) or one rank of it.
struct World {
  int rank = 0, size = 1;
  bool reports() const { return rank == 0; }
};

/// Sum of the token losses and the token count over the validation windows that this rank
/// takes (window i goes to rank i % size), summed over the ranks.
template <class W>
double validation_loss(W& model, const Corpus& corpus, const Config& c, const World& world, Device device) {
  NoGradGuard no_grad;
  model.eval();
  const std::size_t windows = (corpus.val.size() - 1) / static_cast<std::size_t>(c.seq_len);
  double sums[2] = {0, 0};  // loss, tokens
  std::vector<std::int64_t> x, y;
  auto flush = [&] {
    if (x.empty()) return;
    const Shape shape{static_cast<std::int64_t>(x.size()) / c.seq_len, c.seq_len};
    sums[0] += lm_loss(model(from_vector(x, shape)), from_vector(y, shape), Reduction::Sum).item();
    x.clear();
    y.clear();
  };
  // Every rank runs as many batches (a forward of FullyShardedDataParallel is a collective): a
  // rank with a window fewer fills it with window 0, whose targets the loss ignores (-100).
  const std::size_t per_rank = (windows + static_cast<std::size_t>(world.size) - 1) / static_cast<std::size_t>(world.size);
  for (std::size_t k = 0; k < per_rank; ++k) {
    const std::size_t i = static_cast<std::size_t>(world.rank) + k * static_cast<std::size_t>(world.size);
    const bool real = i < windows;
    const auto o = corpus.val.begin() + static_cast<std::ptrdiff_t>((real ? i : 0) * static_cast<std::size_t>(c.seq_len));
    x.insert(x.end(), o, o + c.seq_len);
    if (real) y.insert(y.end(), o + 1, o + c.seq_len + 1);
    else y.insert(y.end(), static_cast<std::size_t>(c.seq_len), std::int64_t{-100});
    sums[1] += real ? c.seq_len : 0;
    if (x.size() == static_cast<std::size_t>(c.batch * c.seq_len)) flush();
  }
  flush();
  if (world.size > 1) {
    auto t = from_vector(std::vector<double>{sums[0], sums[1]}, device);
    dist::group().all_reduce(t);
    auto v = t.to(Device::cpu()).to_vector();
    sums[0] = v[0], sums[1] = v[1];
  }
  model.train();
  return sums[0] / sums[1];
}

void progress(int epoch, int epochs, std::int64_t done, std::int64_t total, double loss, double lr, double rate) {
  static const bool tty = isatty(fileno(stdout));
  if (!tty && done != total) return;
  const int width = 24;
  const int filled = total ? static_cast<int>(width * done / total) : width;
  std::printf("\repoch %d/%d [%s%s] %lld/%lld loss %.4f lr %.2e %.0f tokens/s", epoch, epochs,
              std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(),
              static_cast<long long>(done), static_cast<long long>(total), loss, lr, rate);
  std::fflush(stdout);
}

/// `n` bytes sampled from `model` after `prompt`, one at a time from the softmax of the last
/// position's logits / temperature (on the host, with a chorus Generator), the context being
/// the last seq_len bytes.
template <class M>
std::string generate(M& model, const Corpus& corpus, const Config& c, Device device) {
  NoGradGuard no_grad;
  model.eval();
  std::vector<std::int64_t> context;
  for (char ch : c.prompt) {
    const auto at = corpus.vocab.find(ch);
    CHORUS_CHECK(at != std::string::npos, "--prompt: the byte '", ch, "' does not occur in '", c.data, "'");
    context.push_back(static_cast<std::int64_t>(at));
  }
  std::string text = c.prompt;
  if (context.empty()) context.push_back(corpus.train[0]), text.push_back(corpus.vocab[corpus.train[0]]);
  Generator gen(c.seed + 1);
  const auto v = static_cast<std::size_t>(corpus.vocab.size());
  std::vector<double> p(v);
  for (int i = 0; i < c.sample; ++i) {
    const auto len = std::min<std::size_t>(context.size(), static_cast<std::size_t>(c.seq_len));
    std::vector<std::int64_t> window(context.end() - static_cast<std::ptrdiff_t>(len), context.end());
    auto logits = model.forward(from_vector(window, Shape{1, static_cast<std::int64_t>(len)}, device));
    auto last = logits.select(1, static_cast<std::int64_t>(len) - 1).to(Device::cpu()).to_vector();
    const double top = *std::max_element(last.begin(), last.end());
    double total = 0;
    for (std::size_t k = 0; k < v; ++k) total += p[k] = std::exp((last[k] - top) / c.temperature);
    double u = 0;
    gen.uniform(&u, 1, 0.0, total);
    std::size_t k = 0;
    while (k + 1 < v && (u -= p[k]) >= 0) ++k;
    context.push_back(static_cast<std::int64_t>(k));
    text.push_back(corpus.vocab[k]);
  }
  return text;
}

std::string vocab_ids(const std::string& vocab) {
  std::string s;
  for (unsigned char ch : vocab) {
    if (!s.empty()) s += ',';
    s += std::to_string(ch);
  }
  return s;
}

/// True for a model whose layers are FullyShard units (CharTransformerT<dist::FullyShard>).
template <class M>
constexpr bool has_units() {
  if constexpr (requires { M::units; }) return M::units;
  else return false;
}

/// Runs `f` with the model's parameters in place: for FullyShardedDataParallel, every rank
/// gathers them first (summon_full_params) and f may use the module alone.
template <class W, class F>
void with_full_parameters(W& net, F&& f) {
  if constexpr (requires { net.summon_full_params(); }) {
    auto full = net.summon_full_params();
    f();
  } else {
    f();
  }
}

/// Builds the model, trains it (DataParallel, or DDP with --distributed), validates, saves and
/// samples.
template <class M>
int train(const Config& c, const Corpus& corpus, M model, const std::string& description) {
  World world;
  Device device = c.devices.empty() ? Device::cpu() : c.devices[0];
  if (c.distributed) {
    auto& pg = dist::group();
    world = {pg.rank(), pg.world_size()};
    device = pg.default_device();
    CHORUS_CHECK(c.batch % world.size == 0, "--batch ", c.batch, " is not a multiple of the ", world.size,
                 " processes");
  }
  const auto model_path = (fs::path(c.out) / "model.safetensors").string();
  const auto optim_path = (fs::path(c.out) / "optimizer.safetensors").string();
  const auto sharded_dir = (fs::path(c.out) / "sharded").string();  // --fsdp's shards and optimizer
  model.to(device);
  std::map<std::string, std::string> meta;
  if (c.resume) {
    meta = io::read(model_path).metadata;
    CHORUS_CHECK(meta.count("epoch") && meta.count("model") && meta.count("vocab") && meta.count("generator_offset"), "--resume: '", model_path,
                 "' is not a train_lm checkpoint");
    CHORUS_CHECK(meta.at("model") == c.model, "--resume: '", model_path, "' holds a ", meta.at("model"),
                 " model, not --model ", c.model);
    CHORUS_CHECK(meta.at("vocab") == vocab_ids(corpus.vocab), "--resume: '", model_path,
                 "' was trained on a text with another vocabulary than '", c.data, "'");
    load(model, model_path);  // before wrapping: DDP copies rank 0's weights to every rank
  }
  std::size_t nparams = 0;
  for (auto& p : model.parameters()) nparams += static_cast<std::size_t>(p.numel());

  auto run = [&](auto& net, Device out_device) {
    auto params = net.parameters();
    optim::AdamW opt(params, {.lr = c.lr, .weight_decay = 0.01});
    const std::int64_t steps = c.steps ? c.steps
                                       : std::max<std::int64_t>(1, static_cast<std::int64_t>(corpus.train.size()) /
                                                                       (c.batch * c.seq_len));
    optim::CosineAnnealingLR sched(opt, steps * c.epochs, c.lr / 10);
    int start_epoch = 1;
    if (c.resume) {
      if constexpr (requires { net.load_sharded(opt, sharded_dir); })
        net.load_sharded(opt, sharded_dir, {.scheduler = &sched});  // written by any number of processes
      else
        load(opt, optim_path, {.scheduler = &sched});
      start_epoch = std::stoi(meta.at("epoch")) + 1;
      default_generator().set_offset(std::stoull(meta.at("generator_offset")));  // dropout continues as it would have
      if (world.reports())
        std::printf("resumed after epoch %d (step %lld)\n", start_epoch - 1, static_cast<long long>(sched.last_epoch()));
    }
    if (world.reports()) {
      std::printf("%s, %zu parameters, vocabulary %zu; %zu training and %zu validation bytes from %s\n",
                  description.c_str(), nparams, corpus.vocab.size(), corpus.train.size(), corpus.val.size(),
                  c.data.c_str());
      if (c.distributed)
        std::printf("%d process(es) (%s), global batch %d x %d; rank 0 on %s\n", world.size,
                    dist::group().backend().c_str(), c.batch, c.seq_len, device.str().c_str());
      else {
        std::printf("batch %d x %d on %zu device(s):", c.batch, c.seq_len, c.devices.size());
        for (auto& d : c.devices) std::printf(" %s", d.str().c_str());
        std::printf("\n");
      }
    }
    if (!c.resume) {
      const double v = validation_loss(net, corpus, c, world, out_device);
      if (world.reports()) std::printf("before training: val loss %.4f, perplexity %.2f\n", v, std::exp(v));
    }
    const int last_epoch = c.stop_after ? std::min(c.stop_after, c.epochs) : c.epochs;
    const int rows = c.batch / world.size;
    net.train();
    std::vector<Device> devices = c.distributed ? std::vector<Device>{device} : c.devices;
    for (int epoch = start_epoch; epoch <= last_epoch; ++epoch) {
      for (const auto& d : devices) allocator_of(d).reset_peak();
      const auto start = std::chrono::steady_clock::now();
      double loss_avg = 0;
      for (std::int64_t s = 0; s < steps; ++s) {
        auto [x, y] = batch_at(corpus, c, sched.last_epoch(), world.rank * rows, (world.rank + 1) * rows);
        auto loss = lm_loss(net(x), y);
        opt.zero_grad();
        loss.backward();
        if constexpr (requires { net.summon_full_params(); }) net.clip_grad_norm_(1.0);  // over every rank's shards
        else nn::utils::clip_grad_norm_(params, 1.0);
        opt.step();
        sched.step();
        c.profile.after_step(c.distributed ? world.rank : -1);
        loss_avg = s == 0 ? loss.item() : 0.9 * loss_avg + 0.1 * loss.item();
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (world.reports())
          progress(epoch, c.epochs, s + 1, steps, loss_avg, opt.lr(0),
                   static_cast<double>((s + 1) * c.batch * c.seq_len) / std::max(secs, 1e-9));
      }
      const double step_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / steps;
      std::string peaks;  // of training, before validation
      for (const auto& d : devices) {
        char line[64];
        std::snprintf(line, sizeof line, " %s %.2f MiB", d.str().c_str(), memory_stats(d).peak_allocated / 1048576.0);
        peaks += line;
      }
      const double v = validation_loss(net, corpus, c, world, out_device);
      auto write = [&] {
        if (!world.reports()) return;
        std::printf("\nepoch %d: val loss %.4f, perplexity %.2f; %.1f ms/step, peak memory%s\n", epoch, v, std::exp(v),
                    step_ms, peaks.c_str());
        fs::create_directories(c.out);
        save(net.module(), model_path,
             {{"epoch", std::to_string(epoch)}, {"model", c.model}, {"vocab", vocab_ids(corpus.vocab)},
              {"val_loss", std::to_string(v)}, {"generator_offset", std::to_string(default_generator().get_offset())}});
        if (!c.fsdp) save(opt, optim_path, {.scheduler = &sched});
      };
      with_full_parameters(net, write);
      if constexpr (requires { net.save_sharded(opt, sharded_dir); })  // every rank its own shards
        net.save_sharded(opt, sharded_dir, {.scheduler = &sched}, {{"epoch", std::to_string(epoch)}});
    }
    if (c.sample > 0 && last_epoch == c.epochs)
      with_full_parameters(net, [&] {
        if (world.reports())
          std::printf("sample (temperature %.2f):\n%s\n", c.temperature,
                      generate(net.module(), corpus, c, device).c_str());
      });
  };
  if (c.memory_limit_mib > 0)
    for (const auto& d : c.distributed ? std::vector<Device>{device} : c.devices)
      set_memory_limit(d, static_cast<std::int64_t>(c.memory_limit_mib * 1048576.0));
  if constexpr (has_units<M>()) {  // its encoder layers are FullyShard units
    dist::FullyShardedDataParallel<M> fsdp(std::move(model));
    run(fsdp, device);
  } else if (c.distributed) {
    DistributedDataParallel<M> ddp(std::move(model));
    run(ddp, device);
  } else {
    DataParallel<M> dp(std::move(model), c.devices);
    run(dp, dp.output_device());
  }
  return 0;
}

void usage(const char* argv0) {
  std::cerr << "usage: " << argv0
            << " [--model lstm|transformer] [--data FILE] [--cpu N | --gpus | --distributed] [--epochs E]"
               " [--steps S] [--batch B] [--seq-len L] [--lr LR] [--hidden H] [--layers N] [--dropout P]"
               " [--out DIR] [--resume] [--stop-after E] [--sample N] [--temperature T] [--prompt TEXT]"
               " [--seed S] [--checkpoint] [--fsdp] [--memory-limit MIB]"
            << examples::ProfileOption::usage() << "\n";
}

}  // namespace

int main(int argc, char** argv) try {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // epoch lines reach a log as they happen
  Config c;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&] {
      if (i + 1 >= argc) throw Error(a + " needs a value");
      return std::string(argv[++i]);
    };
    if (examples::parse_device_option(i, argc, argv, c.devices) || c.profile.parse(i, argc, argv)) continue;
    if (a == "--model") c.model = value();
    else if (a == "--data") c.data = value();
    else if (a == "--distributed") c.distributed = true;
    else if (a == "--epochs") c.epochs = std::stoi(value());
    else if (a == "--steps") c.steps = std::stoll(value());
    else if (a == "--batch") c.batch = std::stoi(value());
    else if (a == "--seq-len") c.seq_len = std::stoi(value());
    else if (a == "--lr") c.lr = std::stod(value());
    else if (a == "--hidden") c.hidden = std::stoll(value());
    else if (a == "--layers") c.layers = std::stoi(value());
    else if (a == "--dropout") c.dropout = std::stod(value());
    else if (a == "--out") c.out = value();
    else if (a == "--resume") c.resume = true;
    else if (a == "--stop-after") c.stop_after = std::stoi(value());
    else if (a == "--sample") c.sample = std::stoi(value());
    else if (a == "--temperature") c.temperature = std::stod(value());
    else if (a == "--prompt") c.prompt = value();
    else if (a == "--seed") c.seed = std::stoull(value());
    else if (a == "--checkpoint") c.checkpoint = true;
    else if (a == "--fsdp") c.fsdp = true;
    else if (a == "--memory-limit") c.memory_limit_mib = std::stod(value());
    else {
      usage(argv[0]);
      return 2;
    }
  }
  CHORUS_CHECK(c.model == "lstm" || c.model == "transformer", "--model must be lstm or transformer, not '", c.model,
               "'");
  CHORUS_CHECK(c.epochs > 0 && c.batch > 0 && c.seq_len > 0 && c.steps >= 0 && c.sample >= 0 && c.stop_after >= 0,
               "--epochs, --batch and --seq-len must be positive; --steps, --sample and --stop-after not negative");
  CHORUS_CHECK(c.temperature > 0, "--temperature must be positive, got ", c.temperature);
  CHORUS_CHECK(c.memory_limit_mib >= 0, "--memory-limit must not be negative, got ", c.memory_limit_mib);
  CHORUS_CHECK(!(c.distributed && !c.devices.empty()), "--distributed uses one device per process; leave out --cpu/--gpus");
  const bool lstm = c.model == "lstm";
  CHORUS_CHECK(!(lstm && c.checkpoint), "--checkpoint is for --model transformer (its encoder layers)");
  CHORUS_CHECK(!c.fsdp || (!lstm && c.distributed), "--fsdp is for --model transformer under --distributed");
  if (c.hidden == 0) c.hidden = lstm ? 256 : 128;
  if (c.layers == 0) c.layers = lstm ? 1 : 2;
  if (c.lr == 0) c.lr = lstm ? 3e-3 : 1e-3;
  if (c.dropout < 0) c.dropout = lstm ? 0.0 : 0.1;
  CHORUS_CHECK(c.hidden > 0 && c.layers > 0 && c.lr > 0 && c.dropout < 1, "--hidden, --layers and --lr must be "
               "positive and --dropout below 1");
  if (c.distributed) dist::init();
  else if (c.devices.empty()) c.devices = available_devices();

  const Corpus corpus = read_corpus(c);
  const auto vocab = static_cast<std::int64_t>(corpus.vocab.size());
  manual_seed(c.seed);
  std::ostringstream what;
  if (lstm) {
    what << "LSTM LM (embedding 64, " << c.layers << " layer(s) of " << c.hidden << ")";
    return train(c, corpus, examples::CharLSTM(vocab, 64, c.hidden, c.layers, c.dropout), what.str());
  }
  CHORUS_CHECK(c.hidden % 4 == 0, "--hidden ", c.hidden, " must be a multiple of the transformer's 4 heads");
  what << "Transformer LM (d_model " << c.hidden << ", 4 heads, " << c.layers << " layer(s)"
       << (c.checkpoint ? ", checkpointed" : "") << (c.fsdp ? ", fully sharded" : "") << ", context " << c.seq_len
       << ")";
  if (c.fsdp)
    return train(c, corpus,
                 examples::CharTransformerT<dist::FullyShard>(vocab, c.seq_len, c.hidden, 4, c.layers, c.dropout,
                                                              c.checkpoint),
                 what.str());
  return train(c, corpus, examples::CharTransformer(vocab, c.seq_len, c.hidden, 4, c.layers, c.dropout, c.checkpoint),
               what.str());
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << "\n";
  return 1;
}
