// A served model file rewritten in place (truncated, as `cp new.gguf model.gguf` begins by doing)
// loses pages the server has mapped; the next read of one raises SIGBUS inside a kernel, where no
// error can be thrown. The handler turns it into one line on stderr and a clean exit, with only
// async-signal-safe calls (write, _exit).
#include "ops.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace powerinfer {

namespace {

char bus_message[1024];
size_t bus_message_length = 0;
int bus_exit_status = 1;

void on_bus_error(int) {
  if (write(STDERR_FILENO, bus_message, bus_message_length) < 0) {
    // nothing left to report it to
  }
  _exit(bus_exit_status);
}

}  // namespace

void exit_on_bus_error(const std::string& message, int64_t status) {
  bus_message_length = std::min(message.size(), sizeof(bus_message));
  std::memcpy(bus_message, message.data(), bus_message_length);
  bus_exit_status = static_cast<int>(status);
  struct sigaction action {};
  action.sa_handler = on_bus_error;
  sigemptyset(&action.sa_mask);
  sigaction(SIGBUS, &action, nullptr);
}

}  // namespace powerinfer
