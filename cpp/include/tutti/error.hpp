// Errors that cross into Python.
//
// SysError carries an errno and the file it concerns; the bindings turn it into
// Python's OSError(errno, strerror, filename). Error is a programming or setup
// mistake and becomes ValueError. Both record the C++ file and line.
#pragma once

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace tutti {

class Error : public std::runtime_error {
 public:
  Error(const std::string& msg, const char* file, int line)
      : std::runtime_error(msg + " [" + file + ":" + std::to_string(line) + "]") {}
};

class SysError : public std::runtime_error {
 public:
  SysError(int err, const std::string& what, const std::string& path, const char* file, int line)
      : std::runtime_error(what + ": " + std::strerror(err) + " [" + file + ":" +
                           std::to_string(line) + "]"),
        err_(err),
        path_(path) {}
  int err() const { return err_; }
  const std::string& path() const { return path_; }

 private:
  int err_;
  std::string path_;
};

}  // namespace tutti

// Raise tutti::Error (-> ValueError) unless cond holds.
#define TUTTI_EXPECT(cond, msg)                                  \
  do {                                                           \
    if (!(cond)) throw ::tutti::Error((msg), __FILE__, __LINE__); \
  } while (0)

// Raise tutti::SysError (-> OSError) with a positive errno value.
#define TUTTI_SYS_FAIL(err, what, path) \
  throw ::tutti::SysError((err), (what), (path), __FILE__, __LINE__)
