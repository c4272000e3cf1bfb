#pragma once
// Checkpoints in the safetensors format (https://github.com/huggingface/safetensors):
// an 8-byte little-endian header length N, N bytes of JSON mapping each tensor name to
// {dtype, shape, data_offsets} (plus an optional "__metadata__" of strings), then the raw
// little-endian data. Module files are keyed by named_parameters()/named_buffers() names, so
// they load into the state_dict of the equivalent PyTorch module and back.
//
// Note [checkpoint safety]
// Loading validates the whole file against the module before writing a single value, so a
// bad file leaves the module unchanged. Reading checks the 8-byte header length first and then
// reads only the header (a large file that is not a checkpoint costs 8 bytes, not its size);
// tensors are then read straight from the file into their storage (CPU) or a host staging
// tensor (CUDA), never through a copy of the whole file. Only an I/O error after validation
// (a disk error, the file truncated while being read) can leave a module part-loaded, and
// the error says so. Saving writes a temporary file in the destination's folder, flushes it
// to disk and renames it over the destination, so a failure part-way leaves the previous
// checkpoint intact.
#include <unistd.h>

#include <bit>
#include <memory>
#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "../compiled.hpp"
#include "../nn/module.hpp"
#include "state.hpp"
#include "../optim/optimizer.hpp"  // save(module) steps aside for save(optimizer) (io/optimizer.hpp)

CHORUS_NAMESPACE_BEGIN
namespace io {

static_assert(std::endian::native == std::endian::little, "the safetensors reader assumes a little-endian host");

/// Free-form string metadata stored in the header's "__metadata__".
using Metadata = std::map<std::string, std::string>;

/// One tensor of a parsed file: where its bytes are inside the data section.
struct TensorRecord {
  DType dtype;  ///< The tensor's dtype.
  Shape shape;  ///< The tensor's shape.
  /// Byte offsets of the tensor's first byte and one past its last, in the data section.
  ///@{
  std::size_t begin = 0, end = 0;
  ///@}
};

namespace detail {
/// An open file descriptor, closed on destruction.
class FileHandle {
 public:
  explicit FileHandle(int fd) : fd_(fd) {}
  ~FileHandle() { ::close(fd_); }
  FileHandle(const FileHandle&) = delete;
  FileHandle& operator=(const FileHandle&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

/// Reads exactly `n` bytes at `offset`; throws on an error or an early end of file.
CHORUS_INLINE void pread_exact(int fd, void* dst, std::size_t n, std::uint64_t offset, const std::string& what);
}  // namespace detail

/// A parsed and validated safetensors file: its header, and where the data is (a file kept
/// open by read(), or an in-memory image given to parse()).
struct File {
  Metadata metadata;                            ///< The header's "__metadata__".
  std::map<std::string, TensorRecord> tensors;  ///< The tensors, by name.
  std::size_t data_start = 0;                   ///< Where the data section starts: 8 + the header's length.
  std::string source;                           ///< For messages: the quoted path, or "buffer".
  std::vector<std::uint8_t> bytes;              ///< The image given to parse(); empty for read().
  std::shared_ptr<detail::FileHandle> file;     ///< The open file of read(); null for parse().

  /// Copies the bytes of tensor `r` (r.end - r.begin of them) to host memory at `dst`.
  void read_into(const TensorRecord& r, void* dst) const {
    const std::size_t n = r.end - r.begin;
    if (n == 0) return;
    if (file) {
      detail::pread_exact(file->get(), dst, n, data_start + r.begin, source);
    } else {
      std::memcpy(dst, bytes.data() + data_start + r.begin, n);
    }
  }
};

namespace detail {
/// The safetensors code of a dtype ("F32", "BF16", ...).
CHORUS_INLINE const char* dtype_code(DType d);
/// Parses and validates the JSON header (`header`, `n` bytes) of a file whose data section
/// holds `data_size` bytes (see Note [checkpoint safety]).
CHORUS_INLINE File parse_header(const std::uint8_t* header_bytes, std::size_t n, std::size_t data_size,
                                const std::string& what);
/// Parses and validates a file image held in memory.
CHORUS_INLINE File parse(std::vector<std::uint8_t> bytes, const std::string& what);
/// Opens, checks and parses a file on disk: the 8-byte length first, then the header only;
/// the file stays open for File::read_into (Note [checkpoint safety]).
CHORUS_INLINE File read_file(const std::string& path);
/// Writes `bytes` to `path` atomically (Note [checkpoint safety]).
CHORUS_INLINE void write_atomically(const std::string& path, const std::vector<std::uint8_t>& bytes);
/// Serialises named tensors (copied to the host) with metadata.
CHORUS_INLINE std::vector<std::uint8_t> serialise(const std::vector<nn::Module::NamedTensor>& tensors,
                                                  const Metadata& meta);

/// A host tensor holding a record's bytes.
template <class T>
Tensor<T> host_tensor(const File& f, const TensorRecord& r) {
  auto t = Tensor<T>::empty(r.shape, Device::cpu());
  f.read_into(r, t.data());
  return t;
}

}  // namespace detail

/// Reads and validates a safetensors file's header; tensors are read from the (open) file
/// when loaded (Note [checkpoint safety]).
CHORUS_INLINE File read(const std::string& path);

/// Validates an in-memory safetensors image.
CHORUS_INLINE File parse(std::span<const std::uint8_t> bytes);

/// Copies a file's tensors into `module`'s parameters and buffers (matched by dotted name,
/// dtype and shape; every tensor of each side must be matched). On any mismatch it throws
/// and leaves the module unchanged (Note [checkpoint safety]).
CHORUS_INLINE void load_into(nn::Module& module, const File& f, const std::string& what = "checkpoint",
                             const LoadOptions& options = {});

}  // namespace io

/// Saves a module's parameters and buffers (a DataParallel saves its wrapped module, under
/// the names its named_tensors() gives: with set_name_prefix("module."), PyTorch's).
template <class M>
  requires(!std::is_base_of_v<optim::Optimizer, M>)
void save(const M& module, const std::string& path, const io::Metadata& metadata = {}) {
  if constexpr (requires { module.name_prefix(); }) {
    io::detail::write_atomically(path, io::detail::serialise(module.named_tensors(), metadata));
  } else {
    io::detail::write_atomically(path, io::detail::serialise(nn::module_of(module).named_tensors(), metadata));
  }
}

/// Loads a checkpoint written by save() (or by safetensors' save_file) into a module (a
/// DataParallel with a name prefix strips it, unless options say otherwise).
template <class M>
  requires(!std::is_base_of_v<optim::Optimizer, M>)
void load(M& module, const std::string& path, io::LoadOptions options = {}) {
  if constexpr (requires { module.name_prefix(); })
    if (options.strip_prefix.empty()) options.strip_prefix = module.name_prefix();
  auto f = io::read(path);
  io::load_into(nn::module_of(module), f, "'" + path + "'", options);
}

CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "safetensors_impl.hpp"
#endif
