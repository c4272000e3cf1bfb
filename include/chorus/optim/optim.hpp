#pragma once
// Optimizers.
#include "adam.hpp"
#include "lr_scheduler.hpp"
#include "optimizer.hpp"
#include "sgd.hpp"
