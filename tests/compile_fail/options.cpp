// What must not compile (issue 16): each CHORUS_COMPILE_FAIL_CASE is built by its own
// compile_fail_* test, which passes only when the build fails with the expected message
// (tests/compile_fail/check.cmake). Case 0 is the control: the file compiles without a case.
#include <chorus/chorus.hpp>

using namespace chorus;

void cases() {
#if CHORUS_COMPILE_FAIL_CASE == 1  // designators out of declaration order: an error, not a silent reorder
  nn::Conv2d conv(3, 8, 3, {.padding = 1, .stride = 2});
#elif CHORUS_COMPILE_FAIL_CASE == 2  // a 2-D size takes one or two values, not three
  nn::Conv2dOptions options{.stride = {1, 2, 3}};
#elif CHORUS_COMPILE_FAIL_CASE == 3  // a fractional size is not truncated
  nn::Conv2dOptions options{.padding = 1.5};
#elif CHORUS_COMPILE_FAIL_CASE == 4  // no default (zero) Pair to half-fill with
  Pair p;
  (void)p;
#elif CHORUS_COMPILE_FAIL_CASE == 5  // a double layer in a float Sequential: a readable message
  nn::Sequential seq(nn::Linear(4, 4), nn::LinearT<double>(4, 2));
#elif CHORUS_COMPILE_FAIL_CASE == 6  // a double layer called with a float tensor: a readable message
  nn::LinearT<double> fc(4, 2);
  fc(zeros<float>({1, 4}));
#elif CHORUS_COMPILE_FAIL_CASE == 7  // MaxPool2d(2, 2) is no positional stride: options are named
  nn::MaxPool2d pool(2, 2);
#else
  nn::Conv2d conv(3, 8, 3, {.stride = 2, .padding = 1});
  nn::Sequential seq(nn::Linear(4, 4), nn::ReLU(), nn::Linear(4, 2));
  nn::MaxPool2d pool(2, {.stride = 2});
  (void)seq(zeros<float>({1, 4}));
#endif
}

int main() { cases(); }
