#pragma once
// The definitions of io/state.hpp: compiled into chorus::compiled (src/io/state.cpp), included
// by state.hpp itself in the header-only form (Note [compiled chorus]).
#include "state.hpp"

CHORUS_NAMESPACE_BEGIN
namespace io {
namespace detail {

CHORUS_INLINE std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size() && i < 8; ++i) s += (i ? ", " : "") + ("'" + v[i] + "'");
  if (v.size() > 8) s += ", … (" + std::to_string(v.size()) + " in all)";
  return s;
}

CHORUS_INLINE std::string common_prefix(const std::set<std::string>& from, const std::set<std::string>& to) {
  if (from.empty() || from.size() != to.size()) return {};
  const std::string& first = *from.begin();
  for (std::size_t dot = first.find('.'); dot != std::string::npos; dot = first.find('.', dot + 1)) {
    const std::string p = first.substr(0, dot + 1);
    bool all = true;
    for (const auto& k : from) {
      if (k.compare(0, p.size(), p) != 0 || !to.count(k.substr(p.size()))) {
        all = false;
        break;
      }
    }
    if (all) return p;
  }
  return {};
}

CHORUS_INLINE void load_named(nn::Module& module, const std::vector<std::pair<std::string, Source>>& sources,
                              const SourceWords& words, const LoadOptions& options) {
  const std::string& what = words.what;
  auto named = module.named_tensors();
  std::map<std::string, const Source*> by_name;  // under the names they are matched by
  std::map<std::string, std::string> original;   // matched name -> the source's own name
  const std::string& prefix = options.strip_prefix;
  for (const auto& [name, s] : sources) {
    std::string key = !prefix.empty() && name.compare(0, prefix.size(), prefix) == 0 ? name.substr(prefix.size()) : name;
    auto [it, fresh] = original.emplace(key, name);
    CHORUS_CHECK(fresh, "load: ", what, ": '", it->second, "' and '", name, "' both load into '", key,
                 "' once the prefix '", prefix, "' is stripped");
    by_name.emplace(key, &s);
  }
  std::vector<std::string> missing, unexpected;
  std::set<std::string> names, source_names;
  std::set<const void*> loaded;  // tensors some source name loads
  for (const auto& t : named)
    if (by_name.count(t.name)) loaded.insert(t.tensor.impl_key());
  for (const auto& t : named) {
    names.insert(t.name);
    // A tied tensor (Note [tied parameters]) loads through any one of its names: files often
    // hold it once.
    if (!by_name.count(t.name) && !loaded.count(t.tensor.impl_key())) missing.push_back(t.name);
  }
  std::erase_if(named, [&](const nn::Module::NamedTensor& t) { return !by_name.count(t.name); });
  for (const auto& [name, s] : by_name) {
    source_names.insert(name);
    if (!names.count(name)) unexpected.push_back(original.at(name));
  }
  if (!missing.empty() || !unexpected.empty()) {
    // Name both sides, and the likely cause when the names differ only by a prefix.
    std::string msg = "load: the tensor names of " + what + " do not match the module's:";
    if (!missing.empty())
      msg += " " + words.noun + " lacks " + std::to_string(missing.size()) + " tensor(s) of the module: " +
             join(missing) + ";";
    if (!unexpected.empty())
      msg += " " + words.noun + " has " + std::to_string(unexpected.size()) + " tensor(s) the module lacks: " +
             join(unexpected) + ";";
    if (auto p = common_prefix(source_names, names); !p.empty()) {
      msg += " every name in " + words.noun + " is the module's name prefixed with '" + p + "'" +
             (p == "module." && words.noun == "the file" ? " (as saved from a model wrapped in PyTorch's nn.DataParallel)"
                                                        : "") +
             ": load with io::LoadOptions{.strip_prefix = \"" + prefix + p + "\"}";
    } else if (auto q = common_prefix(names, source_names); !q.empty()) {
      msg += " every name of the module is the name in " + words.noun + " prefixed with '" + q +
             "': load into that submodule instead";
    }
    if (msg.back() == ';') msg.pop_back();
    CHORUS_FAIL(msg);
  }
  for (const auto& t : named) {
    const auto& s = *by_name.at(t.name);
    const DType md = t.tensor.dtype();
    const bool convertible = is_floating_dtype(s.dtype) && is_floating_dtype(md);
    CHORUS_CHECK(s.dtype == md || (convertible && options.convert_dtype), "load: '", t.name, "' is ",
                 dtype_name(s.dtype), " in ", what, " but ", dtype_name(md), " in the module",
                 convertible ? "; load with io::LoadOptions{.convert_dtype = true} to convert it" : "");
    CHORUS_CHECK(s.shape == t.tensor.shape(), "load: '", t.name, "' has shape ", s.shape, " in ", what,
                 " but shape ", t.tensor.shape(), " in the module");
  }
  NoGradGuard g;  // everything checked: now write
  try {
    for (auto& t : named) {
      if (by_name.at(t.name)->write(t.tensor))
        t.tensor.visit([](auto& x) { x.bump_version(); });  // Note [version counter]
    }
  } catch (const Error& e) {
    CHORUS_FAIL("load: ", what, ": ", e.what(), "; the source was valid when checked, so the module may now be "
                "partly loaded");
  }
}

}  // namespace detail
}  // namespace io
CHORUS_NAMESPACE_END
