#pragma once
// amp's options from config files and command lines (Boost.Program_options inside; never in a header).
//
// Keys are Apex's keyword names: opt_level, enabled, cast_model_type, patch_torch_functions,
// keep_batchnorm_fp32, master_weights, loss_scale ("dynamic" or a number), low_precision_dtype
// ("float16" | "bfloat16"), cast_model_outputs, num_losses, min_loss_scale, max_loss_scale, verbosity,
// and the loss scaler's init_scale, growth_factor, backoff_factor, growth_interval, hysteresis
// (torch.amp.GradScaler's names); amp's own keys (cast_lists, keep_fp32, keep_fp32_types, auto_fp32,
// cast_frozen_batchnorm, master_weights_format, fp8 and its recipe: fp8_format, fp8_scaling,
// fp8_amax_history_len, fp8_amax_compute_algo, fp8_margin). Flags use dashes (--opt-level O2
// --init-scale 1024 --config FILE) and override the file. Unknown keys, bad values and duplicates throw
// std::invalid_argument naming the key, the value, and the file and line.
//
// Files are INI: `key = value` lines, `#` comments, an optional UTF-8 byte order mark. Keys sit at
// top level or under an `[amp]` section header:
//
//   epochs = 10          # top level: amp's keys and the program's own (ProgramFlags)
//   [amp]                # [amp]: amp's keys only
//   opt_level = O2
//   init_scale = 1024
//
// Any other section name throws (file:line, the section), as does a key holding a control, invisible
// or non-ASCII character. A directory or an unreadable file throws naming the path.

#include <exception>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "amp/options.h"

namespace amp {

/// Reads amp's options from an INI config file.
Options load_options(const std::string& config_file);

/// Reads amp's options from a command line (argv[0] is the program name); `--config FILE` loads a
/// file first and the other flags override it. Throws std::invalid_argument on anything it doesn't
/// know, and HelpRequested (what() is the help text) on --help.
Options parse_options(int argc, const char* const argv[]);

/// Thrown by parse_options on --help; what() holds the help text to print.
class HelpRequested : public std::exception {
 public:
  explicit HelpRequested(std::string text) : text_(std::move(text)) {}
  const char* what() const noexcept override { return text_.c_str(); }

 private:
  std::string text_;
};

/// A training program's own flags, declared next to amp's so that one command line (and one config
/// file) sets both and one --help lists both.
///
/// Example:
///   int epochs = 5; std::string data = "digits";
///   amp::ProgramFlags flags("train: fits a classifier with amp");
///   flags.add("epochs", &epochs, "passes over the data").add("data", &data, "dataset name");
///   auto options = amp::parse_command_line(argc, argv, flags);
///   if (!options) return 0;  // --help was printed
class ProgramFlags {
 public:
  explicit ProgramFlags(std::string description = {});
  ProgramFlags& add(const std::string& name, int* target, const std::string& help);
  ProgramFlags& add(const std::string& name, int64_t* target, const std::string& help);
  ProgramFlags& add(const std::string& name, double* target, const std::string& help);
  ProgramFlags& add(const std::string& name, bool* target, const std::string& help);
  ProgramFlags& add(const std::string& name, std::string* target, const std::string& help);

  /// One declared flag: its name with underscores (a config key; --name-with-dashes on the command line).
  struct Flag {
    std::string name;
    std::string help;
    std::string default_value;
    std::function<void(const std::string&)> assign;  // parses and stores, throws std::invalid_argument
  };
  const std::string& description() const noexcept { return description_; }
  const std::vector<Flag>& flags() const noexcept { return flags_; }

 private:
  ProgramFlags& add_flag(Flag flag);
  std::string description_;
  std::vector<Flag> flags_;
};

/// Parses one command line holding amp's flags and the program's, plus `--config FILE` (a file that
/// may set both) and `--help`. Returns nullopt after printing help to `help_out`.
std::optional<Options> parse_command_line(int argc, const char* const argv[], ProgramFlags& program_flags,
                                          std::ostream& help_out);
/// Same, printing help to std::cout.
std::optional<Options> parse_command_line(int argc, const char* const argv[], ProgramFlags& program_flags);

}  // namespace amp
