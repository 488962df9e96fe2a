// Argument checks of the CPU extension, raised as plain C++ standard exceptions.
//
// TORCH_CHECK throws c10::Error, which captures a C++ backtrace when it is constructed. On an
// H100 host (Xeon Sapphire Rapids, g++ 13.3, torch 2.11+cu130) every such throw from a kernel
// taking tensors ended the process with a segfault, while the same throw from a function
// taking only a string was caught (bench/README.md, "On an H100"). These carry the message
// only: pybind11 turns std::runtime_error into RuntimeError and std::invalid_argument into
// ValueError, as torch did with TORCH_CHECK and TORCH_CHECK_VALUE.
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
