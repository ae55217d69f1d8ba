// gil.cc: the gate through which C++ takes the GIL (gil.h), and the interrupt check of long work without it.
#include "gil.h"

#include <unistd.h>

#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace py = pybind11;

namespace gpipe::python {
namespace {

// Threads inside (between taking the GIL and giving it back), and whether it is closed. A thread inside
// may enter again (a step's Python work that calls the extension); once closing, no other thread does,
// so closing waits only for those inside to leave.
class Gate {
 public:
  bool enter() {
    if (depth_ > 0) return ++depth_, true;
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_ && std::this_thread::get_id() != exiting_) return false;
    ++inside_;
    depth_ = 1;
    return true;
  }

  void leave() {
    if (--depth_ > 0) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (--inside_ == 0) left_.notify_all();
  }

  // From the exiting thread, without the GIL (those inside may be waiting for it).
  void close() {
    std::unique_lock<std::mutex> lock(mutex_);
    closing_ = true;
    exiting_ = std::this_thread::get_id();
    left_.wait(lock, [this] { return inside_ == 0; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable left_;
  int inside_ = 0;
  bool closing_ = false;
  std::thread::id exiting_;
  static thread_local int depth_;
};

thread_local int Gate::depth_ = 0;

Gate& gate() {
  static Gate* const instance = new Gate();  // never destroyed: threads may reach it during exit
  return *instance;
}

}  // namespace

void close_gil_gate_at_exit() {
  py::module_::import("atexit").attr("register")(py::cpp_function([] {
    py::gil_scoped_release free;  // those inside may be waiting for the GIL to leave
    gate().close();
  }));
}

GilTaken::GilTaken() {
  if (gate().enter()) state_ = PyGILState_Ensure();
}

GilTaken::~GilTaken() {
  if (!state_) return;
  PyGILState_Release(*state_);
  gate().leave();
}

GilReleased::GilReleased() : state_(PyEval_SaveThread()) {}

GilReleased::~GilReleased() {
  if (!gate().enter())
    for (;;) ::pause();
  PyEval_RestoreThread(state_);
  gate().leave();
}

void throw_if_interrupted() {
  const GilTaken gil;
  if (!gil.held()) throw std::runtime_error("the Python interpreter is exiting");
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

}  // namespace gpipe::python
