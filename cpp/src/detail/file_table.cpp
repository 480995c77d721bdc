// The file table: open files by index, reused slots, closed all at once when the engine closes.
#include "tutti/detail/file_table.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <mutex>

#include "tutti/error.hpp"

namespace tutti::detail {

FileTable::~FileTable() { close_all(); }

int FileTable::open(const std::string& path, bool writable, bool direct) {
  int flags = (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC | (direct ? O_DIRECT : 0);
  int fd = ::open(path.c_str(), flags);
  if (fd < 0) TUTTI_SYS_FAIL(errno, "open " + path, path);
  std::unique_lock lock(mu_);
  for (size_t i = 0; i < fds_.size(); ++i) {
    if (fds_[i] < 0) {
      fds_[i] = fd;
      return static_cast<int>(i);
    }
  }
  fds_.push_back(fd);
  return static_cast<int>(fds_.size() - 1);
}

void FileTable::close(int index) {
  std::unique_lock lock(mu_);
  const size_t i = static_cast<size_t>(index);
  TUTTI_EXPECT(index >= 0 && i < fds_.size() && fds_[i] >= 0,
               "no open file at index " + std::to_string(index));
  ::close(fds_[i]);
  fds_[i] = -1;
}

int FileTable::fd(int index) const {
  std::shared_lock lock(mu_);
  const size_t i = static_cast<size_t>(index);
  return (index >= 0 && i < fds_.size()) ? fds_[i] : -1;
}

size_t FileTable::size() const {
  std::shared_lock lock(mu_);
  return fds_.size();
}

void FileTable::close_all() {
  std::unique_lock lock(mu_);
  for (int& fd : fds_) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
}

}  // namespace tutti::detail
