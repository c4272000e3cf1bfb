#pragma once
// chorus version. Bumping CHORUS_VERSION_MAJOR/MINOR changes the inline ABI namespace
// (config.hpp), so objects built against different versions do not link silently.
#define CHORUS_VERSION_MAJOR 0
#define CHORUS_VERSION_MINOR 1
#define CHORUS_VERSION_PATCH 0
#define CHORUS_VERSION_STRING "0.1.0"
