#pragma once
// How the examples end on an error: the message without LibTorch's C++ backtrace, exit status 1.

#include <c10/util/Exception.h>

#include <exception>
#include <iostream>

inline int report_error(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::cerr << (c10_error ? c10_error->what_without_backtrace() : e.what()) << "\n";
  return 1;
}
