#pragma once
// The definitions of io/safetensors.hpp: compiled into chorus::compiled (src/io/safetensors.cpp),
// included by safetensors.hpp itself in the header-only form. JSON (nlohmann::json) is only
// seen here, so a program of the compiled form does not parse it (Note [compiled chorus]).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "safetensors.hpp"

CHORUS_NAMESPACE_BEGIN
namespace io {
namespace detail {

/// Reads exactly `n` bytes at `offset`; throws on an error or an early end of file.
CHORUS_INLINE void pread_exact(int fd, void* dst, std::size_t n, std::uint64_t offset, const std::string& what) {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, std::min<std::size_t>(n, std::size_t{1} << 30), static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    CHORUS_CHECK(r >= 0, "safetensors: error reading ", what, ": ", std::strerror(errno));
    CHORUS_CHECK(r > 0, "safetensors: ", what, " ended early at byte ", offset,
                 " (was it truncated while being read?)");
    p += r;
    n -= static_cast<std::size_t>(r);
    offset += static_cast<std::uint64_t>(r);
  }
}

inline constexpr std::size_t kMaxHeader = std::size_t{100} << 20;  // as the reference implementation

CHORUS_INLINE const char* dtype_code(DType d) {
  switch (d) {
    case DType::Float32: return "F32";
    case DType::Float64: return "F64";
    case DType::Int64: return "I64";
    case DType::BFloat16: return "BF16";
    case DType::Float16: return "F16";
  }
  return "?";
}

CHORUS_INLINE DType parse_dtype(const std::string& code, const std::string& name, const std::string& what) {
  if (code == "F32") return DType::Float32;
  if (code == "F64") return DType::Float64;
  if (code == "I64") return DType::Int64;
  if (code == "BF16") return DType::BFloat16;
  if (code == "F16") return DType::Float16;
  static const std::set<std::string> known = {"BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16",
                                              "I32",  "U32", "U64"};
  if (known.count(code))
    CHORUS_FAIL("safetensors: ", what, ": tensor '", name, "' has dtype ", code,
                ", which chorus does not hold (F32, F64, BF16, F16 and I64 are supported)");
  CHORUS_FAIL("safetensors: ", what, ": tensor '", name, "' has unknown dtype '", code, "'");
}

/// Checks the 8-byte header length of a file of `file_size` bytes (before anything else is read).
CHORUS_INLINE std::size_t check_header_length(std::uint64_t n, std::uint64_t file_size, const std::string& what) {
  CHORUS_CHECK(file_size >= 8, "safetensors: ", what, " is truncated: ", file_size,
               " bytes, fewer than the 8-byte header length");
  CHORUS_CHECK(n <= kMaxHeader, "safetensors: ", what, ": header length ", n,
               " exceeds the 100 MiB limit (is it a safetensors file?)");
  CHORUS_CHECK(n <= file_size - 8, "safetensors: ", what, ": header length ", n, " runs past the end of the file (",
               file_size, " bytes)");
  return static_cast<std::size_t>(n);
}

/// Parses and validates the JSON header (`header`, `n` bytes) of a file whose data section
/// holds `data_size` bytes (see Note [checkpoint safety]).
CHORUS_INLINE File parse_header(const std::uint8_t* header_bytes, std::size_t n, std::size_t data_size,
                         const std::string& what) {
  File f;
  f.data_start = 8 + n;
  f.source = what;

  std::set<std::string> seen;
  std::string duplicate;
  auto on_event = [&](int depth, nlohmann::json::parse_event_t ev, nlohmann::json& parsed) {
    if (ev == nlohmann::json::parse_event_t::key && depth == 1 && !seen.insert(parsed.get<std::string>()).second)
      duplicate = parsed.get<std::string>();
    return true;
  };
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(header_bytes, header_bytes + n, on_event);
  } catch (const nlohmann::json::exception& e) {
    CHORUS_FAIL("safetensors: ", what, ": the header is not valid JSON (", e.what(), ")");
  }
  CHORUS_CHECK(duplicate.empty(), "safetensors: ", what, ": tensor name '", duplicate, "' appears twice in the header");
  CHORUS_CHECK(header.is_object(), "safetensors: ", what, ": the header is not a JSON object");

  std::vector<std::pair<std::size_t, std::size_t>> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      CHORUS_CHECK(v.is_object(), "safetensors: ", what, ": __metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        CHORUS_CHECK(m.value().is_string(), "safetensors: ", what, ": metadata '", m.key(), "' is not a string");
        f.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    CHORUS_CHECK(v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"),
                 "safetensors: ", what, ": entry '", name, "' needs dtype, shape and data_offsets");
    CHORUS_CHECK(v["dtype"].is_string(), "safetensors: ", what, ": dtype of '", name, "' is not a string");
    TensorRecord r;
    r.dtype = parse_dtype(v["dtype"].get<std::string>(), name, what);
    CHORUS_CHECK(v["shape"].is_array() && v["shape"].size() <= static_cast<std::size_t>(Dims::kMaxDims),
                 "safetensors: ", what, ": shape of '", name, "' is not an array of at most ", Dims::kMaxDims,
                 " sizes");
    std::uint64_t numel = 1;
    bool overflow = false;
    for (const auto& d : v["shape"]) {
      CHORUS_CHECK(d.is_number_unsigned(), "safetensors: ", what, ": shape of '", name,
                   "' holds something other than non-negative integers");
      const auto s = d.get<std::uint64_t>();
      CHORUS_CHECK(s <= (std::uint64_t{1} << 48), "safetensors: ", what, ": size ", s, " in the shape of '", name,
                   "' is too large");
      r.shape.push_back(static_cast<std::int64_t>(s));
      if (s != 0 && numel > (std::uint64_t{1} << 60) / s) overflow = true;
      numel *= s;
    }
    const auto& off = v["data_offsets"];
    CHORUS_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
                 "safetensors: ", what, ": data_offsets of '", name, "' is not a pair of non-negative integers");
    const auto b = off[0].get<std::uint64_t>(), e = off[1].get<std::uint64_t>();
    CHORUS_CHECK(b <= e && e <= data_size, "safetensors: ", what, ": data_offsets [", b, ", ", e, ") of '", name,
                 "' are out of range for ", data_size, " bytes of data");
    CHORUS_CHECK(!overflow, "safetensors: ", what, ": '", name, "' has shape ", r.shape, " and dtype ",
                 dtype_code(r.dtype), ", whose byte count overflows (its data_offsets span ", e - b, " bytes)");
    CHORUS_CHECK(numel * dtype_size(r.dtype) == e - b, "safetensors: ", what, ": '", name, "' has shape ", r.shape,
                 " and dtype ", dtype_code(r.dtype), " (", numel * dtype_size(r.dtype),
                 " bytes) but its data_offsets span ", e - b, " bytes");
    r.begin = static_cast<std::size_t>(b);
    r.end = static_cast<std::size_t>(e);
    ranges.push_back({r.begin, r.end});
    f.tensors.emplace(name, r);
  }
  // The tensors must tile the data section exactly: no overlaps, no holes.
  std::sort(ranges.begin(), ranges.end());
  std::size_t pos = 0;
  for (const auto& [b, e] : ranges) {
    CHORUS_CHECK(b >= pos, "safetensors: ", what, ": tensor data overlap at byte ", b);
    CHORUS_CHECK(b == pos, "safetensors: ", what, ": bytes [", pos, ", ", b, ") of the data belong to no tensor");
    pos = e;
  }
  CHORUS_CHECK(pos == data_size, "safetensors: ", what, ": bytes [", pos, ", ", data_size,
               ") of the data belong to no tensor");
  return f;
}

/// Parses and validates a file image held in memory.
CHORUS_INLINE File parse(std::vector<std::uint8_t> bytes, const std::string& what) {
  std::uint64_t n = 0;
  if (bytes.size() >= 8) std::memcpy(&n, bytes.data(), 8);
  const std::size_t len = check_header_length(n, bytes.size(), what);
  File f = parse_header(bytes.data() + 8, len, bytes.size() - 8 - len, what);
  f.bytes = std::move(bytes);
  return f;
}

/// Opens, checks and parses a file on disk: the 8-byte length first, then the header only;
/// the file stays open for File::read_into (Note [checkpoint safety]).
CHORUS_INLINE File read_file(const std::string& path) {
  const std::string what = "'" + path + "'";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  CHORUS_CHECK(fd >= 0, "safetensors: cannot open ", what, ": ", std::strerror(errno));
  auto handle = std::make_shared<FileHandle>(fd);
  struct stat st {};
  CHORUS_CHECK(::fstat(fd, &st) == 0, "safetensors: cannot stat ", what, ": ", std::strerror(errno));
  CHORUS_CHECK(!S_ISDIR(st.st_mode), "safetensors: ", what, " is a directory, not a safetensors file");
  CHORUS_CHECK(S_ISREG(st.st_mode), "safetensors: ", what, " is not a regular file");
  const auto size = static_cast<std::uint64_t>(st.st_size);
  std::uint64_t n = 0;
  if (size >= 8) pread_exact(fd, &n, 8, 0, what);
  const std::size_t len = check_header_length(n, size, what);
  std::vector<std::uint8_t> header(len);
  pread_exact(fd, header.data(), len, 8, what);
  File f = parse_header(header.data(), len, static_cast<std::size_t>(size - 8 - len), what);
  f.file = std::move(handle);
  return f;
}

/// Writes `bytes` to `path` atomically (Note [checkpoint safety]).
CHORUS_INLINE void write_atomically(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  // A unique name without std::random_device, whose constructor may throw std::system_error
  // (no entropy source): only chorus::Error leaves the library.
  static std::atomic<std::uint64_t> counter{0};
  const auto stamp = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(stamp) + "." +
                          std::to_string(counter.fetch_add(1));
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  CHORUS_CHECK(fd >= 0, "safetensors: cannot create '", tmp, "': ", std::strerror(errno));
  auto fail = [&](const char* step) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    CHORUS_FAIL("safetensors: ", step, " '", path, "' failed: ", std::strerror(err), "; the previous file is intact");
  };
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) fail("writing");
    done += static_cast<std::size_t>(w);
  }
  if (::fsync(fd) != 0) fail("flushing");
  if (::close(fd) != 0) {
    fd = -1;
    ::unlink(tmp.c_str());
    CHORUS_FAIL("safetensors: closing '", tmp, "' failed: ", std::strerror(errno));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    CHORUS_FAIL("safetensors: renaming '", tmp, "' to '", path, "' failed: ", std::strerror(err));
  }
}

/// Serialises named tensors (copied to the host) with metadata.
/// Refuses a tensor that views no memory: a FullyShardedDataParallel's parameter between uses
/// (Note [unsharded parameter memory] in parallel/shard_unit.hpp).
template <class T>
void check_has_memory(const Tensor<T>& x, const std::string& name) {
  CHORUS_CHECK(x.numel() == 0 || x.data() != nullptr, "safetensors: '", name,
               "' holds no memory: it is a parameter a FullyShardedDataParallel shards; save the "
               "wrapper's full_state_dict(), or the module while the wrapper's summon_full_params() guard lives");
}

CHORUS_INLINE std::vector<std::uint8_t> serialise(const std::vector<nn::Module::NamedTensor>& tensors, const Metadata& meta) {
  nlohmann::json header = nlohmann::json::object();
  if (!meta.empty()) header["__metadata__"] = meta;
  std::vector<std::vector<std::uint8_t>> blobs;
  std::size_t offset = 0;
  std::set<std::string> names;
  for (const auto& t : tensors) {
    CHORUS_CHECK(names.insert(t.name).second, "safetensors: two tensors are named '", t.name, "'");
    CHORUS_CHECK(t.name != "__metadata__", "safetensors: a tensor may not be named __metadata__");
    std::vector<std::uint8_t> blob(t.tensor.nbytes());
    t.tensor.visit([&](const auto& x) {
      check_has_memory(x, t.name);
      auto v = x.to_vector();
      if (!v.empty()) std::memcpy(blob.data(), v.data(), blob.size());
    });
    header[t.name] = {{"dtype", dtype_code(t.tensor.dtype())},
                      {"shape", t.tensor.shape().vec()},
                      {"data_offsets", {offset, offset + blob.size()}}};
    offset += blob.size();
    blobs.push_back(std::move(blob));
  }
  std::string h;
  try {
    h = header.dump();
  } catch (const nlohmann::json::exception& e) {  // e.g. a name or metadata that is not UTF-8
    CHORUS_FAIL("safetensors: cannot write the header: ", e.what());
  }
  h.append((8 - h.size() % 8) % 8, ' ');  // keep the data 8-byte aligned
  std::vector<std::uint8_t> out(8 + h.size() + offset);
  const std::uint64_t n = h.size();
  std::memcpy(out.data(), &n, 8);
  std::memcpy(out.data() + 8, h.data(), h.size());
  std::size_t pos = 8 + h.size();
  for (const auto& b : blobs) {
    if (!b.empty()) std::memcpy(out.data() + pos, b.data(), b.size());
    pos += b.size();
  }
  return out;
}

}  // namespace detail

/// Reads and validates a safetensors file's header; tensors are read from the (open) file
/// when loaded (Note [checkpoint safety]).
CHORUS_INLINE File read(const std::string& path) { return detail::read_file(path); }

/// Validates an in-memory safetensors image.
CHORUS_INLINE File parse(std::span<const std::uint8_t> bytes) {
  return detail::parse(std::vector<std::uint8_t>(bytes.begin(), bytes.end()), "buffer");
}

/// Copies a file's tensors into `module`'s parameters and buffers (matched by dotted name,
/// dtype and shape; every tensor of each side must be matched). On any mismatch it throws
/// and leaves the module unchanged (Note [checkpoint safety]).
CHORUS_INLINE void load_into(nn::Module& module, const File& f, const std::string& what,
                             const LoadOptions& options) {
  std::vector<std::pair<std::string, detail::Source>> sources;
  for (const auto& [name, rec] : f.tensors) {
    detail::Source s{rec.dtype, rec.shape, nullptr};
    s.write = [&f, &r = rec, n = name](AnyTensor& t) {
      t.visit([&](auto& x) {
        using T = typename std::decay_t<decltype(x)>::value_type;
        detail::check_has_memory(x, n);
        if (r.dtype != x.dtype()) {  // checked: both floating, convert_dtype asked
          visit_dtype(r.dtype, [&](auto tag) {
            using F = decltype(tag);
            if constexpr (is_floating_v<F> && is_floating_v<T>)
              backend::copy(x, detail::host_tensor<F>(f, r).template to<T>().to(x.device()));
          });
        } else if (x.device().is_cpu() && x.is_contiguous()) {
          f.read_into(r, x.data());  // straight into the tensor's storage
        } else {
          backend::copy(x, detail::host_tensor<T>(f, r));
        }
      });
      return true;
    };
    sources.emplace_back(name, std::move(s));
  }
  detail::load_named(module, sources, {what, "the file"}, options);
}

}  // namespace io
CHORUS_NAMESPACE_END
