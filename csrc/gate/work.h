#pragma once
// Part of the hook's native collective path; csrc/gate.cpp says why it exists.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "gate/telemetry.h"

namespace snapshotter {

namespace py = pybind11;
using c10::intrusive_ptr;

constexpr const char* kChannelMark = "|p2p:";
constexpr size_t kSweepAt = 64;

// A request that does not fit the gate's state; nothing was changed (BarrierError in Python).
struct GateError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline std::string channel(const std::string& group, int src, int dst) {
  return group + kChannelMark + std::to_string(src) + ">" + std::to_string(dst);
}

// Set by the module's atexit callback: the interpreter is about to finalize, on this thread.
inline std::atomic<bool>& exiting() {
  static std::atomic<bool> flag{false};
  return flag;
}

inline std::thread::id& exitingThread() {
  static std::thread::id id;
  return id;
}

inline void markExiting() {
  exitingThread() = std::this_thread::get_id();
  exiting().store(true);
}

// Whether this thread must not take the GIL back: the interpreter exits, and this is not the
// thread that finalizes it (which takes the GIL back as always: its finalizers may still call
// the gate).
inline bool mustPark() {
  return exiting().load() && std::this_thread::get_id() != exitingThread();
}

// Takes the GIL back for a thread that let it go. A daemon thread (the hook's control reader,
// a timer) that comes back once the interpreter exits is ended by CPython with pthread_exit,
// whose forced unwind through a noexcept destructor calls std::terminate: the rank aborts
// after its last step and its job fails. Such a thread parks instead, the exiting process
// takes it along; one already waiting for the GIL when the exit began unwinds, which is why
// the guards below declare their destructors noexcept(false) (pybind11 lets it through).
inline void restoreGil(PyThreadState* state) {
  while (mustPark()) {
    std::this_thread::sleep_for(std::chrono::hours(1));
  }
  PyEval_RestoreThread(state);
}

// py::gil_scoped_release for the module's bindings, with restoreGil's way back.
class ReleaseGil {
 public:
  ReleaseGil() : state_(PyEval_SaveThread()) {}
  ~ReleaseGil() noexcept(false) { restoreGil(state_); }
  ReleaseGil(const ReleaseGil&) = delete;
  ReleaseGil& operator=(const ReleaseGil&) = delete;

 private:
  PyThreadState* state_;
};

// Lets the GIL go while this thread blocks, when it holds it (a Python caller of `enter`, or a
// torch binding that kept it); otherwise nothing. Never held across a call into Python.
class MaybeReleaseGil {
 public:
  MaybeReleaseGil() {
    if (Py_IsInitialized() && PyGILState_Check()) {
      state_ = PyEval_SaveThread();
    }
  }
  ~MaybeReleaseGil() noexcept(false) {
    if (state_ != nullptr) {
      restoreGil(state_);
    }
  }
  MaybeReleaseGil(const MaybeReleaseGil&) = delete;
  MaybeReleaseGil& operator=(const MaybeReleaseGil&) = delete;

 private:
  PyThreadState* state_ = nullptr;
};

// What an op returns to its caller: the real work, until the communicator is torn down (see
// `_Handle` in resumable.py for why: a kept work pins gloo's context and its sockets).
class HandleWork : public c10d::Work {
 public:
  explicit HandleWork(intrusive_ptr<c10d::Work> work)
      : c10d::Work(-1, work->retrieveOpType()), work_(std::move(work)) {
    try {
      future_ = work_->getFuture();
    } catch (const std::exception&) {
      waiter_only_ = true;  // gloo's send, recv, reduce_scatter: done only to a waiter
    }
  }

  // The gate's side.
  bool done() {
    std::lock_guard<std::mutex> g(m_);
    return doneLocked();
  }

  void settle() {
    if (waiter_only_) {
      try {
        wait(kNoTimeout);
      } catch (const std::exception&) {
        // the caller's own wait raises it again
      }
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  // Record how long this op took from `issued` to completion under `key`: on the future's
  // completion (the communicator's thread, no GIL), or, for a waiter-only op, when its first
  // wait returns.
  void timeCompletion(std::shared_ptr<Telemetry> t, const std::string& key, int64_t seq,
                      Telemetry::Clock::time_point issued) {
    if (future_) {
      future_->addCallback([t = std::move(t), key, seq, issued](c10::ivalue::Future&) {
        t->record(key, seq, issued);
      });
      return;
    }
    std::lock_guard<std::mutex> g(m_);
    timing_ = std::move(t);
    timingKey_ = key;
    timingSeq_ = seq;
    issued_ = issued;
  }

  bool holdsWork() {
    std::lock_guard<std::mutex> g(m_);
    return static_cast<bool>(work_);
  }

  void release() {
    std::lock_guard<std::mutex> g(m_);
    if (!work_) {
      return;
    }
    if (future_ && future_->completed()) {
      ok_ = !future_->hasError();
    }
    work_.reset();
  }

  // c10d::Work.
  bool wait(std::chrono::milliseconds timeout) override {
    if (!waiter_only_) {
      intrusive_ptr<c10d::Work> work;
      {
        std::lock_guard<std::mutex> g(m_);
        if (!work_) {
          return ok_;
        }
        work = work_;
      }
      bool ok = work->wait(timeout);
      std::lock_guard<std::mutex> g(m_);
      waited_ = true;
      return ok;
    }
    std::lock_guard<std::mutex> wg(wait_m_);  // one wait: a second could block forever
    bool waited;
    {
      std::lock_guard<std::mutex> g(m_);
      waited = waited_;
    }
    if (!waited) {
      intrusive_ptr<c10d::Work> work;
      {
        std::lock_guard<std::mutex> g(m_);
        work = work_;
      }
      bool ok = ok_;
      std::exception_ptr error;
      try {
        if (work) {
          ok = work->wait(timeout);
        }
      } catch (...) {
        ok = false;
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> g(m_);
      ok_ = ok;
      error_ = error;
      waited_ = true;
      if (timing_) {
        timing_->record(timingKey_, timingSeq_, issued_);
        timing_.reset();
      }
    }
    std::lock_guard<std::mutex> g(m_);
    if (error_) {
      std::rethrow_exception(error_);
    }
    return ok_;
  }

  bool isCompleted() override {
    std::lock_guard<std::mutex> g(m_);
    return doneLocked();
  }

  bool isSuccess() const override {
    std::lock_guard<std::mutex> g(m_);
    if (!work_ || waiter_only_) {
      return ok_;
    }
    return work_->isSuccess();
  }

  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> g(m_);
    if (!work_ || waiter_only_) {
      return error_;
    }
    return work_->exception();
  }

  int sourceRank() const override {
    std::lock_guard<std::mutex> g(m_);
    TORCH_CHECK(work_, "snapshotter: source_rank() read after the communicator was rebuilt");
    return work_->sourceRank();
  }

  std::vector<at::Tensor> result() override {
    auto work = current();
    if (work) {
      return work->result();
    }
    if (future_ && future_->completed() && !future_->hasError()) {
      return future_->value().toTensorVector();
    }
    return {};
  }

  void synchronize() override {
    auto work = current();
    if (work) {
      work->synchronize();
    }
  }

  void abort() override {
    auto work = current();
    if (work) {
      work->abort();
    }
  }

  intrusive_ptr<c10::ivalue::Future> getFuture() override {
    TORCH_CHECK(future_, "Work::getFuture not implemented for this work");
    return future_;
  }

 private:
  bool doneLocked() const {
    if (waited_ || !work_) {
      return true;
    }
    return !waiter_only_ && work_->isCompleted();
  }

  intrusive_ptr<c10d::Work> current() {
    std::lock_guard<std::mutex> g(m_);
    return work_;
  }

  mutable std::mutex m_;
  std::mutex wait_m_;
  intrusive_ptr<c10d::Work> work_;
  intrusive_ptr<c10::ivalue::Future> future_;
  bool waiter_only_ = false;
  bool waited_ = false;
  bool ok_ = true;
  std::exception_ptr error_;
  std::shared_ptr<Telemetry> timing_;  // a waiter-only op's latency record, until its wait
  std::string timingKey_;
  int64_t timingSeq_ = 0;
  Telemetry::Clock::time_point issued_{};
};

// Whether the GIL may still be taken: not once the interpreter is finalizing (that aborts).
inline bool pythonAlive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

// A Python object that may be copied and dropped without the GIL: only the last owner takes
// it, to let go of the object (or leaks it once the interpreter is going away).
using PyRef = std::shared_ptr<py::object>;

inline PyRef pyRef(py::object o) {
  return PyRef(new py::object(std::move(o)), [](py::object* p) {
    if (pythonAlive()) {
      py::gil_scoped_acquire gil;
      delete p;
    } else {
      p->release();
      delete p;
    }
  });
}

// An op in flight: a native handle, or a Python object with done() and settle() (an op of a
// group still on the Python path, NCCL's; only those take the GIL, and only Python callers
// that let it go first, as every binding here and torch's collectives do, reach the gate).
struct Pending {
  intrusive_ptr<HandleWork> work;
  PyRef py;
  std::chrono::steady_clock::time_point at{};  // when it was issued

  bool done() const {
    if (work) {
      return work->done();
    }
    py::gil_scoped_acquire gil;
    return py->attr("done")().cast<bool>();
  }

  void settle() const {
    if (work) {
      work->settle();
      return;
    }
    py::gil_scoped_acquire gil;
    py->attr("settle")();
  }
};

}  // namespace snapshotter
