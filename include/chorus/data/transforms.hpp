#pragma once
// Image transforms (torchvision's CIFAR recipe): Normalize, RandomCrop with zero padding,
// RandomHorizontalFlip, and Compose. They act on one float image [C, H, W] on the host, with a
// generator the dataset seeds per example and epoch (Note [deterministic workers]).
#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

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
    const std::int64_t ph = img.height + 2 * padding, pw = img.width + 2 * padding;
    CHORUS_CHECK(size <= ph && size <= pw, "RandomCrop: a ", size, "x", size, " crop of a padded ", ph, "x", pw,
                 " image");
    const auto y0 = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(ph - size + 1));
    const auto x0 = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(pw - size + 1));
    Image out{img.channels, size, size, std::vector<float>(static_cast<std::size_t>(img.channels * size * size), 0.f)};
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
