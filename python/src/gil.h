// gil.h: taking the GIL back from C++ while the interpreter may be exiting.
//
// A thread that takes the GIL once the interpreter has begun to finalize (a daemon thread's step outliving
// the main script) is ended by Python there and then, inside whatever C++ frames it is in: unwinding
// the pipeline's frames that way aborts the process. Asking Py_IsFinalizing() first leaves a window
// between the answer and the taking. So C++ frames take the GIL only through one gate, which Python's
// atexit (it runs before finalizing begins) closes once no thread is inside; after that only the
// exiting thread passes, and every other thread stays out of Python. Closing waits for the threads
// inside without a limit: a before_stage callback that never returns holds up the exit. (Only
// gpipe's own frames pass the gate; libtorch's take the GIL as they always did.)
#pragma once

#include <pybind11/pybind11.h>

#include <optional>

namespace gpipe::python {

// For long work without the GIL (a profile, a wait for the other ranks): Ctrl-C, or another signal
// Python's handler raises for, as that exception (KeyboardInterrupt); an exiting interpreter ends it.
void throw_if_interrupted();

// Closes the gate when the interpreter exits (atexit; the extension registers it once, on import).
void close_gil_gate_at_exit();

// The GIL taken for this scope by a thread running C++ (a device thread, or the caller inside a step)
// or, when the interpreter is exiting, not taken: held() says which.
class GilTaken {
 public:
  GilTaken();
  ~GilTaken();
  GilTaken(const GilTaken&) = delete;
  GilTaken& operator=(const GilTaken&) = delete;

  bool held() const { return state_.has_value(); }

 private:
  std::optional<PyGILState_STATE> state_;
};

// The GIL released for this scope, taken back through the gate at its end; when the interpreter is exiting
// instead, this thread waits there for the process to end.
class GilReleased {
 public:
  GilReleased();
  ~GilReleased();
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* state_;
};

}  // namespace gpipe::python
