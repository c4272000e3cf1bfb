#pragma once
// Modules, layers, losses and initialisation.
#include "attention.hpp"
#include "conv.hpp"
#include "embedding.hpp"
#include "functional.hpp"
#include "init.hpp"
#include "layers.hpp"
#include "module.hpp"
#include "normalization.hpp"
#include "rnn.hpp"
#include "transformer.hpp"
#include "utils.hpp"
