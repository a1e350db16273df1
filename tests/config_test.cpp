// amp/config.h: INI files and flags, with Apex's keyword names; every bad input names the key,
// the value, and the file and line.
#include <filesystem>
#include <fstream>

#include "amp/config.h"
#include "support.h"

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
    const auto p = amp::load_options(entry.path().string()).resolve();
    const std::string stem = entry.path().stem().string();
    EXPECT_EQ(amp::to_string(p.opt_level), stem.substr(0, 2));
    if (p.opt_level != amp::OptLevel::O0) {
      EXPECT_EQ(p.low_precision_dtype, stem.find("bf16") != std::string::npos ? torch::kBFloat16 : torch::kHalf);
    }
    ++count;
  }
  EXPECT_EQ(count, 7);  // O0, and O1..O3 each in fp16 and bf16
}

TEST(ConfigTest, PositionalArgumentsAndBareDashesAreRefused) {
  // Found by the fuzzer: "--" ends Boost's option parsing, and what followed reached amp unvalidated.
  ASSERT_THROWS_WITH(parse({"--", "--loss-scale", "128"}), "unexpected command-line argument");
  ASSERT_THROWS_WITH(parse({"O2"}), "unexpected command-line argument 'O2'");
  ASSERT_THROWS_WITH(parse({"--opt-level", "O2", "extra"}), "unexpected command-line argument 'extra'");
}
