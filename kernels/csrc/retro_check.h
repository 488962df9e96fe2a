// Argument checks of the CPU extension, raised as plain C++ standard exceptions.
//
// These carry the message only: pybind11 turns std::runtime_error into RuntimeError and
// std::invalid_argument into ValueError, as torch does with TORCH_CHECK and TORCH_CHECK_VALUE.
// (They were brought in when every check failing on an H100 host segfaulted; the cause was
// the link, which took the static C++ runtime there: see kernels/cpu_decode.py _ldflags.)
#pragma once

#include <c10/util/StringUtil.h>

#include <stdexcept>

#define RETRO_CHECK(cond, ...)                                        \
  do {                                                                \
    if (!(cond)) throw std::runtime_error(::c10::str(__VA_ARGS__));   \
  } while (false)

#define RETRO_CHECK_VALUE(cond, ...)                                    \
  do {                                                                  \
    if (!(cond)) throw std::invalid_argument(::c10::str(__VA_ARGS__));  \
  } while (false)
