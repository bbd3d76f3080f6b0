#pragma once

// Runs a built program (moe-reroute, moe-reroute-bench) as a child process,
// capturing its exit status, stdout and stderr.

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "test_dir.h"

namespace moe_reroute::tools {

struct Result {
  int status = -1;
  std::string out, err;
};

inline std::string slurp(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline Result run_program(const char* program, const std::vector<std::string>& args) {
  const TestDir capture;
  const std::string out_path = (capture / "stdout").string(),
                    err_path = (capture / "stderr").string();
  std::vector<char*> argv = {const_cast<char*>(program)};
  for (const std::string& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644), 1);
    ::dup2(::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644), 2);
    ::execv(program, argv.data());
    ::_exit(127);
  }
  int wait_status = 0;
  ::waitpid(pid, &wait_status, 0);
  return {WIFEXITED(wait_status) ? WEXITSTATUS(wait_status) : -1, slurp(out_path), slurp(err_path)};
}

}  // namespace moe_reroute::tools
