#include "support.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace amp_test {

std::string message(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

std::string python_interpreter() {
  const char* env = std::getenv("AMP_PYTHON");
  return env && *env ? env : "python3";
}

bool python_has_torch() {
  static const bool have = std::system((python_interpreter() + " -c 'import torch' > /dev/null 2>&1").c_str()) == 0;
  return have;
}

namespace {

namespace fs = std::filesystem;

std::string file_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// FNV-1a, 64 bits: a key, not a security boundary.
uint64_t fnv1a(uint64_t hash, const std::string& bytes) {
  for (const unsigned char c : bytes) hash = (hash ^ c) * 1099511628211ull;
  return hash ^ 0xff;  // (a separator: "ab" + "c" and "a" + "bc" differ)
}

// What a reference's outputs depend on beside its script and inputs: the interpreter and its torch's version file
// (found without importing torch).
const std::string& python_fingerprint() {
  static const std::string fingerprint = [] {
    std::string out = python_interpreter();
    const std::string command = python_interpreter() +
        " -c 'import importlib.util as u; s = u.find_spec(\"torch\"); print(s.origin if s else \"\")' 2> /dev/null";
    if (FILE* pipe = ::popen(command.c_str(), "r")) {
      char buffer[4096];
      std::string origin;
      while (std::fgets(buffer, sizeof buffer, pipe)) origin += buffer;
      ::pclose(pipe);
      while (!origin.empty() && (origin.back() == '\n' || origin.back() == '\r')) origin.pop_back();
      if (!origin.empty()) out += file_bytes(fs::path(origin).parent_path() / "version.py");
    }
    return out;
  }();
  return fingerprint;
}

// NOTE [Python references run once]: a reference's outputs, keyed by its script, arguments, input files and Python,
// are kept under AMP_PYTHON_REFERENCE_CACHE (build/python-references for scripts/build.sh's flavors), so the suites
// and flavors of one test command compute each once. An entry is written to a temporary directory and renamed into
// place: processes that computed it at once keep the first.
fs::path cache_entry(const std::string& script, const std::vector<std::string>& args, const fs::path& dir,
                     const std::vector<std::string>& inputs) {
  const char* env = std::getenv("AMP_PYTHON_REFERENCE_CACHE");
#ifdef AMP_PYTHON_REFERENCE_CACHE
  const std::string root = env ? env : AMP_PYTHON_REFERENCE_CACHE;
#else
  const std::string root = env ? env : "";
#endif
  if (root.empty()) return {};
  uint64_t key = fnv1a(14695981039346656037ull, file_bytes(script));
  key = fnv1a(key, python_fingerprint());
  for (const auto& a : args) key = fnv1a(key, a);
  for (const auto& i : inputs) key = fnv1a(fnv1a(key, i), file_bytes(dir / i));
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(key));
  return fs::path(root) / (fs::path(script).stem().string() + "-" + hex);
}

}  // namespace

int run_python(const std::string& script, const std::vector<std::string>& args, const fs::path& dir,
               const std::vector<std::string>& inputs) {
  const fs::path entry = cache_entry(script, args, dir, inputs);
  std::error_code ec;
  if (!entry.empty() && fs::exists(entry / ".complete", ec)) {
    fs::copy(entry, dir, fs::copy_options::overwrite_existing | fs::copy_options::recursive, ec);
    if (!ec) return 0;
  }
  std::string command = "timeout 300 " + python_interpreter() + " '" + script + "'";
  for (const auto& a : args) command += " '" + a + "'";
  command += " '" + dir.string() + "' > '" + (dir / "python.log").string() + "' 2>&1";
  const int status = std::system(command.c_str());
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (rc == 0 && !entry.empty()) {
    const fs::path staging = entry.string() + ".tmp" + std::to_string(::getpid());
    fs::create_directories(entry.parent_path(), ec);
    fs::copy(dir, staging, fs::copy_options::overwrite_existing | fs::copy_options::recursive, ec);
    if (!ec) std::ofstream(staging / ".complete") << script << "\n";
    if (ec || (fs::rename(staging, entry, ec), ec)) fs::remove_all(staging, ec);  // another process stored it first
  }
  return rc;
}

std::filesystem::path run_python_reference(const std::string& script, const std::string& name) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / ("amp_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  if (run_python(script, {}, dir, {}) != 0) {
    ADD_FAILURE() << "python3 '" << script << "' '" << dir.string() << "' failed; see " << (dir / "python.log");
    return {};
  }
  return dir;
}

bool cpu_computes(c10::ScalarType dtype) {
  try {
    torch::NoGradGuard no_grad;
    auto a = torch::ones({4, 4}, dtype);
    (void)torch::mm(a, a);
    (void)torch::conv2d(torch::ones({1, 2, 5, 5}, dtype), torch::ones({2, 2, 3, 3}, dtype));
    (void)torch::batch_norm(torch::ones({2, 2, 3, 3}, dtype), torch::ones({2}), torch::zeros({2}), torch::zeros({2}),
                            torch::ones({2}), false, 0.1, 1e-5, false);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  if (a.numel() == 0) return true;  // (an empty tensor's data pointer may be null, which memcmp must not see)
  auto ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), static_cast<size_t>(ca.numel()) * ca.element_size()) == 0;
}

bool built_with_cuda() {
#ifdef AMP_TEST_CUDA
  return true;
#else
  return false;
#endif
}

std::vector<LevelCase> level_cases(const std::vector<const char*>& levels, bool o0_once) {
  std::vector<LevelCase> out;
  for (const auto device : test_devices()) {
    for (const char* level : levels) {
      for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
        if (o0_once && std::string(level) == "O0" && dtype != torch::kBFloat16) continue;
        out.push_back({level, dtype, device});
      }
    }
  }
  return out;
}

std::string level_case_name(const ::testing::TestParamInfo<LevelCase>& info) {
  return std::string(info.param.level) + "_" + dtype_label(info.param.dtype) + device_suffix(info.param.device);
}

void use_deterministic_fp32(c10::DeviceType device) {
  if (device != torch::kCUDA) return;
  auto& context = at::globalContext();
  context.setDeterministicCuDNN(true);
  context.setBenchmarkCuDNN(false);
  context.setAllowTF32CuBLAS(false);
  context.setAllowTF32CuDNN(false);
}

}  // namespace amp_test
