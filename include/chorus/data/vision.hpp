#pragma once
// Image datasets: readers for the CIFAR-10 binary format and MNIST's IDX format, a writer for
// the CIFAR-10 format (for generated data), and ImageDataset, which serves the images as float
// tensors [C, H, W] in [0, 1] through a seeded transform.
//
// CIFAR-10 binary (https://www.cs.toronto.edu/~kriz/cifar.html): records of 1 label byte and
// 3072 pixel bytes (1024 red, 1024 green, 1024 blue, row-major 32x32), in data_batch_1..5.bin
// and test_batch.bin. IDX (http://yann.lecun.com/exdb/mnist/): two zero bytes, a type byte
// (0x08 = unsigned byte), the number of dimensions, the sizes as big-endian 32-bit integers,
// then the data.
#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "../compiled.hpp"
#include "dataset.hpp"
#include "transforms.hpp"

CHORUS_NAMESPACE_BEGIN
namespace data {

/// Images as bytes [N, C, H, W] and their labels.
struct ImageSet {
  /// The size of every image: channels, height and width.
  ///@{
  std::int64_t channels = 0, height = 0, width = 0;
  ///@}
  std::vector<std::uint8_t> pixels;  ///< The pixel bytes of all images, [N][channels][height][width].
  std::vector<std::int64_t> labels;  ///< One label per image.
  /// The number of images (the number of labels).
  std::size_t size() const { return labels.size(); }
  /// channels * height * width, checked: throws for a negative size or a product beyond int64.
  std::int64_t image_bytes() const { return numel_of(Shape{channels, height, width}); }
};

namespace detail {
/// a * b, or an error naming `what` when the product exceeds `limit` (never a wrapped product).
inline std::uint64_t checked_product(std::uint64_t a, std::uint64_t b, std::uint64_t limit, const auto&... what) {
  std::uint64_t p = 0;
  CHORUS_CHECK(!__builtin_mul_overflow(a, b, &p) && p <= limit, what..., " (", a, " x ", b, " exceeds ", limit, ")");
  return p;
}
/// Checks that `set` holds exactly its images' pixel bytes (the product checked, Note [checked sizes]).
CHORUS_INLINE void check_image_set(const ImageSet& set, const char* what);
CHORUS_INLINE std::vector<std::uint8_t> read_bytes(const std::string& path, const char* what);
CHORUS_INLINE void write_bytes(const std::string& path, const std::vector<std::uint8_t>& bytes, const char* what);
}  // namespace detail

// ---- CIFAR-10 -------------------------------------------------------------------------------

/// The pixel bytes of one CIFAR-10 image (3x32x32).
inline constexpr std::int64_t kCifarImageBytes = 3 * 32 * 32;
/// The bytes of one CIFAR-10 record: the label byte, then the image.
inline constexpr std::int64_t kCifarRecordBytes = 1 + kCifarImageBytes;

/// Appends the records of one CIFAR-10 binary file to `set` (empty, or of 3x32x32 images).
CHORUS_INLINE void read_cifar10_file(const std::string& path, ImageSet& set);

/// Writes `set` (3x32x32 images, labels 0..9) as one CIFAR-10 binary file.
CHORUS_INLINE void write_cifar10_file(const std::string& path, const ImageSet& set);

/// The CIFAR-10 training (data_batch_1..5.bin) or test (test_batch.bin) images under `root`
/// (the folder holding the files, or the folder holding cifar-10-batches-bin/).
CHORUS_INLINE ImageSet read_cifar10(const std::string& root, bool train);

// ---- IDX / MNIST ----------------------------------------------------------------------------

/// An IDX file of unsigned bytes: its sizes and data.
struct IdxArray {
  std::vector<std::int64_t> dims;  ///< The size of each dimension.
  std::vector<std::uint8_t> data;  ///< The elements, row-major.
};

/// Reads an IDX file of unsigned bytes; throws on another element type, a bad header or a size mismatch.
CHORUS_INLINE IdxArray read_idx(const std::string& path);

/// MNIST (or Fashion-MNIST) from an IDX image file [N, H, W] and an IDX label file [N].
CHORUS_INLINE ImageSet read_mnist(const std::string& images_path, const std::string& labels_path);

/// MNIST's training (train-*) or test (t10k-*) files under `root`.
CHORUS_INLINE ImageSet read_mnist(const std::string& root, bool train);

// ---- ImageDataset -----------------------------------------------------------------------------

/// Serves an ImageSet as Example{float image [C, H, W] in [0, 1] after `transform`, int64 label}.
/// The transform's generator is seeded from (seed, epoch, index), so an example looks the same
/// in a given epoch whichever thread builds it (Note [deterministic workers]).
class ImageDataset {
 public:
  /// Serves `set` through `transform` (none: the images as they are), seeded by `seed`; throws
  /// when the set's pixels do not match its sizes.
  explicit ImageDataset(ImageSet set, Transform transform = {}, std::uint64_t seed = 0);

  /// The number of examples.
  std::size_t size() const { return set_->size(); }
  /// The images and labels served.
  const ImageSet& images() const { return *set_; }
  /// Sets the epoch the transform's generator is seeded with (call it before each epoch).
  void set_epoch(std::uint64_t epoch) { epoch_ = epoch; }

  /// Example i as transformed for the current epoch.
  Image image(std::size_t i) const;

  /// Example i: its transformed image as a float tensor [C, H, W] and its label as a 0-dim tensor.
  Example<Tensor<float>, Tensor<std::int64_t>> get(std::size_t i) const;

  /// The examples `idx` as a batch: images [N, C, H, W] and labels [N]; throws when the
  /// transform makes images of different sizes.
  Example<Tensor<float>, Tensor<std::int64_t>> get_batch(const std::vector<std::size_t>& idx) const;

 private:
  static std::uint64_t mix(std::uint64_t x) {  // splitmix64's finaliser
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  }

  std::shared_ptr<const ImageSet> set_;
  Transform transform_;
  std::uint64_t seed_;
  std::uint64_t epoch_ = 0;
};

}  // namespace data
CHORUS_NAMESPACE_END

#if !CHORUS_COMPILED
#include "vision_impl.hpp"
#endif
