// amp/config.h: INI files and flags, with Apex's keyword names; every bad input names the key,
// the value, and the file and line.
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <thread>

#include <sys/stat.h>
#include <unistd.h>

#include "amp/config.h"
#include "casting/fp8.h"
#include "support/support.h"

namespace {

std::string write_config(const std::string& name, const std::string& text) {
  const auto path = std::filesystem::temp_directory_path() / ("amp_config_test_" + name + ".ini");
  std::ofstream(path) << text;
  return path.string();
}

amp::Options parse(std::vector<std::string> args) {
  args.insert(args.begin(), "train");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  return amp::parse_options(static_cast<int>(argv.size()), argv.data());
}

}  // namespace

TEST(ConfigTest, LoadsEveryKey) {
  const auto path = write_config("every_key", R"(# amp settings
opt_level = O2
enabled = true
cast_model_type = bfloat16
keep_batchnorm_fp32 = False   # Apex's string spelling works too
master_weights = true
loss_scale = 128.0
low_precision_dtype = bfloat16
cast_model_outputs = float32
num_losses = 2
min_loss_scale = 1
max_loss_scale = 65536
verbosity = 0
)");
  const auto p = amp::load_options(path).resolve();
  EXPECT_EQ(p.opt_level, amp::OptLevel::O2);
  EXPECT_EQ(p.cast_model_type, torch::kBFloat16);
  EXPECT_EQ(p.keep_batchnorm_fp32, false);
  EXPECT_EQ(p.loss_scale, amp::LossScale::fixed(128.0));
  EXPECT_EQ(p.num_losses, 2);
  EXPECT_EQ(p.min_loss_scale, 1.0);
  EXPECT_EQ(p.max_loss_scale, 65536.0);
  EXPECT_EQ(p.verbosity, 0);
  const auto o1 = amp::load_options(write_config("o1", "opt_level=O1\npatch_torch_functions = true\nloss_scale=dynamic\n")).resolve();
  EXPECT_TRUE(o1.patch_torch_functions);
  EXPECT_TRUE(o1.loss_scale.is_dynamic());
}

TEST(ConfigTest, FileErrorsNameTheFileLineKeyAndValue) {
  const auto unknown = write_config("unknown", "opt_level = O2\nopt_levl = O1\n");
  ASSERT_THROWS_WITH(amp::load_options(unknown), unknown + ":2: unknown key 'opt_levl' (did you mean 'opt_level'?)");
  ASSERT_THROWS_WITH(amp::load_options(write_config("dash", "keep-batchnorm-fp32 = true\n")),
                     "did you mean 'keep_batchnorm_fp32'?");
  ASSERT_THROWS_WITH(amp::load_options(write_config("far", "epochs = 3\n")), "Valid keys: opt_level, enabled");
  const auto dup = write_config("dup", "# c\nopt_level = O2\n\nopt_level = O3\n");
  ASSERT_THROWS_WITH(amp::load_options(dup), dup + ":4: duplicate key 'opt_level' (value 'O3'), already set on line 2");
  const auto bad = write_config("bad", "opt_level = 02\n");
  ASSERT_THROWS_WITH(amp::load_options(bad), bad + ":1: bad value '02' for key 'opt_level'");
  ASSERT_THROWS_WITH(amp::load_options(bad), "the prefix O is the letter O");
  ASSERT_THROWS_WITH(amp::load_options(write_config("bool", "enabled = yes\n")),
                     "bad value 'yes' for key 'enabled': expected true or false");
  ASSERT_THROWS_WITH(amp::load_options(write_config("dtype", "low_precision_dtype = fp8\n")),
                     "bad value 'fp8' for key 'low_precision_dtype': expected float32, float16 or bfloat16");
  ASSERT_THROWS_WITH(amp::load_options(write_config("scale", "loss_scale = -1\n")),
                     "bad value '-1' for key 'loss_scale'");
  ASSERT_THROWS_WITH(amp::load_options(write_config("int", "num_losses = 2.5\n")),
                     "bad value '2.5' for key 'num_losses': expected an integer");
  ASSERT_THROWS_WITH(amp::load_options(write_config("noeq", "opt_level O2\n")), ":1: expected 'key = value', got 'opt_level O2'");
  ASSERT_THROWS_WITH(amp::load_options(write_config("empty", "opt_level =\n")), "key 'opt_level' has no value");
  ASSERT_THROWS_WITH(amp::load_options("/nonexistent/amp.ini"), "cannot open config file '/nonexistent/amp.ini'");
  // Cross-field rules surface at resolve(), with Apex's message.
  ASSERT_THROWS_WITH(amp::load_options(write_config("o1bn", "opt_level = O1\nkeep_batchnorm_fp32 = true\n")).resolve(),
                     "keep_batchnorm_fp32 should be None");
}

TEST(ConfigTest, CastListsKey) {
  EXPECT_EQ(amp::load_options(write_config("native", "opt_level = O1\ncast_lists = native\n")).resolve().cast_lists,
            amp::CastLists::kNative);
  EXPECT_EQ(amp::load_options(write_config("apex", "opt_level = O1\ncast_lists = apex\n")).resolve().cast_lists,
            amp::CastLists::kApex);
  EXPECT_EQ(amp::Options("O1").resolve().cast_lists, amp::CastLists::kApex);  // Apex's lists by default
  ASSERT_THROWS_WITH(amp::load_options(write_config("lists", "cast_lists = torch\n")),
                     "bad value 'torch' for key 'cast_lists': expected apex or native");
  ASSERT_THROWS_WITH(amp::Options("O2").cast_lists(amp::CastLists::kNative).resolve(),
                     "cast_lists chooses the lists of O1's per-op casts, so it applies where the forward runs under "
                     "them (O1) only; got cast_lists native at opt_level O2. Remove it, or use O1.");
  EXPECT_NE(amp::Options("O1").cast_lists(amp::CastLists::kNative).describe_overrides().find("cast_lists"),
            std::string::npos);
}

TEST(ConfigTest, FlagsOverrideTheFile) {
  const auto path = write_config("base", "opt_level = O2\nloss_scale = 128\nverbosity = 0\n");
  const auto p = parse({"--config", path, "--opt-level", "O3", "--keep-batchnorm-fp32", "true"}).resolve();
  EXPECT_EQ(p.opt_level, amp::OptLevel::O3);
  EXPECT_EQ(p.keep_batchnorm_fp32, true);
  EXPECT_EQ(p.loss_scale, amp::LossScale::fixed(128.0));
  // Order on the command line doesn't matter: flags still win over the file.
  EXPECT_EQ(parse({"--opt-level=O1", "--config", path}).resolve().opt_level, amp::OptLevel::O1);
}

TEST(ConfigTest, FlagErrors) {
  ASSERT_THROWS_WITH(parse({"--opt-levle", "O2"}), "unknown command-line flag '--opt-levle' (did you mean '--opt-level'?)");
  ASSERT_THROWS_WITH(parse({"--opt-level", "O5"}), "bad value 'O5' for --opt-level");
  ASSERT_THROWS_WITH(parse({"--opt-level", "O2", "--opt-level", "O3"}), "is given twice");
  ASSERT_THROWS_WITH(parse({"--opt-level"}), "bad command line");
  ASSERT_THROWS_WITH(parse({"--master-weights", "maybe"}), "bad value 'maybe' for --master-weights: expected true or false");
  EXPECT_THROW(parse({"--help"}), amp::HelpRequested);
  try {
    parse({"--help"});
  } catch (const amp::HelpRequested& help) {
    EXPECT_NE(std::string(help.what()).find("--keep-batchnorm-fp32"), std::string::npos) << help.what();
  }
}

TEST(ConfigTest, ProgramFlagsShareTheCommandLineFileAndHelp) {
  int epochs = 3;
  double lr = 0.1;
  std::string data = "digits";
  bool resume = false;
  amp::ProgramFlags flags("train: an example");
  flags.add("epochs", &epochs, "passes over the data").add("lr", &lr, "learning rate").add("data", &data, "dataset");
  flags.add("resume", &resume, "continue from the checkpoint");
  const auto path = write_config("program", "opt_level = O2\nepochs = 7\nverbosity = 0\n");
  std::vector<const char*> argv = {"train", "--config", path.c_str(), "--lr", "0.5", "--resume", "true"};
  std::ostringstream help;
  const auto options = amp::parse_command_line(static_cast<int>(argv.size()), argv.data(), flags, help);
  ASSERT_TRUE(options.has_value());
  EXPECT_EQ(options->opt_level(), amp::OptLevel::O2);
  EXPECT_EQ(epochs, 7);
  EXPECT_EQ(lr, 0.5);
  EXPECT_TRUE(resume);
  EXPECT_EQ(data, "digits");

  std::vector<const char*> help_argv = {"train", "--help"};
  EXPECT_FALSE(amp::parse_command_line(2, help_argv.data(), flags, help).has_value());
  EXPECT_NE(help.str().find("--epochs"), std::string::npos) << help.str();
  EXPECT_NE(help.str().find("(default: 3)"), std::string::npos) << help.str();
  EXPECT_NE(help.str().find("--opt-level"), std::string::npos);

  std::vector<const char*> bad = {"train", "--epochs", "many"};
  ASSERT_THROWS_WITH(amp::parse_command_line(3, bad.data(), flags, help), "bad value 'many' for --epochs: expected an integer");
  std::vector<const char*> typo = {"train", "--epoch", "3"};
  ASSERT_THROWS_WITH(amp::parse_command_line(3, typo.data(), flags, help), "did you mean '--epochs'?");
  ASSERT_THROWS_WITH(flags.add("opt_level", &epochs, "x"), "'opt_level' is one of amp's own keys");
  ASSERT_THROWS_WITH(flags.add("epochs", &epochs, "x"), "flag 'epochs' added twice");
  ASSERT_THROWS_WITH(flags.add("bad-name", &epochs, "x"), "invalid flag name 'bad-name'");
}

TEST(ConfigTest, ShippedExampleConfigsAllResolve) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(std::string(AMP_SOURCE_DIR) + "/examples/configs")) {
    if (entry.path().extension() != ".ini") continue;
    SCOPED_TRACE(entry.path().string());
    // As examples/train reads them: its own keys (O2_bf16_fp8.ini sets hidden) sit beside amp's.
    int64_t hidden = 0;
    amp::ProgramFlags flags("train");
    flags.add("hidden", &hidden, "hidden layer width");
    const std::string path = entry.path().string();
    std::vector<const char*> argv = {"train", "--config", path.c_str()};
    std::ostringstream help;
    const auto options = amp::parse_command_line(static_cast<int>(argv.size()), argv.data(), flags, help);
    ASSERT_TRUE(options.has_value());
    const std::string stem = entry.path().stem().string();
    ++count;
    if (stem.find("fp8") != std::string::npos && !amp::detail::fp8_supported_by_build()) {
      ASSERT_THROWS_WITH(options->resolve(), "fp8 needs FP8 dtypes and at::_scaled_mm, which LibTorch has from 2.1 on");
      continue;
    }
    const auto p = options->resolve();
    EXPECT_EQ(amp::to_string(p.opt_level), stem.substr(0, 2));
    if (p.opt_level != amp::OptLevel::O0) {
      EXPECT_EQ(p.low_precision_dtype, stem.find("bf16") != std::string::npos ? torch::kBFloat16 : torch::kHalf);
    }
    EXPECT_EQ(p.fp8.has_value(), stem.find("fp8") != std::string::npos);
    if (p.fp8) EXPECT_GT(hidden, 0);  // the digits net needs a hidden layer for FP8
  }
  EXPECT_EQ(count, 8);  // O0, O1..O3 each in fp16 and bf16, and O2 bf16 with FP8
}

TEST(ConfigTest, PositionalArgumentsAndBareDashesAreRefused) {
  // Found by the fuzzer: "--" ends Boost's option parsing, and what followed reached amp unvalidated.
  ASSERT_THROWS_WITH(parse({"--", "--loss-scale", "128"}), "unexpected command-line argument");
  ASSERT_THROWS_WITH(parse({"O2"}), "unexpected command-line argument 'O2'");
  ASSERT_THROWS_WITH(parse({"--opt-level", "O2", "extra"}), "unexpected command-line argument 'extra'");
}

TEST(ConfigTest, DirectoryOrUnreadableConfigFileIsRefused) {
  // An ifstream "opens" a directory and reads nothing: this used to return the defaults.
  const auto dir = std::filesystem::temp_directory_path() / "amp_config_test_dir";
  std::filesystem::create_directories(dir);
  ASSERT_THROWS_WITH(amp::load_options(dir.string()),
                     "amp config: '" + dir.string() +
                         "' is a directory, not a config file. Give the path of an INI file of `key = value` lines.");
  ASSERT_THROWS_WITH(parse({"--config", dir.string()}), "'" + dir.string() + "' is a directory, not a config file");
  // A file that opens but whose reads fail (EIO at address 0) also used to pass as empty.
  if (std::filesystem::exists("/proc/self/mem")) {
    ASSERT_THROWS_WITH(amp::load_options("/proc/self/mem"),
                       "amp config: cannot read config file '/proc/self/mem': reading failed after line 0. "
                       "Give a readable INI file.");
  }
  // A file without read permission (root reads everything, so only checked as another user).
  const auto locked = write_config("locked", "opt_level = O2\n");
  ::chmod(locked.c_str(), 0);
  if (::geteuid() != 0) {
    ASSERT_THROWS_WITH(amp::load_options(locked), "amp config: cannot read config file '" + locked + "': Permission denied.");
  }
  ::chmod(locked.c_str(), 0644);
}

TEST(ConfigTest, AmpSectionHeaderAndOtherSections) {
  const auto path = write_config("section", "verbosity = 0   # top level works as before\n\n[amp]  # amp's keys\n"
                                            "opt_level = O2\n[ amp ]\n");
  ASSERT_THROWS_WITH(amp::load_options(path), path + ":5: section [amp] appears twice (first on line 3). Keep one [amp] header.");
  const auto p = amp::load_options(write_config("section_ok", "verbosity = 0\n[amp]\nopt_level = O2\nloss_scale = 64\n")).resolve();
  EXPECT_EQ(p.opt_level, amp::OptLevel::O2);
  EXPECT_EQ(p.verbosity, 0);
  EXPECT_EQ(p.loss_scale, amp::LossScale::fixed(64.0));
  const auto other = write_config("section_other", "opt_level = O2\n[training]\nepochs = 3\n");
  ASSERT_THROWS_WITH(amp::load_options(other),
                     "amp config: " + other +
                         ":2: unknown section [training]: amp reads its keys at top level (before any section) or under [amp].");
  ASSERT_THROWS_WITH(amp::load_options(write_config("section_open", "[amp\nopt_level = O2\n")),
                     ":1: expected a section header such as '[amp]', got '[amp'");
  // Keys still count once across top level and [amp].
  ASSERT_THROWS_WITH(amp::load_options(write_config("section_dup", "opt_level = O1\n[amp]\nopt_level = O2\n")),
                     ":3: duplicate key 'opt_level' (value 'O2'), already set on line 1");

  // With a program's flags: its keys at top level, amp's at top level or under [amp].
  int epochs = 1;
  amp::ProgramFlags flags;
  flags.add("epochs", &epochs, "passes");
  const auto shared = write_config("section_program", "epochs = 4\n[amp]\nopt_level = O3\n");
  std::vector<const char*> argv = {"train", "--config", shared.c_str()};
  std::ostringstream help;
  const auto options = amp::parse_command_line(3, argv.data(), flags, help);
  ASSERT_TRUE(options.has_value());
  EXPECT_EQ(options->opt_level(), amp::OptLevel::O3);
  EXPECT_EQ(epochs, 4);
  const auto misplaced = write_config("section_program_bad", "[amp]\nopt_level = O3\nepochs = 4\n");
  argv[2] = misplaced.c_str();
  ASSERT_THROWS_WITH(amp::parse_command_line(3, argv.data(), flags, help),
                     misplaced + ":3: 'epochs' is the program's key, not amp's: [amp] (line 1) holds amp's keys only. "
                                 "Move it above the [amp] header, to top level.");
}

TEST(ConfigTest, ByteOrderMarkIsSkippedAndInvisibleCharactersInKeysAreRefused) {
  const auto bom = write_config("bom", "\xEF\xBB\xBFopt_level = O3\nverbosity = 0\n");
  EXPECT_EQ(amp::load_options(bom).resolve().opt_level, amp::OptLevel::O3);
  EXPECT_EQ(amp::load_options(write_config("bom_section", "\xEF\xBB\xBF[amp]\nopt_level = O2\n")).resolve().opt_level,
            amp::OptLevel::O2);
  // A zero-width space pasted into a key, a BOM that is not at the start, a control character.
  const auto zwsp = write_config("zwsp", "opt_level = O2\nloss\xE2\x80\x8B_scale = 128\n");
  ASSERT_THROWS_WITH(amp::load_options(zwsp),
                     "amp config: " + zwsp +
                         ":2: the key 'loss\\xE2\\x80\\x8B_scale' contains a control, invisible or non-ASCII character "
                         "(byte 0xE2 at position 5). Keys are plain ASCII, such as opt_level: retype the key.");
  ASSERT_THROWS_WITH(amp::load_options(write_config("bom_late", "verbosity = 0\n\xEF\xBB\xBFopt_level = O2\n")),
                     ":2: the key '\\xEF\\xBB\\xBFopt_level' contains a control, invisible or non-ASCII character (byte 0xEF at position 1)");
  ASSERT_THROWS_WITH(amp::load_options(write_config("control", "opt\x01level = O2\n")),
                     ":1: the key 'opt\\x01level' contains a control, invisible or non-ASCII character (byte 0x01 at position 4)");
}

TEST(ConfigTest, LossScalerKeysAndFlags) {
  const auto path = write_config("scaler", "opt_level = O2\ninit_scale = 1024\ngrowth_factor = 4\nbackoff_factor = 0.25\n"
                                           "growth_interval = 100\nhysteresis = 3\n");
  const auto p = amp::load_options(path).resolve();
  EXPECT_EQ(p.init_scale, 1024.0);
  EXPECT_EQ(p.growth_factor, 4.0);
  EXPECT_EQ(p.backoff_factor, 0.25);
  EXPECT_EQ(p.growth_interval, 100);
  EXPECT_EQ(p.hysteresis, 3);
  const auto f = parse({"--config", path, "--init-scale", "256", "--growth-factor=1.5", "--backoff-factor", "0.75",
                        "--growth-interval", "10", "--hysteresis", "2"}).resolve();
  EXPECT_EQ(f.init_scale, 256.0);
  EXPECT_EQ(f.growth_factor, 1.5);
  EXPECT_EQ(f.backoff_factor, 0.75);
  EXPECT_EQ(f.growth_interval, 10);
  EXPECT_EQ(f.hysteresis, 2);
  const auto defaults = parse({}).resolve();
  EXPECT_EQ(defaults.init_scale, 65536.0);
  EXPECT_EQ(defaults.growth_interval, 2000);
  ASSERT_THROWS_WITH(amp::load_options(write_config("scaler_int", "growth_interval = 1e3\n")),
                     "bad value '1e3' for key 'growth_interval': expected an integer");
  ASSERT_THROWS_WITH(parse({"--init-scale", "big"}), "bad value 'big' for --init-scale: expected a finite number");
  ASSERT_THROWS_WITH(parse({"--backoff-factor", "2"}).resolve(), "backoff_factor must be in (0, 1), got 2.0");
  std::string help;
  try {
    parse({"--help"});
  } catch (const amp::HelpRequested& e) {
    help = e.what();
  }
  for (const char* flag : {"--init-scale", "--growth-factor", "--backoff-factor", "--growth-interval", "--hysteresis"}) {
    EXPECT_NE(help.find(flag), std::string::npos) << flag << " missing from\n" << help;
  }
}

namespace {

// Starts parse_options on `args` on a detached thread; the future gets the error message. A parse
// that never returns leaves its thread behind, so a hang fails the test instead of stalling the suite.
std::future<std::string> parse_error_on_a_thread(std::vector<std::string> args) {
  auto result = std::make_shared<std::promise<std::string>>();
  auto message = result->get_future();
  std::thread([args = std::move(args), result] {
    try {
      parse(args);
      result->set_value("(no error)");
    } catch (const std::invalid_argument& e) {
      result->set_value(e.what());
    } catch (...) {
      result->set_value("(an exception other than std::invalid_argument)");
    }
  }).detach();
  return message;
}

}  // namespace

TEST(ConfigTest, BoostMessagePlaceholdersInFlagsNeitherHangNorLeak) {
  // Boost formats its messages by replacing %placeholders% with the user's tokens until none is left:
  // these arguments used to loop forever inside its what() (found by fuzzing).
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--%original_token%="}, "amp: unknown command-line flag '--%original_token%'. Valid flags: --config, --help, --opt-level"},
      {{"--%canonical_option%="}, "amp: unknown command-line flag '--%canonical_option%'"},
      {{"--%option%="}, "amp: unknown command-line flag '--%option%'"},
      {{"---%option%="}, "amp: unknown command-line flag '---%option%'"},
      {{"--%value%="}, "amp: unknown command-line flag '--%value%'"},
      {{"--%prefix%="}, "amp: unknown command-line flag '--%prefix%'"},
      {{"-%original_token%"}, "amp: unknown command-line flag '-%original_token%'"},
      {{"--help=%original_token%"}, "amp: bad command line: the flag '--help' takes no value."},
      {{"--opt-level="}, "amp: bad command line: the flag '--opt-level' has no value after '='. Flags take a value"},
      {{"--opt-level"}, "amp: bad command line: the flag '--opt-level' needs a value. Flags take a value"},
      {{"--opt-level=%original_token%"}, "bad value '%original_token%' for --opt-level"},
  };
  std::vector<std::future<std::string>> running;
  for (const auto& c : cases) running.push_back(parse_error_on_a_thread(c.first));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].first.front());
    ASSERT_EQ(running[i].wait_until(deadline), std::future_status::ready)
        << "parse_options did not return within 20 s on '" << cases[i].first.front() << "'";
    const std::string message = running[i].get();
    EXPECT_NE(message.find(cases[i].second), std::string::npos) << "message: " << message;
  }
}
