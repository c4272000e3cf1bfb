#pragma once
// Optimizers.
#include "adam.hpp"
#include "optimizer.hpp"
#include "sgd.hpp"
