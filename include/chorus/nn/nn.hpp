#pragma once
// Modules, layers, losses and initialisation.
#include "functional.hpp"
#include "init.hpp"
#include "layers.hpp"
#include "module.hpp"
#include "utils.hpp"
