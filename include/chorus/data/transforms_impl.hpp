#pragma once
// The definitions of data/transforms.hpp: compiled into chorus::compiled (src/data/loader.cpp),
// included by transforms.hpp itself only in the header-only form (Note [compiled chorus]).
#include <random>

#include "transforms.hpp"

CHORUS_NAMESPACE_BEGIN
namespace data {

namespace detail {
CHORUS_INLINE void check_image(const Image& img, const char* what) {
  CHORUS_CHECK(img.channels >= 0 && img.height >= 0 && img.width >= 0, what, ": an image of negative size ",
               img.channels, "x", img.height, "x", img.width);
  const auto n = numel_of(Shape{img.channels, img.height, img.width});
  CHORUS_CHECK(img.pixels.size() == static_cast<std::uint64_t>(n), what, ": a ", img.channels, "x", img.height, "x",
               img.width, " image needs ", n, " pixels, it holds ", img.pixels.size());
}
}  // namespace detail

namespace transforms {

// ---- Normalize ----

CHORUS_INLINE Normalize::Normalize(std::vector<float> mean_, std::vector<float> std_)
    : mean(std::move(mean_)), std(std::move(std_)) {
  CHORUS_CHECK(mean.size() == std.size() && !mean.empty(), "Normalize: ", mean.size(), " means and ", std.size(),
               " standard deviations");
  for (float s : std) CHORUS_CHECK(s > 0, "Normalize: a standard deviation of ", s, " (must be positive)");
}

CHORUS_INLINE Image Normalize::operator()(Image img, TransformRng&) const {
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

// ---- RandomCrop ----

CHORUS_INLINE RandomCrop::RandomCrop(std::int64_t size_, std::int64_t padding_) : size(size_), padding(padding_) {
  CHORUS_CHECK(size > 0 && padding >= 0, "RandomCrop: size ", size, " and padding ", padding);
}

CHORUS_INLINE Image RandomCrop::operator()(const Image& img, TransformRng& rng) const {
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

// ---- RandomHorizontalFlip ----

CHORUS_INLINE Image RandomHorizontalFlip::operator()(Image img, TransformRng& rng) const {
  detail::check_image(img, "RandomHorizontalFlip");
  if (std::uniform_real_distribution<double>(0.0, 1.0)(rng) >= p) return img;
  for (std::int64_t c = 0; c < img.channels; ++c)
    for (std::int64_t y = 0; y < img.height; ++y) {
      float* row = img.pixels.data() + (c * img.height + y) * img.width;
      std::reverse(row, row + img.width);
    }
  return img;
}

// ---- Compose ----

CHORUS_INLINE Image Compose::operator()(Image img, TransformRng& rng) const {
  for (const auto& t : transforms) img = t(std::move(img), rng);
  return img;
}

}  // namespace transforms
}  // namespace data
CHORUS_NAMESPACE_END
