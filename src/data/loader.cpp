// chorus::compiled: the data loader's option checks, the image transforms and the CIFAR-10 /
// MNIST readers of data/ (Note [compiled chorus] in include/chorus/compiled.hpp).
#include <chorus/data/dataloader_impl.hpp>
#include <chorus/data/transforms_impl.hpp>
#include <chorus/data/vision_impl.hpp>
