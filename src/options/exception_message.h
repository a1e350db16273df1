#pragma once
// An exception's message for amp's own messages to quote. Kept out of format.h: that one is linked without
// LibTorch (the config fuzzer), and this needs c10::Error's type information.

#include <exception>
#include <string>

#include <c10/util/Exception.h>

namespace amp::detail {

/// An exception's message without LibTorch's C++ backtrace.
inline std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

}  // namespace amp::detail
