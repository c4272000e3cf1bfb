#pragma once
// Image transforms (torchvision's CIFAR recipe): Normalize, RandomCrop with zero padding,
// RandomHorizontalFlip, and Compose. They act on one float image [C, H, W] on the host, with a
// generator the dataset seeds per example and epoch (Note [deterministic workers]).
#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "../core/shape.hpp"
#include "../error.hpp"

CHORUS_NAMESPACE_BEGIN
namespace data {

/// One image on the host, channels-first.
struct Image {
  std::int64_t channels = 0, height = 0, width = 0;
  std::vector<float> pixels;  // [channels][height][width]
  float& at(std::int64_t c, std::int64_t y, std::int64_t x) { return pixels[(c * height + y) * width + x]; }
  float at(std::int64_t c, std::int64_t y, std::int64_t x) const { return pixels[(c * height + y) * width + x]; }
};

namespace detail {
/// Checks an image's sizes against its pixels before a transform indexes them (a hand-built
/// Image may disagree; the product is checked, Note [checked sizes]).
inline void check_image(const Image& img, const char* what) {
  CHORUS_CHECK(img.channels >= 0 && img.height >= 0 && img.width >= 0, what, ": an image of negative size ",
               img.channels, "x", img.height, "x", img.width);
  const auto n = numel_of(Shape{img.channels, img.height, img.width});
  CHORUS_CHECK(img.pixels.size() == static_cast<std::uint64_t>(n), what, ": a ", img.channels, "x", img.height, "x",
               img.width, " image needs ", n, " pixels, it holds ", img.pixels.size());
}
}  // namespace detail

/// The generator a transform draws from.
using TransformRng = std::mt19937_64;
/// A transform: an image (and a generator) to an image.
using Transform = std::function<Image(Image, TransformRng&)>;

namespace transforms {

/// (x - mean[c]) / std[c] per channel.
struct Normalize {
  std::vector<float> mean, std;
  Normalize(std::vector<float> mean_, std::vector<float> std_) : mean(std::move(mean_)), std(std::move(std_)) {
    CHORUS_CHECK(mean.size() == std.size() && !mean.empty(), "Normalize: ", mean.size(), " means and ", std.size(),
                 " standard deviations");
    for (float s : std) CHORUS_CHECK(s > 0, "Normalize: a standard deviation of ", s, " (must be positive)");
  }
  Image operator()(Image img, TransformRng&) const {
    detail::check_image(img, "Normalize");
    CHORUS_CHECK(static_cast<std::size_t>(img.channels) == mean.size(), "Normalize: the image has ", img.channels,
                 " channels, the transform ", mean.size());
    const std::int64_t plane = img.height * img.width;
    for (std::int64_t c = 0; c < img.channels; ++c) {
      const float m = mean[c], inv = 1.0f / std[c];
      float* p = img.pixels.data() + c * plane;
      for (std::int64_t i = 0; i < plane; ++i) p[i] = (p[i] - m) * inv;
    }
    return img;
  }
};

/// Pads each side with `padding` zeros, then crops a size × size window at a random offset.
struct RandomCrop {
  std::int64_t size, padding;
  explicit RandomCrop(std::int64_t size_, std::int64_t padding_ = 0) : size(size_), padding(padding_) {
    CHORUS_CHECK(size > 0 && padding >= 0, "RandomCrop: size ", size, " and padding ", padding);
  }
  Image operator()(const Image& img, TransformRng& rng) const {
    detail::check_image(img, "RandomCrop");
    // Checked: a huge padding must be an error, not a signed overflow.
    std::int64_t pad2 = 0, ph = 0, pw = 0;
    const bool overflow = __builtin_mul_overflow(padding, std::int64_t{2}, &pad2) ||
                          __builtin_add_overflow(img.height, pad2, &ph) || __builtin_add_overflow(img.width, pad2, &pw);
    CHORUS_CHECK(!overflow, "RandomCrop: padding ", padding, " of a ", img.height, "x", img.width,
                 " image overflows an int64");
    const auto out_pixels = numel_of(Shape{img.channels, size, size});
    CHORUS_CHECK(size <= ph && size <= pw, "RandomCrop: a ", size, "x", size, " crop of a padded ", ph, "x", pw,
                 " image");
    const auto y0 = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(ph - size + 1));
    const auto x0 = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(pw - size + 1));
    Image out{img.channels, size, size, std::vector<float>(static_cast<std::size_t>(out_pixels), 0.f)};
    for (std::int64_t c = 0; c < img.channels; ++c)
      for (std::int64_t y = 0; y < size; ++y) {
        const std::int64_t sy = y0 + y - padding;
        if (sy < 0 || sy >= img.height) continue;
        for (std::int64_t x = 0; x < size; ++x) {
          const std::int64_t sx = x0 + x - padding;
          if (sx >= 0 && sx < img.width) out.at(c, y, x) = img.at(c, sy, sx);
        }
      }
    return out;
  }
};

/// Mirrors the image left-right with probability p.
struct RandomHorizontalFlip {
  double p = 0.5;
  Image operator()(Image img, TransformRng& rng) const {
    detail::check_image(img, "RandomHorizontalFlip");
    if (std::uniform_real_distribution<double>(0.0, 1.0)(rng) >= p) return img;
    for (std::int64_t c = 0; c < img.channels; ++c)
      for (std::int64_t y = 0; y < img.height; ++y) {
        float* row = img.pixels.data() + (c * img.height + y) * img.width;
        std::reverse(row, row + img.width);
      }
    return img;
  }
};

/// Applies transforms in order.
struct Compose {
  std::vector<Transform> transforms;
  Image operator()(Image img, TransformRng& rng) const {
    for (const auto& t : transforms) img = t(std::move(img), rng);
    return img;
  }
};

}  // namespace transforms
}  // namespace data
CHORUS_NAMESPACE_END
