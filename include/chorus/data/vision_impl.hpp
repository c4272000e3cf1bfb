#pragma once
// The definitions of data/vision.hpp: compiled into chorus::compiled (src/data/loader.cpp),
// included by vision.hpp itself only in the header-only form (Note [compiled chorus]).
#include <filesystem>
#include <fstream>

#include "vision.hpp"

CHORUS_NAMESPACE_BEGIN
namespace data {

namespace detail {
CHORUS_INLINE void check_image_set(const ImageSet& set, const char* what) {
  CHORUS_CHECK(set.channels >= 0 && set.height >= 0 && set.width >= 0, what, ": images of negative size ",
               set.channels, "x", set.height, "x", set.width);
  const auto per_image = static_cast<std::uint64_t>(set.image_bytes());
  const auto want = checked_product(set.size(), per_image, std::numeric_limits<std::size_t>::max(), what, ": ",
                                    set.size(), " images of ", set.channels, "x", set.height, "x", set.width,
                                    " bytes are more than a size_t counts");
  CHORUS_CHECK(set.pixels.size() == want, what, ": ", set.pixels.size(), " pixel bytes for ", set.size(),
               " images of ", set.channels, "x", set.height, "x", set.width, " (", want, " bytes)");
}
CHORUS_INLINE std::vector<std::uint8_t> read_bytes(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  CHORUS_CHECK(in.good(), what, ": cannot open '", path, "': ", std::strerror(errno));
  std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHORUS_CHECK(!in.bad(), what, ": error reading '", path, "'");
  return bytes;
}
CHORUS_INLINE void write_bytes(const std::string& path, const std::vector<std::uint8_t>& bytes, const char* what) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  CHORUS_CHECK(out.good(), what, ": cannot create '", path, "': ", std::strerror(errno));
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  out.close();
  CHORUS_CHECK(out.good(), what, ": error writing '", path, "'");
}
}  // namespace detail

// ---- CIFAR-10 -------------------------------------------------------------------------------

CHORUS_INLINE void read_cifar10_file(const std::string& path, ImageSet& set) {
  // Appending 3x32x32 records to images of another size would mislabel every pixel after them.
  CHORUS_CHECK(set.size() == 0 || (set.channels == 3 && set.height == 32 && set.width == 32),
               "CIFAR-10: cannot append '", path, "' (3x32x32 images) to a set of ", set.channels, "x", set.height,
               "x", set.width, " images");
  set.channels = 3;
  set.height = set.width = 32;
  detail::check_image_set(set, "CIFAR-10");
  const auto bytes = detail::read_bytes(path, "CIFAR-10");
  CHORUS_CHECK(!bytes.empty() && bytes.size() % kCifarRecordBytes == 0, "CIFAR-10: '", path, "' has ", bytes.size(),
               " bytes, not a positive multiple of the ", kCifarRecordBytes,
               "-byte record (1 label byte + 3x32x32 pixel bytes)");
  const std::size_t n = bytes.size() / kCifarRecordBytes;
  set.pixels.reserve(set.pixels.size() + n * kCifarImageBytes);
  for (std::size_t r = 0; r < n; ++r) {
    const std::uint8_t* rec = bytes.data() + r * kCifarRecordBytes;
    CHORUS_CHECK(rec[0] <= 9, "CIFAR-10: '", path, "': record ", r, " has label ", int(rec[0]),
                 ", outside the 10 classes 0..9");
    set.labels.push_back(rec[0]);
    set.pixels.insert(set.pixels.end(), rec + 1, rec + kCifarRecordBytes);
  }
}

CHORUS_INLINE void write_cifar10_file(const std::string& path, const ImageSet& set) {
  CHORUS_CHECK(set.channels == 3 && set.height == 32 && set.width == 32, "CIFAR-10: cannot write ", set.channels, "x",
               set.height, "x", set.width, " images (the format holds 3x32x32)");
  detail::check_image_set(set, "CIFAR-10");
  std::vector<std::uint8_t> bytes;
  bytes.reserve(set.size() * kCifarRecordBytes);
  for (std::size_t i = 0; i < set.size(); ++i) {
    CHORUS_CHECK(set.labels[i] >= 0 && set.labels[i] <= 9, "CIFAR-10: label ", set.labels[i], " of image ", i,
                 " is outside 0..9");
    bytes.push_back(static_cast<std::uint8_t>(set.labels[i]));
    const auto* px = set.pixels.data() + i * kCifarImageBytes;
    bytes.insert(bytes.end(), px, px + kCifarImageBytes);
  }
  detail::write_bytes(path, bytes, "CIFAR-10");
}

CHORUS_INLINE ImageSet read_cifar10(const std::string& root, bool train) {
  namespace fs = std::filesystem;
  fs::path dir = root;
  if (!fs::exists(dir / "test_batch.bin") && fs::exists(dir / "cifar-10-batches-bin")) dir /= "cifar-10-batches-bin";
  std::vector<fs::path> files;
  if (train)
    for (int i = 1; i <= 5; ++i) files.push_back(dir / ("data_batch_" + std::to_string(i) + ".bin"));
  else
    files.push_back(dir / "test_batch.bin");
  ImageSet set;
  for (const auto& f : files) {
    CHORUS_CHECK(fs::exists(f), "CIFAR-10: '", f.string(), "' does not exist (expected the binary version's ",
                 train ? "data_batch_1..5.bin" : "test_batch.bin", " under '", root, "')");
    read_cifar10_file(f.string(), set);
  }
  return set;
}

// ---- IDX / MNIST ----------------------------------------------------------------------------

CHORUS_INLINE IdxArray read_idx(const std::string& path) {
  const auto bytes = detail::read_bytes(path, "IDX");
  CHORUS_CHECK(bytes.size() >= 4, "IDX: '", path, "' has ", bytes.size(), " bytes, fewer than the 4-byte magic number");
  CHORUS_CHECK(bytes[0] == 0 && bytes[1] == 0, "IDX: '", path, "' is not an IDX file (its magic number starts with ",
               int(bytes[0]), ", ", int(bytes[1]), " instead of two zero bytes)");
  const int type = bytes[2], ndims = bytes[3];
  CHORUS_CHECK(type == 0x08, "IDX: '", path, "' holds element type 0x", std::hex, type, std::dec,
               "; only unsigned bytes (0x08, as in MNIST) are supported");
  CHORUS_CHECK(ndims >= 1, "IDX: '", path, "' declares 0 dimensions");
  const std::size_t header = 4 + 4 * static_cast<std::size_t>(ndims);
  CHORUS_CHECK(bytes.size() >= header, "IDX: '", path, "' is truncated: ", bytes.size(), " bytes, its header of ",
               ndims, " dimensions needs ", header);
  IdxArray a;
  for (int d = 0; d < ndims; ++d) {
    const std::uint8_t* p = bytes.data() + 4 + 4 * d;
    const std::uint32_t s = (std::uint32_t(p[0]) << 24) | (std::uint32_t(p[1]) << 16) | (std::uint32_t(p[2]) << 8) | p[3];
    a.dims.push_back(s);
  }
  // The product is checked as it grows: multiplying first and checking after lets sizes such
  // as [65536, 131072, 2^31] wrap to 0 elements and pass with no data (a size-0 dimension
  // makes any product 0, as in a tensor's shape).
  std::uint64_t count = 1;
  if (std::find(a.dims.begin(), a.dims.end(), 0) == a.dims.end())
    for (auto s : a.dims)
      count = detail::checked_product(count, static_cast<std::uint64_t>(s), std::uint64_t{1} << 40, "IDX: '", path,
                                      "': dimensions ", Shape(a.dims), " hold too many elements");
  else
    count = 0;
  CHORUS_CHECK(bytes.size() - header == count, "IDX: '", path, "' has ", bytes.size() - header,
               " bytes of data, but its dimensions ", Shape(a.dims), " need ", count);
  a.data.assign(bytes.begin() + static_cast<std::ptrdiff_t>(header), bytes.end());
  return a;
}

CHORUS_INLINE ImageSet read_mnist(const std::string& images_path, const std::string& labels_path) {
  auto images = read_idx(images_path);
  auto labels = read_idx(labels_path);
  CHORUS_CHECK(images.dims.size() == 3, "MNIST: '", images_path, "' has ", images.dims.size(),
               " dimensions, expected 3 (images, rows, columns)");
  CHORUS_CHECK(labels.dims.size() == 1, "MNIST: '", labels_path, "' has ", labels.dims.size(),
               " dimensions, expected 1 (labels)");
  CHORUS_CHECK(images.dims[0] == labels.dims[0], "MNIST: '", images_path, "' holds ", images.dims[0], " images but '",
               labels_path, "' ", labels.dims[0], " labels");
  ImageSet set;
  set.channels = 1;
  set.height = images.dims[1];
  set.width = images.dims[2];
  set.pixels = std::move(images.data);  // read_idx checked: dims[0] * dims[1] * dims[2] bytes
  for (std::size_t i = 0; i < labels.data.size(); ++i) {
    CHORUS_CHECK(labels.data[i] <= 9, "MNIST: '", labels_path, "': label ", i, " is ", int(labels.data[i]),
                 ", outside 0..9");
    set.labels.push_back(labels.data[i]);
  }
  return set;
}

CHORUS_INLINE ImageSet read_mnist(const std::string& root, bool train) {
  const std::string p = root + "/" + (train ? "train" : "t10k");
  return read_mnist(p + "-images-idx3-ubyte", p + "-labels-idx1-ubyte");
}

// ---- ImageDataset -----------------------------------------------------------------------------

CHORUS_INLINE ImageDataset::ImageDataset(ImageSet set, Transform transform, std::uint64_t seed)
    : set_(std::make_shared<const ImageSet>(std::move(set))), transform_(std::move(transform)), seed_(seed) {
  // Checked products: a wrapped size * image_bytes would pass for an empty pixel buffer and
  // every image(i) would then read far outside it.
  detail::check_image_set(*set_, "ImageDataset");
}

CHORUS_INLINE Image ImageDataset::image(std::size_t i) const {
  CHORUS_CHECK(i < size(), "ImageDataset: index ", i, " out of range for ", size(), " images");
  const auto n = static_cast<std::size_t>(set_->image_bytes());
  Image img{set_->channels, set_->height, set_->width, std::vector<float>(n)};
  const std::uint8_t* px = set_->pixels.data() + i * n;
  for (std::size_t k = 0; k < n; ++k) img.pixels[k] = static_cast<float>(px[k]) * (1.0f / 255.0f);
  if (transform_) {
    TransformRng rng(mix(mix(mix(seed_) ^ epoch_) ^ i));
    img = transform_(std::move(img), rng);
  }
  return img;
}

CHORUS_INLINE Example<Tensor<float>, Tensor<std::int64_t>> ImageDataset::get(std::size_t i) const {
  auto img = image(i);
  return {from_vector<float>(img.pixels, Shape{img.channels, img.height, img.width}),
          full<std::int64_t>({}, set_->labels[i])};
}

CHORUS_INLINE Example<Tensor<float>, Tensor<std::int64_t>> ImageDataset::get_batch(
    const std::vector<std::size_t>& idx) const {
  std::vector<float> pixels;
  std::vector<std::int64_t> labels;
  Shape shape;
  for (std::size_t k = 0; k < idx.size(); ++k) {
    auto img = image(idx[k]);
    Shape s{img.channels, img.height, img.width};
    if (k == 0) {
      shape = s;
      pixels.reserve(idx.size() * img.pixels.size());
    }
    CHORUS_CHECK(s == shape, "ImageDataset: the transform made image ", idx[k], " ", s, " but image ", idx[0], " ",
                 shape, "; a batch needs one size");
    pixels.insert(pixels.end(), img.pixels.begin(), img.pixels.end());
    labels.push_back(set_->labels[idx[k]]);
  }
  const auto b = static_cast<std::int64_t>(idx.size());
  return {from_vector<float>(pixels, Shape{b, shape.size() ? shape[0] : 0, shape.size() ? shape[1] : 0,
                                           shape.size() ? shape[2] : 0}),
          from_vector<std::int64_t>(labels, Shape{b})};
}

}  // namespace data
CHORUS_NAMESPACE_END
