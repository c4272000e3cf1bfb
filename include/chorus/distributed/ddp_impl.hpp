#pragma once
// The definitions of distributed/ddp.hpp that do not depend on the module type (construction,
// the model check, the broadcasts, the join rounds, the graph wiring): compiled into
// chorus::compiled and the MPI library (src/distributed/local.cpp, mpi.cpp), included by ddp.hpp
// itself in the header-only form (Note [compiled chorus]).
#include <unordered_map>

#include "ddp.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist::detail {

// DistributedDataParallel's spelling of a shape in verify_same_model's lines.
CHORUS_INLINE std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

CHORUS_INLINE std::shared_ptr<Reducer> setup_ddp(nn::Module& root, const DistributedDataParallelOptions& options,
                                                 ProcessGroup& group, Device& device) {
  auto named = root.named_parameters();
  auto buffers = root.named_buffers();
  CHORUS_CHECK(!named.empty() || !buffers.empty(), "DistributedDataParallel: the module has no parameters");
  device = !named.empty() ? named[0].tensor.device() : buffers[0].tensor.device();
  for (const auto* list : {&named, &buffers})
    for (const auto& p : *list)
      CHORUS_CHECK(p.tensor.device() == device, "DistributedDataParallel: '", p.name, "' is on ", p.tensor.device(),
                   " but '", (named.empty() ? buffers : named)[0].name, "' is on ", device,
                   "; one device per process (move the module there first)");
  verify_same_model(group, named, buffers);
  sync_from(group, 0, named, buffers, /*buffers_only=*/false);
  std::vector<Reducer::Param> trained;
  std::unordered_set<const void*> seen;  // a tensor registered under two names is reduced once
  for (auto& p : named)
    if (p.tensor.requires_grad() && p.tensor.dtype() != DType::Int64 && seen.insert(p.tensor.impl_key()).second)
      trained.push_back({p.name, p.tensor});
  return std::make_shared<Reducer>(group, std::move(trained), options, device);
}

CHORUS_INLINE void verify_same_model(ProcessGroup& group, const std::vector<nn::Module::NamedTensor>& params,
                                     const std::vector<nn::Module::NamedTensor>& buffers) {
  std::vector<std::string> mine;
  for (const auto& p : params)
    mine.push_back("parameter '" + p.name + "' " + std::string(dtype_name(p.tensor.dtype())) + " " + shape_str(p.tensor.shape()));
  for (const auto& b : buffers)
    mine.push_back("buffer '" + b.name + "' " + std::string(dtype_name(b.tensor.dtype())) + " " + shape_str(b.tensor.shape()));
  const int world = group.world_size();
  if (world == 1) return;
  std::string joined;
  for (const auto& s : mine) joined += s + '\n';
  auto len = Tensor<std::int64_t>::empty(Shape{1}, Device::cpu(0));
  len.data()[0] = static_cast<std::int64_t>(joined.size());
  auto lens = group.all_gather(len);
  std::int64_t longest = 0;
  for (int r = 0; r < world; ++r) longest = std::max(longest, lens.data()[r]);
  auto bytes = Tensor<std::int64_t>::empty(Shape{longest}, Device::cpu(0));
  for (std::int64_t k = 0; k < longest; ++k)
    bytes.data()[k] = k < static_cast<std::int64_t>(joined.size()) ? static_cast<unsigned char>(joined[k]) : 0;
  auto all = group.all_gather(bytes);
  auto lines_of = [&](int r) {
    std::vector<std::string> lines;
    std::string cur;
    for (std::int64_t k = 0; k < lens.data()[r]; ++k) {
      const char c = static_cast<char>(all.data()[r * longest + k]);
      if (c == '\n') {
        lines.push_back(cur);
        cur.clear();
      } else {
        cur += c;
      }
    }
    return lines;
  };
  const auto ref = lines_of(0);
  for (int r = 1; r < world; ++r) {
    const auto other = lines_of(r);
    for (std::size_t k = 0; k < std::max(ref.size(), other.size()); ++k) {
      if (k < ref.size() && k < other.size() && ref[k] == other[k]) continue;
      CHORUS_FAIL("DistributedDataParallel: the ranks hold different models: entry ", k, " is ",
                  k < ref.size() ? ref[k] : std::string("missing"), " on rank 0 but ",
                  k < other.size() ? other[k] : std::string("missing"), " on rank ", r);
    }
  }
}

CHORUS_INLINE void sync_from(ProcessGroup& group, int root, const std::vector<nn::Module::NamedTensor>& params,
                             const std::vector<nn::Module::NamedTensor>& buffers, bool buffers_only) {
  if (group.world_size() == 1) return;
  NoGradGuard ng;
  std::vector<std::function<void()>> waits;
  auto start = [&](const nn::Module::NamedTensor& nt) {
    nt.tensor.visit([&](const auto& t) {
      auto c = t.is_contiguous() ? t : t.contiguous();
      auto work = group.broadcast_async(c, root, "broadcast of '" + nt.name + "' from rank " + std::to_string(root));
      waits.push_back([&group, t, c, work] {
        work->wait(group.timeout());
        if (!is_same(c, t)) backend::copy(t, c);
      });
    });
  };
  if (!buffers_only)
    for (const auto& p : params) start(p);
  for (const auto& b : buffers) start(b);
  for (auto& w : waits) w();
}

CHORUS_INLINE bool join_round(ProcessGroup& group, bool training, int& last_joiner) {
  auto flag = Tensor<std::int64_t>::empty(Shape{1}, Device::cpu(0));
  flag.data()[0] = training ? 1 : 0;
  auto flags = group.all_gather(flag);
  int last = -1;
  for (int r = 0; r < group.world_size(); ++r)
    if (flags.data()[r]) last = r;
  if (last >= 0) last_joiner = last;
  return last >= 0;
}

/// The Finalize node of dtype T of the forward being wired (made by its first parameter of T).
template <class T>
std::shared_ptr<autograd::Node<T>> finalize_node(const std::shared_ptr<Reducer>& reducer, Device device,
                                                  FinalizeSlots& finalize) {
  auto& slot = finalize[static_cast<std::size_t>(dtype_of<T>())];
  if (!slot) {
    auto node = std::make_shared<Finalize<T>>(reducer);
    node->set_stream(&current_stream(device));
    slot = node;
  }
  return std::static_pointer_cast<autograd::Node<T>>(std::static_pointer_cast<Finalize<T>>(slot));
}

CHORUS_INLINE void wire_params(const std::shared_ptr<Reducer>& reducer, Device device, FinalizeSlots& finalize,
                               std::vector<const void*>& ready_nodes) {
  const auto& params = reducer->params();
  ready_nodes.clear();
  for (std::size_t i = 0; i < params.size(); ++i) {
    params[i].tensor.visit([&](const auto& p) {
      using T = typename std::decay_t<decltype(p)>::value_type;
      if constexpr (is_floating_v<T>) {
        auto last = finalize_node<T>(reducer, device, finalize);
        auto node = std::make_shared<ParamReady<T>>(reducer, i);
        node->set_stream(&current_stream(p.device()));
        node->add_next_edge({last, 0});
        auto& impl = *p.impl();
        impl.output_nr = node->add_input(impl.shape, p.device());
        impl.grad_fn = node;
        ready_nodes.push_back(node.get());
      }
    });
  }
}

CHORUS_INLINE void unwire_params(const Reducer& reducer, FinalizeSlots& finalize) {
  for (auto& p : reducer.params())
    p.tensor.visit([](const auto& t) {
      t.impl()->grad_fn = nullptr;
      t.impl()->output_nr = 0;
    });
  for (auto& f : finalize) f.reset();
}

CHORUS_INLINE std::vector<std::vector<std::string>> bucket_names(const Reducer& reducer) {
  std::vector<std::vector<std::string>> out;
  for (const auto& b : reducer.buckets()) {
    out.emplace_back();
    for (auto i : b.members) out.back().push_back(reducer.params()[i].name);
  }
  return out;
}

CHORUS_INLINE std::vector<int> gradient_owners(const Reducer& reducer, const std::vector<AnyTensor>& opt_params,
                                               const std::vector<int>& opt_owner) {
  std::unordered_map<const void*, int> owner_of;
  for (std::size_t j = 0; j < opt_params.size(); ++j) owner_of.emplace(opt_params[j].impl_key(), opt_owner[j]);
  std::vector<int> owner;
  for (const auto& p : reducer.params()) {
    const auto it = owner_of.find(p.tensor.impl_key());
    CHORUS_CHECK(it != owner_of.end(), "DistributedDataParallel::shard_gradients: parameter '", p.name,
                 "' is not a parameter of the optimizer (build the ZeroRedundancyOptimizer over ddp.parameters())");
    owner.push_back(it->second);
  }
  return owner;
}

}  // namespace dist::detail
CHORUS_NAMESPACE_END
