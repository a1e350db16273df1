// libFuzzer target over amp's text inputs: config files, command lines, opt levels and loss scales.
// A well-formed input must resolve or be refused with std::invalid_argument (or HelpRequested for
// --help); any other exception, crash, hang or sanitizer report is a finding.
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "amp/config.h"
#include "interop/config_text.h"

namespace {

template <class F>
void expect_clean_refusal(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument&) {
  } catch (const amp::HelpRequested&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);

  expect_clean_refusal([&] {
    std::istringstream in(text);
    (void)amp::detail::parse_config_text(in, "fuzz.ini").resolve();
  });
  expect_clean_refusal([&] { (void)amp::parse_opt_level(text); });
  expect_clean_refusal([&] { (void)amp::parse_loss_scale(text); });

  // The same bytes as a command line, one argument per line. --config would read arbitrary paths
  // (/dev/zero never ends), so it is left to the file half above.
  if (text.find("--config") == std::string::npos) {
    std::vector<std::string> args = {"fuzz"};
    std::istringstream lines(text);
    for (std::string arg; std::getline(lines, arg);) args.push_back(arg);
    std::vector<const char*> argv;
    for (const auto& a : args) argv.push_back(a.c_str());
    expect_clean_refusal([&] { (void)amp::parse_options(static_cast<int>(argv.size()), argv.data()).resolve(); });
  }
  return 0;
}
