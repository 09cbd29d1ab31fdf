#pragma once
// A tiny assertion helper for the C++ tests (plain ctest executables, no gtest):
// EXPECT records a failure with file:line and goes on; EXPECT_THROWS expects an
// exception whose message contains a text; finish() prints a summary and gives
// the exit code.

#include <cstdio>
#include <exception>
#include <sstream>
#include <string>

namespace shardtorch_test {

inline int& failures() {
  static int count = 0;
  return count;
}
inline int& checks() {
  static int count = 0;
  return count;
}

inline void record(bool ok, const char* file, int line, const std::string& what) {
  ++checks();
  if (!ok) {
    ++failures();
    std::fprintf(stderr, "FAILED %s:%d: %s\n", file, line, what.c_str());
  }
}

inline int finish(const char* name) {
  std::printf("%s: %d checks, %d failed\n", name, checks(), failures());
  std::fflush(stdout);
  return failures() == 0 ? 0 : 1;
}

}  // namespace shardtorch_test

#define EXPECT(cond)                                                                     \
  do {                                                                                   \
    std::ostringstream what_;                                                            \
    what_ << #cond;                                                                      \
    ::shardtorch_test::record(static_cast<bool>(cond), __FILE__, __LINE__, what_.str()); \
  } while (0)

#define EXPECT_MSG(cond, message)                                                        \
  do {                                                                                   \
    std::ostringstream what_;                                                            \
    what_ << #cond << ": " << message;                                                   \
    ::shardtorch_test::record(static_cast<bool>(cond), __FILE__, __LINE__, what_.str()); \
  } while (0)

#define EXPECT_THROWS(statement, text)                                                     \
  do {                                                                                     \
    std::string error_;                                                                    \
    bool threw_ = false;                                                                   \
    try {                                                                                  \
      statement;                                                                           \
    } catch (const std::exception& e) {                                                    \
      threw_ = true;                                                                       \
      error_ = e.what();                                                                   \
    }                                                                                      \
    ::shardtorch_test::record(threw_ && error_.find(text) != std::string::npos, __FILE__,  \
                              __LINE__,                                                    \
                              std::string(#statement " should throw '") + (text) + "', " + \
                                  (threw_ ? "threw: " + error_ : "did not throw"));        \
  } while (0)
