// The files an engine opened, shared by its submission paths (open while batches run).
#pragma once

#include <cstddef>
#include <shared_mutex>
#include <string>
#include <vector>

namespace tutti::detail {

class FileTable {
 public:
  FileTable() = default;
  ~FileTable();
  FileTable(const FileTable&) = delete;
  FileTable& operator=(const FileTable&) = delete;

  // Open path (O_DIRECT when direct); returns its index. Throws SysError.
  int open(const std::string& path, bool writable, bool direct);
  void close(int index);
  int fd(int index) const;  // -1 when closed or unknown
  size_t size() const;
  void close_all();

 private:
  mutable std::shared_mutex mu_;
  std::vector<int> fds_;
};

}  // namespace tutti::detail
