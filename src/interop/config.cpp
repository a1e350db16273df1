#include "amp/config.h"

#include "interop/config_text.h"
#include "options/format.h"
#include "casting/libtorch_module_types.h"

#include <boost/program_options.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <system_error>

namespace po = boost::program_options;

namespace amp {
namespace {

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return "";
  const auto end = s.find_last_not_of(" \t\r\n");
  return s.substr(begin, end - begin + 1);
}

std::string dashes(std::string name) {
  std::replace(name.begin(), name.end(), '_', '-');
  return name;
}

bool parse_bool(const std::string& v) {
  if (v == "true" || v == "True" || v == "1") return true;
  if (v == "false" || v == "False" || v == "0") return false;
  throw std::invalid_argument("expected true or false (also True/False, 1/0)");
}

int64_t parse_int(const std::string& v) {
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || end != v.c_str() + v.size() || errno == ERANGE) throw std::invalid_argument("expected an integer");
  return value;
}

double parse_double(const std::string& v) {
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(v.c_str(), &end);
  if (v.empty() || end != v.c_str() + v.size() || errno == ERANGE || !std::isfinite(value)) {
    throw std::invalid_argument("expected a finite number");
  }
  return value;
}

c10::ScalarType parse_dtype(const std::string& v) {
  if (v == "float32" || v == "float" || v == "fp32" || v == "torch.float32") return c10::ScalarType::Float;
  if (v == "float16" || v == "half" || v == "fp16" || v == "torch.float16") return c10::ScalarType::Half;
  if (v == "bfloat16" || v == "bf16" || v == "torch.bfloat16") return c10::ScalarType::BFloat16;
  throw std::invalid_argument("expected float32, float16 or bfloat16");
}

int parse_small_int(const std::string& v) {
  const int64_t value = parse_int(v);
  if (value < std::numeric_limits<int>::min() || value > std::numeric_limits<int>::max()) {
    throw std::invalid_argument("out of range");
  }
  return static_cast<int>(value);
}

// A config value as the setter's type: one overload per type a row of amp/option_fields.h may have.
template <class T>
struct ValueOf {};
bool parse_value(const std::string& v, ValueOf<bool>) { return parse_bool(v); }
int parse_value(const std::string& v, ValueOf<int>) { return parse_small_int(v); }
double parse_value(const std::string& v, ValueOf<double>) { return parse_double(v); }
c10::ScalarType parse_value(const std::string& v, ValueOf<c10::ScalarType>) { return parse_dtype(v); }
LossScale parse_value(const std::string& v, ValueOf<LossScale>) { return parse_loss_scale(v); }
CastLists parse_value(const std::string& v, ValueOf<CastLists>) {
  if (v == "apex") return CastLists::kApex;
  if (v == "native") return CastLists::kNative;
  throw std::invalid_argument("expected apex or native");
}

MasterWeights parse_value(const std::string& v, ValueOf<MasterWeights>) {
  if (v == "copy") return MasterWeights::kCopy;
  if (v == "split") return MasterWeights::kSplit;
  if (v == "stochastic_rounding") return MasterWeights::kStochasticRounding;
  if (v == "residual8") return MasterWeights::kResidual8;
  if (v == "kahan") return MasterWeights::kKahan;
  throw std::invalid_argument("expected copy, split, stochastic_rounding, kahan or residual8");
}

OptimizerStateFormat parse_value(const std::string& v, ValueOf<OptimizerStateFormat>) {
  if (v == "fp32") return OptimizerStateFormat::kFp32;
  if (v == "bf16") return OptimizerStateFormat::kBf16;
  if (v == "8bit") return OptimizerStateFormat::k8Bit;
  throw std::invalid_argument("expected fp32, bf16 or 8bit");
}

// The fp8 key turns FP8 on or off (Options::fp8(bool)); the fp8_* keys below set its recipe.
bool parse_value(const std::string& v, ValueOf<Fp8Options>) { return parse_bool(v); }

Fp8Options::Format parse_fp8_format(const std::string& v) {
  if (v == "hybrid") return Fp8Options::Format::kHybrid;
  if (v == "e4m3") return Fp8Options::Format::kE4M3;
  throw std::invalid_argument("expected hybrid or e4m3");
}

Fp8Options::Scaling parse_fp8_scaling(const std::string& v) {
  if (v == "dynamic") return Fp8Options::Scaling::kDynamic;
  if (v == "delayed") return Fp8Options::Scaling::kDelayed;
  if (v == "rowwise") return Fp8Options::Scaling::kRowwise;
  if (v == "rowwise_gw_hp") return Fp8Options::Scaling::kRowwiseGwHp;
  if (v == "blockwise") return Fp8Options::Scaling::kBlockwise;
  if (v == "mxfp8") return Fp8Options::Scaling::kMxfp8;
  throw std::invalid_argument("expected dynamic, delayed, rowwise, rowwise_gw_hp, blockwise or mxfp8");
}

// A comma-separated list ("head, *.norm"): each item trimmed, none empty.
std::vector<std::string> parse_list(const std::string& v) {
  std::vector<std::string> out;
  size_t begin = 0;
  while (true) {
    const size_t comma = v.find(',', begin);
    std::string item = trim(v.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin));
    if (item.empty()) throw std::invalid_argument("expected a comma-separated list of names with no empty item");
    out.push_back(std::move(item));
    if (comma == std::string::npos) return out;
    begin = comma + 1;
  }
}

std::vector<std::string> parse_value(const std::string& v, ValueOf<std::vector<std::string>>) { return parse_list(v); }

// LibTorch module names; a wildcard stands for every name it matches (BatchNorm* is BatchNorm1d, 2d and 3d).
std::vector<ModuleType> parse_value(const std::string& v, ValueOf<std::vector<ModuleType>>) {
  static const std::vector<std::string> known = {
#define AMP_TYPE_NAME(name) #name,
      AMP_LIBTORCH_MODULE_TYPES(AMP_TYPE_NAME)
#undef AMP_TYPE_NAME
  };
  std::vector<ModuleType> out;
  for (const std::string& item : parse_list(v)) {
    const size_t before = out.size();
    for (const auto& name : known) {
      if (detail::glob_match(item, name)) out.push_back({name});
    }
    if (out.size() > before) continue;
    std::string list;
    for (const auto& name : known) list += (list.empty() ? "" : ", ") + name;
    throw std::invalid_argument("'" + item + "' is not a LibTorch module type (did you mean '" +
                                detail::closest_names(item, known, 1).front() + "'?). Known types: " + list +
                                ". A module type of your own goes in code: Options::keep_fp32_type<MyModuleImpl>()");
  }
  return out;
}

struct Key {
  std::string name;
  std::string help;
  std::function<void(Options&, const std::string&)> apply;
};

const std::vector<Key>& amp_keys() {
  static const std::vector<Key> keys = {
      {"opt_level", "O0 | O1 | O2 | O3 (the letter O)", [](Options& o, const std::string& v) { o.opt_level(parse_opt_level(v)); }},
  // One key per row of amp/option_fields.h, named as the field.
#define AMP_CONFIG_KEY(type, name, default_value, help)                                     \
  {#name, help, [](Options& o, const std::string& v) {                                      \
     o.name(parse_value(v, ValueOf<detail::unoptional_t<type>>{}));                         \
   }},
      AMP_OPTION_FIELDS(AMP_CONFIG_KEY)
#undef AMP_CONFIG_KEY
      {"fp8_format", "hybrid | e4m3: FP8 formats: e4m3 forward and e5m2 gradients (hybrid, default), or e4m3 for all",
       [](Options& o, const std::string& v) { o.fp8_format(parse_fp8_format(v)); }},
      {"fp8_scaling", "dynamic | delayed | rowwise | rowwise_gw_hp | blockwise | mxfp8: per-tensor scales from this "
       "step's amax (default) or the amax history; torchao's rowwise recipes; DeepSeek-V3's 1x128/128x128 tiles; OCP MX",
       [](Options& o, const std::string& v) { o.fp8_scaling(parse_fp8_scaling(v)); }},
      {"fp8_amax_history_len", "steps of amax history delayed FP8 scaling keeps (default 1024)",
       [](Options& o, const std::string& v) { o.fp8_amax_history_len(parse_small_int(v)); }},
      {"fp8_amax_compute_algo", "max | most_recent: the history's amax delayed FP8 scaling uses (default max)",
       [](Options& o, const std::string& v) {
         if (v != "max" && v != "most_recent") throw std::invalid_argument("expected max or most_recent");
         o.fp8_amax_compute_algo(v);
       }},
      {"fp8_margin", "FP8 scales are divided by 2^margin (default 0)",
       [](Options& o, const std::string& v) { o.fp8_margin(parse_small_int(v)); }},
      {"fp8_power_of_2_scales", "true | false: FP8 scales rounded down to a power of two (default false; rowwise "
       "recipes always)",
       [](Options& o, const std::string& v) { o.fp8_power_of_2_scales(parse_bool(v)); }},
      {"fp8_min_gemm_size", "Linear layers with in_features * out_features below this stay in bfloat16 (default 0)",
       [](Options& o, const std::string& v) { o.fp8_min_gemm_size(parse_int(v)); }},
      {"fp8_auto_fallback", "true | false: a layer whose FP8 GEMMs overflow on 8 steps in a row moves to bfloat16 "
       "(default false)",
       [](Options& o, const std::string& v) { o.fp8_auto_fallback(parse_bool(v)); }},
  };
  return keys;
}

// All the keys one command line or file may set: amp's and the program's.
class KeySet {
 public:
  KeySet(Options& options, const ProgramFlags* program) : options_(options), program_(program) {}

  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& k : amp_keys()) out.push_back(k.name);
    if (program_) for (const auto& f : program_->flags()) out.push_back(f.name);
    return out;
  }

  bool knows(const std::string& name) const {
    const auto all = names();
    return std::find(all.begin(), all.end(), name) != all.end();
  }

  static bool is_amp_key(const std::string& name) {
    const auto& keys = amp_keys();
    return std::any_of(keys.begin(), keys.end(), [&](const Key& k) { return k.name == name; });
  }

  // Whether `name` (a flag without its leading dashes) is one Boost will be told about, and whether it takes a value.
  bool knows_flag(const std::string& name, bool& takes_value) const {
    takes_value = name != "help";
    if (name == "config" || name == "help") return true;
    for (const auto& known : names()) {
      if (dashes(known) == name) return true;
    }
    return false;
  }

  // Throws std::invalid_argument with the reason only; callers add where the value came from.
  void apply(const std::string& name, const std::string& value) {
    for (const auto& k : amp_keys()) {
      if (k.name == name) return k.apply(options_, value);
    }
    for (const auto& f : program_->flags()) {
      if (f.name == name) return f.assign(value);
    }
  }

  std::string suggestion(const std::string& unknown, bool as_flag) const {
    std::string normalized = unknown;
    std::replace(normalized.begin(), normalized.end(), '-', '_');
    std::string best;
    size_t best_distance = 4;  // suggest only close names
    for (const auto& name : names()) {
      const size_t d = detail::edit_distance(normalized, name);
      if (d < best_distance) best_distance = d, best = name;
    }
    std::string valid;
    for (const auto& name : names()) valid += (valid.empty() ? "" : ", ") + (as_flag ? "--" + dashes(name) : name);
    return (best.empty() ? "" : " (did you mean '" + (as_flag ? "--" + dashes(best) : best) + "'?)") +
           ". Valid " + (as_flag ? "flags: --config, --help, " : "keys: ") + valid;
  }

 private:
  Options& options_;
  const ProgramFlags* program_;
};

constexpr char kUtf8Bom[] = "\xEF\xBB\xBF";

bool invisible(unsigned char c) { return c < 0x20 || c == 0x7F || c >= 0x80; }

std::string hex_byte(unsigned char c) {
  static const char kHex[] = "0123456789ABCDEF";
  return {kHex[c >> 4], kHex[c & 0xF]};
}

// Shows text with control, invisible and non-ASCII bytes as \xNN, so that an error message shows them.
std::string visible(const std::string& text) {
  std::string out;
  for (const unsigned char c : text) {
    if (invisible(c)) out += "\\x" + hex_byte(c);
    else out += static_cast<char>(c);
  }
  return out;
}

// NOTE [Config file sections]
// Keys may sit at top level (before any section header) or under one `[amp]` header, which lets a
// file shared with other tools say whose keys these are. Top level takes amp's keys and, with
// parse_command_line, the program's own; [amp] takes amp's keys only. Any other section is refused
// rather than skipped: a key there would otherwise be silently ignored.
void parse_ini(std::istream& in, const std::string& path, KeySet& keys) {
  std::map<std::string, int> seen;
  int amp_section_line = 0;  // the line of the [amp] header; 0 while at top level
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    const std::string where = "amp config: " + path + ":" + std::to_string(number) + ": ";
    // Editors on Windows start UTF-8 files with a byte order mark; it is not part of the first key.
    if (number == 1 && line.compare(0, 3, kUtf8Bom) == 0) line.erase(0, 3);
    const std::string text = trim(line.substr(0, line.find('#')));
    if (text.empty()) continue;
    if (text.front() == '[') {
      if (text.back() != ']') {
        throw std::invalid_argument(where + "expected a section header such as '[amp]', got '" + visible(text) + "'");
      }
      const std::string section = trim(text.substr(1, text.size() - 2));
      if (section != "amp") {
        throw std::invalid_argument(where + "unknown section [" + visible(section) +
                                    "]: amp reads its keys at top level (before any section) or under [amp].");
      }
      if (amp_section_line != 0) {
        throw std::invalid_argument(where + "section [amp] appears twice (first on line " +
                                    std::to_string(amp_section_line) + "). Keep one [amp] header.");
      }
      amp_section_line = number;
      continue;
    }
    const auto eq = text.find('=');
    if (eq == std::string::npos) {
      throw std::invalid_argument(where + "expected 'key = value', got '" + visible(text) + "'");
    }
    const std::string key = trim(text.substr(0, eq));
    const std::string value = trim(text.substr(eq + 1));
    for (size_t i = 0; i < key.size(); ++i) {
      if (invisible(static_cast<unsigned char>(key[i]))) {
        throw std::invalid_argument(where + "the key '" + visible(key) +
                                    "' contains a control, invisible or non-ASCII character (byte 0x" +
                                    hex_byte(static_cast<unsigned char>(key[i])) + " at position " + std::to_string(i + 1) +
                                    "). Keys are plain ASCII, such as opt_level: retype the key.");
      }
    }
    if (!keys.knows(key)) {
      throw std::invalid_argument(where + "unknown key '" + key + "'" + keys.suggestion(key, /*as_flag=*/false));
    }
    if (amp_section_line != 0 && !KeySet::is_amp_key(key)) {
      throw std::invalid_argument(where + "'" + key + "' is the program's key, not amp's: [amp] (line " +
                                  std::to_string(amp_section_line) +
                                  ") holds amp's keys only. Move it above the [amp] header, to top level.");
    }
    if (const auto it = seen.find(key); it != seen.end()) {
      throw std::invalid_argument(where + "duplicate key '" + key + "' (value '" + value + "'), already set on line " +
                                  std::to_string(it->second) + ". Keep one of the two lines.");
    }
    seen.emplace(key, number);
    if (value.empty()) throw std::invalid_argument(where + "key '" + key + "' has no value");
    try {
      keys.apply(key, value);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(where + "bad value '" + value + "' for key '" + key + "': " + e.what());
    }
  }
  if (in.bad()) {
    throw std::invalid_argument("amp config: cannot read config file '" + path + "': reading failed after line " +
                                std::to_string(number) + ". Give a readable INI file.");
  }
}

void load_file(const std::string& path, KeySet& keys) {
  std::error_code ignored;
  const auto status = std::filesystem::status(path, ignored);
  // An ifstream opens a directory and then reads nothing from it: without this check a directory
  // would pass as an empty config file.
  if (std::filesystem::is_directory(status)) {
    throw std::invalid_argument("amp config: '" + path +
                                "' is a directory, not a config file. Give the path of an INI file of `key = value` lines.");
  }
  errno = 0;
  std::ifstream in(path);
  if (!in) {
    const int error = errno;
    if (std::filesystem::exists(status)) {
      throw std::invalid_argument("amp config: cannot read config file '" + path + "': " +
                                  (error != 0 ? std::generic_category().message(error) : "it cannot be opened") + ".");
    }
    throw std::invalid_argument("amp config: cannot open config file '" + path +
                                "'. Check the path (relative paths start from the working directory).");
  }
  parse_ini(in, path, keys);
}

po::options_description describe(const ProgramFlags* program) {
  po::options_description all(program && !program->description().empty() ? program->description() : "Options");
  if (program && !program->flags().empty()) {
    po::options_description own("Program options");
    for (const auto& f : program->flags()) {
      own.add_options()(dashes(f.name).c_str(), po::value<std::string>()->value_name("VALUE"),
                        (f.help + " (default: " + f.default_value + ")").c_str());
    }
    all.add(own);
  }
  po::options_description amp_flags("amp options (Apex's amp.initialize keywords; they override --config)");
  amp_flags.add_options()("config", po::value<std::string>()->value_name("FILE"),
                          "INI file of `key = value` lines setting any option below");
  for (const auto& k : amp_keys()) {
    amp_flags.add_options()(dashes(k.name).c_str(), po::value<std::string>()->value_name("VALUE"), k.help.c_str());
  }
  amp_flags.add_options()("help", "print this help");
  all.add(amp_flags);
  return all;
}

// NOTE [Never format a Boost error]
// Boost.Program_options builds its messages by replacing placeholders (%canonical_option%,
// %original_token%, %option%, %value%, %prefix%) with the user's tokens, repeatedly, until none is
// left: a token that contains a placeholder (`--%original_token%=`) sends what() into an endless loop.
// So amp never calls what() on a Boost error. Flag names are checked here before Boost sees them,
// and the errors Boost still raises are described from their accessors (kind, get_option_name()),
// which copy strings without substituting anything.

// Refuses a `--name` or `--name=value` token whose name is not a declared flag, skipping the token
// after a flag that takes a separate value (Boost reads that token as the value, whatever it looks like).
void check_flag_names(int argc, const char* const argv[], const KeySet& keys) {
  for (int i = 1; i < argc; ++i) {
    const std::string token = argv[i] ? argv[i] : "";
    if (token == "--") return;  // what follows is positional, refused after parsing
    if (token.compare(0, 2, "--") != 0) continue;
    const auto eq = token.find('=');
    const std::string name = token.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    bool takes_value = false;
    if (name.empty() || !keys.knows_flag(name, takes_value)) {
      const std::string flag = name.empty() ? token : token.substr(0, eq);
      throw std::invalid_argument("amp: unknown command-line flag '" + flag + "'" + keys.suggestion(name, /*as_flag=*/true));
    }
    if (takes_value && eq == std::string::npos) ++i;
  }
}

[[noreturn]] void throw_bad_command_line(const po::error& e) {
  const std::string usage = ". Flags take a value: --opt-level O2 --keep-batchnorm-fp32 false.";
  if (const auto* syntax = dynamic_cast<const po::invalid_command_line_syntax*>(&e)) {
    const std::string flag = syntax->get_option_name();
    switch (syntax->kind()) {
      case po::invalid_syntax::missing_parameter:
        throw std::invalid_argument("amp: bad command line: the flag '" + flag + "' needs a value" + usage);
      case po::invalid_syntax::empty_adjacent_parameter:
        throw std::invalid_argument("amp: bad command line: the flag '" + flag + "' has no value after '='" + usage);
      case po::invalid_syntax::extra_parameter:
        throw std::invalid_argument("amp: bad command line: the flag '" + flag + "' takes no value.");
      default:
        throw std::invalid_argument("amp: bad command line: cannot read the flag '" + flag + "'" + usage);
    }
  }
  if (const auto* named = dynamic_cast<const po::error_with_option_name*>(&e)) {
    throw std::invalid_argument("amp: bad command line: cannot read the flag '" + named->get_option_name() + "'" + usage);
  }
  throw std::invalid_argument("amp: bad command line: it cannot be parsed" + usage);
}

// Returns false when --help was asked for (help text in `help`).
bool parse(int argc, const char* const argv[], KeySet& keys, const ProgramFlags* program, std::string& help) {
  const po::options_description description = describe(program);
  check_flag_names(argc, argv, keys);
  po::variables_map vm;
  po::parsed_options parsed(&description);
  try {
    // No abbreviations: a typo must fail with a suggestion, not silently pick the nearest flag.
    const int style = po::command_line_style::default_style & ~po::command_line_style::allow_guessing;
    parsed = po::command_line_parser(argc, argv).options(description).style(style).run();
    po::store(parsed, vm);
  } catch (const po::unknown_option& e) {
    const std::string flag = e.get_option_name();
    const auto first = flag.find_first_not_of('-');
    throw std::invalid_argument("amp: unknown command-line flag '" + flag + "'" +
                                keys.suggestion(first == std::string::npos ? flag : flag.substr(first), /*as_flag=*/true));
  } catch (const po::multiple_occurrences& e) {
    throw std::invalid_argument("amp: the flag '" + e.get_option_name() + "' is given twice; give it once.");
  } catch (const po::error& e) {
    throw_bad_command_line(e);  // never e.what(): see NOTE [Never format a Boost error]
  }
  for (const auto& option : parsed.options) {
    if (option.position_key != -1 || option.string_key.empty()) {
      const std::string token = option.original_tokens.empty() ? "" : option.original_tokens.front();
      throw std::invalid_argument("amp: unexpected command-line argument '" + token +
                                  "'. Every setting is a flag with a value: --opt-level O2 --epochs 3.");
    }
  }
  if (vm.count("help")) {
    std::ostringstream os;
    os << description;
    help = os.str();
    return false;
  }
  if (vm.count("config")) load_file(vm["config"].as<std::string>(), keys);
  // Flags override the file: applied after it, in command-line order, as Boost parsed them.
  for (const auto& option : parsed.options) {
    std::string name = option.string_key;
    std::replace(name.begin(), name.end(), '-', '_');
    if (name == "config" || name == "help") continue;
    const std::string value = option.value.empty() ? "" : option.value.front();
    try {
      keys.apply(name, value);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("amp: bad value '" + value + "' for --" + option.string_key + ": " + e.what());
    }
  }
  return true;
}

template <class T>
std::string to_text(const T& value) {
  std::ostringstream os;
  if constexpr (std::is_same_v<T, bool>) os << (value ? "true" : "false");
  else os << value;
  return os.str();
}

}  // namespace

Options detail::parse_config_text(std::istream& in, const std::string& source_name) {
  Options options;
  KeySet keys(options, nullptr);
  parse_ini(in, source_name, keys);
  return options;
}

Options load_options(const std::string& config_file) {
  Options options;
  KeySet keys(options, nullptr);
  load_file(config_file, keys);
  return options;
}

Options parse_options(int argc, const char* const argv[]) {
  Options options;
  KeySet keys(options, nullptr);
  std::string help;
  if (!parse(argc, argv, keys, nullptr, help)) throw HelpRequested(help);
  return options;
}

std::optional<Options> parse_command_line(int argc, const char* const argv[], ProgramFlags& program_flags,
                                          std::ostream& help_out) {
  Options options;
  KeySet keys(options, &program_flags);
  std::string help;
  if (!parse(argc, argv, keys, &program_flags, help)) {
    help_out << help;
    return std::nullopt;
  }
  return options;
}

std::optional<Options> parse_command_line(int argc, const char* const argv[], ProgramFlags& program_flags) {
  return parse_command_line(argc, argv, program_flags, std::cout);
}

ProgramFlags::ProgramFlags(std::string description) : description_(std::move(description)) {}

ProgramFlags& ProgramFlags::add_flag(Flag flag) {
  for (const auto& k : amp_keys()) {
    if (k.name == flag.name) throw std::invalid_argument("amp::ProgramFlags: '" + flag.name + "' is one of amp's own keys");
  }
  for (const auto& f : flags_) {
    if (f.name == flag.name) throw std::invalid_argument("amp::ProgramFlags: flag '" + flag.name + "' added twice");
  }
  if (flag.name.empty() || flag.name == "config" || flag.name == "help" ||
      flag.name.find_first_of(" =-#") != std::string::npos) {
    throw std::invalid_argument("amp::ProgramFlags: invalid flag name '" + flag.name +
                                "'; use lower_case_with_underscores (it becomes --lower-case-with-underscores)");
  }
  flags_.push_back(std::move(flag));
  return *this;
}

ProgramFlags& ProgramFlags::add(const std::string& name, int* target, const std::string& help) {
  return add_flag({name, help, to_text(*target), [target](const std::string& v) { *target = parse_small_int(v); }});
}
ProgramFlags& ProgramFlags::add(const std::string& name, int64_t* target, const std::string& help) {
  return add_flag({name, help, to_text(*target), [target](const std::string& v) { *target = parse_int(v); }});
}
ProgramFlags& ProgramFlags::add(const std::string& name, double* target, const std::string& help) {
  return add_flag({name, help, to_text(*target), [target](const std::string& v) { *target = parse_double(v); }});
}
ProgramFlags& ProgramFlags::add(const std::string& name, bool* target, const std::string& help) {
  return add_flag({name, help, to_text(*target), [target](const std::string& v) { *target = parse_bool(v); }});
}
ProgramFlags& ProgramFlags::add(const std::string& name, std::string* target, const std::string& help) {
  return add_flag({name, help, *target, [target](const std::string& v) { *target = v; }});
}

}  // namespace amp
