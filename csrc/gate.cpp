// The hook's collective path in native code: the quiesce barrier (`Gate`) and a c10d backend
// (`CountingBackend`) that counts every op in front of the real gloo backend it forwards to.
//
// Why native: a Python ProcessGroup subclass sits behind pybind's trampoline, so every op that
// C++ issues (DDP's Reducer, the dispatcher's functional collectives) took the GIL, crossed into
// Python and back, and wrapped its work in a Python object: 20-60 us a collective, 1.1-1.9x the
// step time of a DDP job with small buckets. Here the op never leaves C++ between freezes: one
// uncontended mutex, one counter, one small allocation.
//
// `Gate` is the state machine of snapshotter/hook/barrier.py (the reference; its docstring draws
// it), with the same methods, so that the control thread drives either. Python is entered only
// to report "parked" (once per freeze) and to poll Python-made ops (a group still on the Python
// path): never on the path of an op between freezes.
//
// Built by deploy/build_native.py against the torch it runs with; snapshotter/hook/native.py
// loads it only when that torch is the one the rank imports.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

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

namespace py = pybind11;
using c10::intrusive_ptr;

namespace snapshotter {

constexpr const char* kChannelMark = "|p2p:";
constexpr size_t kSweepAt = 64;

// A request that does not fit the gate's state; nothing was changed (BarrierError in Python).
struct GateError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string channel(const std::string& group, int src, int dst) {
  return group + kChannelMark + std::to_string(src) + ">" + std::to_string(dst);
}

// Lets the GIL go while this thread blocks, when it holds it (a Python caller of `enter`, or a
// torch binding that kept it); otherwise nothing. Never held across a call into Python.
class MaybeReleaseGil {
 public:
  MaybeReleaseGil() {
    if (Py_IsInitialized() && PyGILState_Check()) {
      state_ = PyEval_SaveThread();
    }
  }
  ~MaybeReleaseGil() {
    if (state_ != nullptr) {
      PyEval_RestoreThread(state_);
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
};

// A Python object that may be copied and dropped without the GIL: only the last owner takes
// it, to let go of the object (or leaks it once the interpreter is going away).
using PyRef = std::shared_ptr<py::object>;

PyRef pyRef(py::object o) {
  return PyRef(new py::object(std::move(o)), [](py::object* p) {
    if (Py_IsInitialized() && !_Py_IsFinalizing()) {
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

enum class State { Idle, Holding, Armed, Parked, Suspended };

const char* stateName(State s) {
  switch (s) {
    case State::Idle:
      return "idle";
    case State::Holding:
      return "holding";
    case State::Armed:
      return "armed";
    case State::Parked:
      return "parked";
    case State::Suspended:
      return "suspended";
  }
  return "?";
}

// The quiesce barrier (snapshotter/hook/barrier.py draws its states).
class Gate {
 public:
  explicit Gate(py::object onParked) : onParked_(std::move(onParked)) {}

  ~Gate() {
    // The callback (and any Python-made pending op) is a Python object: drop it with the GIL,
    // or leak it once the interpreter is going away (taking the GIL then would abort).
    pending_.clear();  // Python-made ops let go through their PyRef
    if (Py_IsInitialized() && !_Py_IsFinalizing()) {
      py::gil_scoped_acquire gil;
      onParked_ = py::object();
      return;
    }
    onParked_.release();
  }

  void addGroup(const std::string& key) {
    std::lock_guard<std::mutex> g(m_);
    issued_.emplace(key, 0);
  }

  void removeGroup(const std::string& key) {
    std::lock_guard<std::mutex> g(m_);
    issued_.erase(key);
    const std::string prefix = key + kChannelMark;
    for (auto it = issued_.begin(); it != issued_.end();) {
      if (it->first.compare(0, prefix.size(), prefix) == 0) {
        it = issued_.erase(it);
      } else {
        ++it;
      }
    }
    cv_.notify_all();
  }

  void setupBegin() {
    MaybeReleaseGil nogil;
    std::unique_lock<std::mutex> lk(m_);
    cv_.wait(lk, [&] {
      return state_ != State::Holding && state_ != State::Parked && state_ != State::Suspended;
    });
    ++setups_;
  }

  void setupEnd() {
    std::optional<Report> report;
    {
      std::lock_guard<std::mutex> g(m_);
      --setups_;
      cv_.notify_all();
      if (state_ == State::Armed) {
        report = quiescedLocked();
      }
    }
    if (report) {
      callParked(*report);
    }
  }

  // Block while this op may not be issued; then count it and return its seq. `native` ops are
  // "being issued" until `track` (or `untrack`): the rank is never reported quiesced between.
  int64_t enter(const std::string& key, bool native) {
    std::unique_lock<std::mutex> lk(m_);
    auto it = issued_.find(key);
    if (state_ == State::Idle && it != issued_.end()) {  // the path of every op between freezes
      int64_t seq = ++it->second;
      issuing_ += native ? 1 : 0;
      return seq;
    }
    lk.unlock();
    MaybeReleaseGil nogil;
    lk.lock();
    const auto me = std::this_thread::get_id();
    while (true) {
      it = issued_.find(key);
      if (it == issued_.end()) {
        const auto mark = key.find(kChannelMark);
        if (mark == std::string::npos || issued_.count(key.substr(0, mark)) == 0) {
          throw GateError("collective on unknown or destroyed group '" + key + "'");
        }
        it = issued_.emplace(key, 0).first;
      }
      const int64_t seq = it->second + 1;
      if (!mustWaitLocked(key, seq)) {
        it->second = seq;
        issuing_ += native ? 1 : 0;
        return seq;
      }
      if (state_ == State::Armed && !parkedAt_ && targetOf(key) == seq) {
        parkedAt_ = std::make_pair(key, seq);
        parker_ = me;
      }
      if (state_ == State::Armed && parker_ == me) {
        parkLocked(lk);
        continue;  // the state may have moved while the lock was let go
      }
      cv_.wait(lk);
    }
  }

  void track(intrusive_ptr<HandleWork> work) {
    std::lock_guard<std::mutex> g(m_);
    pushLocked(Pending{std::move(work), PyRef()});
    --issuing_;
    if (issuing_ == 0 && state_ == State::Armed) {
      cv_.notify_all();
    }
  }

  void untrack() {  // a native op that raised instead of returning a work
    std::lock_guard<std::mutex> g(m_);
    --issuing_;
    cv_.notify_all();
  }

  void trackPy(py::object op) {
    // Called from Python (GIL held): polling Python pendings would take the GIL under our
    // lock, so sweep with the GIL let go first.
    Pending p{intrusive_ptr<HandleWork>(), pyRef(std::move(op))};
    MaybeReleaseGil nogil;
    std::lock_guard<std::mutex> g(m_);
    pushLocked(std::move(p));
  }

  int64_t inFlight() {
    MaybeReleaseGil nogil;
    std::lock_guard<std::mutex> g(m_);
    int64_t n = 0;
    for (const auto& p : pending_) {
      n += p.done() ? 0 : 1;
    }
    return n;
  }

  int64_t held() {  // entries kept, finished or not (a test checks nothing finished piles up)
    std::lock_guard<std::mutex> g(m_);
    return static_cast<int64_t>(pending_.size());
  }

  std::string state() {
    std::lock_guard<std::mutex> g(m_);
    return stateName(state_);
  }

  std::map<std::string, int64_t> counts() {
    std::lock_guard<std::mutex> g(m_);
    return {issued_.begin(), issued_.end()};
  }

  std::map<std::string, int64_t> prepare(const std::string& freeze) {
    std::lock_guard<std::mutex> g(m_);
    if (state_ != State::Idle && state_ != State::Holding) {
      throw GateError(
          "cannot prepare freeze '" + freeze + "': barrier is " + stateName(state_));
    }
    if (setups_ > 0) {
      throw GateError(
          "cannot prepare freeze '" + freeze +
          "': the rank is setting up a process group (init_process_group/new_group); retry "
          "once it runs");
    }
    state_ = State::Holding;
    freeze_ = freeze;
    return {issued_.begin(), issued_.end()};
  }

  void arm(const std::string& freeze, const std::map<std::string, int64_t>& targets) {
    std::optional<Report> report;
    {
      MaybeReleaseGil nogil;
      std::unique_lock<std::mutex> lk(m_);
      if (state_ != State::Idle && state_ != State::Holding) {
        throw GateError("cannot arm freeze '" + freeze + "': barrier is " + stateName(state_));
      }
      std::unordered_map<std::string, int64_t> mine;
      for (const auto& [k, v] : targets) {
        const auto mark = k.find(kChannelMark);
        const std::string group = mark == std::string::npos ? k : k.substr(0, mark);
        if (issued_.count(k) || issued_.count(group)) {
          mine.emplace(k, v);
        }
      }
      std::string passed;
      for (const auto& [k, v] : std::map<std::string, int64_t>(mine.begin(), mine.end())) {
        auto it = issued_.find(k);
        const int64_t n = it == issued_.end() ? 0 : it->second;
        if (n >= v) {
          passed += std::string(passed.empty() ? "" : ", ") + "group " + k + " target " +
              std::to_string(v) + " but " + std::to_string(n) + " already issued";
        }
      }
      if (!passed.empty()) {
        toIdleLocked();
        throw GateError("freeze '" + freeze + "': target already passed (" + passed + ")");
      }
      state_ = State::Armed;
      freeze_ = freeze;
      targets_ = std::move(mine);
      parkedAt_.reset();
      cv_.notify_all();
      if (issued_.empty()) {
        report = quiescedLocked();
      }
    }
    if (report) {
      callParked(*report);
    }
  }

  void abort(const std::string& freeze) {
    std::lock_guard<std::mutex> g(m_);
    if (state_ == State::Suspended) {
      throw GateError(
          "cannot abort freeze '" + freeze + "': communicators are torn down; resume instead");
    }
    toIdleLocked();
  }

  bool expireHold(const std::string& freeze) {
    std::lock_guard<std::mutex> g(m_);
    if (state_ == State::Holding && freeze_ == freeze) {
      toIdleLocked();
      return true;
    }
    return false;
  }

  void suspend(const std::string& freeze) {
    std::lock_guard<std::mutex> g(m_);
    if (state_ != State::Parked) {
      throw GateError(
          "cannot suspend freeze '" + freeze + "': barrier is " + stateName(state_) +
          ", not parked");
    }
    state_ = State::Suspended;
  }

  void release(const std::string& freeze) {
    std::lock_guard<std::mutex> g(m_);
    if (state_ != State::Suspended) {
      throw GateError(
          "cannot resume freeze '" + freeze + "': barrier is " + stateName(state_) +
          ", not suspended");
    }
    toIdleLocked();
  }

 private:
  struct Report {
    std::string freeze;
    std::optional<std::pair<std::string, int64_t>> at;
  };

  int64_t targetOf(const std::string& key) const {
    auto it = targets_.find(key);
    return it == targets_.end() ? -1 : it->second;
  }

  bool mustWaitLocked(const std::string& key, int64_t seq) const {
    if (state_ == State::Holding || state_ == State::Parked || state_ == State::Suspended) {
      return true;
    }
    if (state_ == State::Armed) {
      return targetOf(key) == seq;
    }
    return false;
  }

  void pushLocked(Pending p) {
    if (pending_.size() >= kSweepAt) {
      // Callers finish ops in any order: one left undone at the front must not keep every
      // later one (and its tensors) alive.
      std::deque<Pending> kept;
      for (auto& q : pending_) {
        if (!q.done()) {
          kept.push_back(std::move(q));
        }
      }
      pending_.swap(kept);
    } else {
      while (!pending_.empty() && pending_.front().done()) {
        pending_.pop_front();
      }
    }
    pending_.push_back(std::move(p));
  }

  const Pending* unsettledLocked() {
    while (!pending_.empty() && pending_.front().done()) {
      pending_.pop_front();
    }
    return pending_.empty() ? nullptr : &pending_.front();
  }

  std::optional<Report> quiescedLocked() {
    if (setups_ > 0 || issuing_ > 0) {
      return std::nullopt;
    }
    if ((parkedAt_ || issued_.empty()) && unsettledLocked() == nullptr) {
      state_ = State::Parked;
      cv_.notify_all();
      return Report{freeze_, parkedAt_};
    }
    return std::nullopt;
  }

  // The parker's turn: report quiesced, or settle one op still in flight. Called and returns
  // with the lock held; lets it go around the report and the settle.
  void parkLocked(std::unique_lock<std::mutex>& lk) {
    auto report = quiescedLocked();
    if (report) {
      lk.unlock();
      callParked(*report);
      lk.lock();
      return;
    }
    const Pending* op = unsettledLocked();
    if (op == nullptr) {  // a setup or an op being issued: it reports or tracks soon
      cv_.wait_for(lk, std::chrono::milliseconds(50));
      return;
    }
    Pending held = *op;
    lk.unlock();
    held.settle();
    lk.lock();
  }

  void callParked(const Report& report) {
    py::gil_scoped_acquire gil;
    py::object at = py::none();
    if (report.at) {
      at = py::make_tuple(report.at->first, report.at->second);
    }
    onParked_(report.freeze, at);
  }

  void toIdleLocked() {
    state_ = State::Idle;
    targets_.clear();
    parkedAt_.reset();
    parker_ = std::thread::id();
    cv_.notify_all();
  }

  py::object onParked_;
  std::mutex m_;
  std::condition_variable cv_;
  State state_ = State::Idle;
  std::unordered_map<std::string, int64_t> issued_;
  std::deque<Pending> pending_;
  std::thread::id parker_;
  std::unordered_map<std::string, int64_t> targets_;
  std::string freeze_;
  std::optional<std::pair<std::string, int64_t>> parkedAt_;
  int setups_ = 0;
  int64_t issuing_ = 0;
};

// A c10d backend that counts every op on the gate and forwards it to the real backend it holds
// (`inner`), which the hook drops at a freeze and replaces at a resume; the ProcessGroup the
// script, DDP and DeviceMesh hold keeps this backend throughout.
class CountingBackend : public c10d::Backend {
 public:
  CountingBackend(
      int rank,
      int size,
      std::shared_ptr<Gate> gate,
      std::string key,
      std::string name)
      : c10d::Backend(rank, size),
        gate_(std::move(gate)),
        key_(std::move(key)),
        name_(std::move(name)) {}

  void setInner(intrusive_ptr<c10d::Backend> inner) {
    std::lock_guard<std::mutex> g(m_);
    inner_ = std::move(inner);
  }

  intrusive_ptr<c10d::Backend> getInner() {
    std::lock_guard<std::mutex> g(m_);
    return inner_;
  }

  // Drop the real backend (at a freeze, once nothing is in flight): every handle a caller
  // still holds lets go of its real work first, so the communicator's sockets close.
  void clearInner() {
    std::vector<intrusive_ptr<HandleWork>> live;
    {
      std::lock_guard<std::mutex> g(m_);
      for (auto& w : handles_) {
        auto h = w.lock();
        if (h) {
          live.push_back(std::move(h));
        }
      }
      handles_.clear();
    }
    for (auto& h : live) {
      h->release();
    }
    std::lock_guard<std::mutex> g(m_);
    inner_.reset();
  }

  bool destroyed() {
    std::lock_guard<std::mutex> g(m_);
    return destroyed_;
  }

  const std::string& key() const {
    return key_;
  }

  const std::string getBackendName() const override {
    return name_;
  }

  bool supportsSplitting() const override {
    return false;
  }

  bool supportsCoalescing() const override {
    return false;
  }

  void setTimeout(std::chrono::milliseconds timeout) override {
    auto inner = getInner();
    if (inner) {
      inner->setTimeout(timeout);
    }
  }

  void startCoalescing() override {
    refuse("the coalescing manager (_coalescing_manager / batch_isend_irecv)");
  }

  intrusive_ptr<c10d::Work> endCoalescing() override {
    refuse("the coalescing manager (_coalescing_manager / batch_isend_irecv)");
    return {};
  }

  void setSequenceNumberForGroup() override {
    current()->setSequenceNumberForGroup();
  }

  uint64_t getSequenceNumberForGroup() override {
    return current()->getSequenceNumberForGroup();
  }

  void shutdown() override {
    auto inner = forget();
    if (inner) {
      inner->shutdown();
    }
  }

  void abort() override {
    auto inner = forget();
    if (inner) {
      inner->abort();
    }
  }

  void setGroupUid(const std::string& uid) override {
    c10d::Backend::setGroupUid(uid);
    auto inner = getInner();
    if (inner) {
      inner->setGroupUid(uid);
    }
  }

#define SNAP_FORWARD(NAME, PARAMS, ARGS)                                          \
  intrusive_ptr<c10d::Work> NAME PARAMS override {                                \
    return issue(key_, [&](const intrusive_ptr<c10d::Backend>& b) { return b->NAME ARGS; }); \
  }

  SNAP_FORWARD(
      broadcast,
      (std::vector<at::Tensor> & t, const c10d::BroadcastOptions& o),
      (t, o))
  SNAP_FORWARD(
      allreduce,
      (std::vector<at::Tensor> & t, const c10d::AllreduceOptions& o),
      (t, o))
  SNAP_FORWARD(
      allreduce_sparse,
      (std::vector<at::Tensor> & t, const c10d::AllreduceOptions& o),
      (t, o))
  SNAP_FORWARD(
      allreduce_coalesced,
      (std::vector<at::Tensor> & t, const c10d::AllreduceCoalescedOptions& o),
      (t, o))
  SNAP_FORWARD(reduce, (std::vector<at::Tensor> & t, const c10d::ReduceOptions& o), (t, o))
  SNAP_FORWARD(
      allgather,
      (std::vector<std::vector<at::Tensor>> & out,
       std::vector<at::Tensor>& in,
       const c10d::AllgatherOptions& o),
      (out, in, o))
  SNAP_FORWARD(
      _allgather_base,
      (at::Tensor & out, at::Tensor& in, const c10d::AllgatherOptions& o),
      (out, in, o))
  SNAP_FORWARD(
      allgather_coalesced,
      (std::vector<std::vector<at::Tensor>> & out,
       std::vector<at::Tensor>& in,
       const c10d::AllgatherOptions& o),
      (out, in, o))
  SNAP_FORWARD(
      allgather_into_tensor_coalesced,
      (std::vector<at::Tensor> & out,
       std::vector<at::Tensor>& in,
       const c10d::AllgatherOptions& o),
      (out, in, o))
  SNAP_FORWARD(
      gather,
      (std::vector<std::vector<at::Tensor>> & out,
       std::vector<at::Tensor>& in,
       const c10d::GatherOptions& o),
      (out, in, o))
  SNAP_FORWARD(
      scatter,
      (std::vector<at::Tensor> & out,
       std::vector<std::vector<at::Tensor>>& in,
       const c10d::ScatterOptions& o),
      (out, in, o))
  SNAP_FORWARD(
      reduce_scatter,
      (std::vector<at::Tensor> & out,
       std::vector<std::vector<at::Tensor>>& in,
       const c10d::ReduceScatterOptions& o),
      (out, in, o))
  SNAP_FORWARD(
      _reduce_scatter_base,
      (at::Tensor & out, at::Tensor& in, const c10d::ReduceScatterOptions& o),
      (out, in, o))
  SNAP_FORWARD(
      reduce_scatter_tensor_coalesced,
      (std::vector<at::Tensor> & out,
       std::vector<at::Tensor>& in,
       const c10d::ReduceScatterOptions& o),
      (out, in, o))
  SNAP_FORWARD(
      alltoall_base,
      (at::Tensor & out,
       at::Tensor& in,
       std::vector<int64_t>& outSplit,
       std::vector<int64_t>& inSplit,
       const c10d::AllToAllOptions& o),
      (out, in, outSplit, inSplit, o))
  SNAP_FORWARD(
      alltoall,
      (std::vector<at::Tensor> & out,
       std::vector<at::Tensor>& in,
       const c10d::AllToAllOptions& o),
      (out, in, o))
  SNAP_FORWARD(barrier, (const c10d::BarrierOptions& o), (o))
#undef SNAP_FORWARD

  void monitoredBarrier(const c10d::BarrierOptions& o, bool waitAllRanks) override {
    gate_->enter(key_, false);  // synchronous: nothing stays in flight
    current()->monitoredBarrier(o, waitAllRanks);
  }

  // Point-to-point ops count per channel (peer and direction), not with the collectives: how
  // many a rank issues on a group differs from its peers'.
  intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& t, int dst, int tag) override {
    return issue(channel(key_, getRank(), dst), [&](const intrusive_ptr<c10d::Backend>& b) {
      return b->send(t, dst, tag);
    });
  }

  intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& t, int src, int tag) override {
    return issue(channel(key_, src, getRank()), [&](const intrusive_ptr<c10d::Backend>& b) {
      return b->recv(t, src, tag);
    });
  }

  intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>&, int) override {
    TORCH_CHECK(
        false,
        "snapshotter: recv from any source is not supported on a resumable process group (a "
        "freeze could not tell which peer's message it is); name the source rank");
  }

 private:
  [[noreturn]] void refuse(const char* what) const {
    TORCH_CHECK(
        false,
        "snapshotter: ",
        what,
        " is not supported on a resumable process group; run without snapshotter or avoid it");
  }

  intrusive_ptr<c10d::Backend> current() {
    std::lock_guard<std::mutex> g(m_);
    TORCH_CHECK(
        inner_,
        "snapshotter: process group '",
        key_,
        "' has no communicator (torn down for a freeze, or destroyed)");
    return inner_;
  }

  intrusive_ptr<c10d::Backend> forget() {
    {
      std::lock_guard<std::mutex> g(m_);
      if (destroyed_) {
        return {};
      }
      destroyed_ = true;
    }
    gate_->removeGroup(key_);
    std::lock_guard<std::mutex> g(m_);
    auto inner = std::move(inner_);
    inner_.reset();
    return inner;
  }

  template <typename F>
  intrusive_ptr<c10d::Work> issue(const std::string& key, F&& call) {
    gate_->enter(key, true);
    intrusive_ptr<HandleWork> handle;
    try {
      auto work = call(current());
      handle = c10::make_intrusive<HandleWork>(std::move(work));
    } catch (...) {
      gate_->untrack();
      throw;
    }
    {
      std::lock_guard<std::mutex> g(m_);
      if (handles_.size() >= sweepAt_) {
        std::vector<c10::weak_intrusive_ptr<HandleWork>> live;
        for (auto& w : handles_) {
          if (!w.expired()) {
            live.push_back(std::move(w));
          }
        }
        handles_.swap(live);
        sweepAt_ = std::max<size_t>(kSweepAt, handles_.size() * 2);
      }
      handles_.emplace_back(handle);
    }
    gate_->track(handle);
    return handle;
  }

  std::shared_ptr<Gate> gate_;
  const std::string key_;
  const std::string name_;
  std::mutex m_;
  intrusive_ptr<c10d::Backend> inner_;
  std::vector<c10::weak_intrusive_ptr<HandleWork>> handles_;
  size_t sweepAt_ = kSweepAt;
  bool destroyed_ = false;
};

}  // namespace snapshotter

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace snapshotter;
  py::register_exception<GateError>(m, "GateError");
  m.def("channel", &channel);
  // Whether a work an op returned still holds the real work (False once a teardown released it).
  m.def("holds_work", [](const intrusive_ptr<c10d::Work>& w) {
    auto* h = dynamic_cast<HandleWork*>(w.get());
    TORCH_CHECK(h != nullptr, "not a work of a resumable group");
    return h->holdsWork();
  });
  // Every method but `track` lets the GIL go before it takes the gate's lock: a thread holding
  // that lock may need the GIL (to report parked, or to poll a Python-made op).
  using nogil = py::call_guard<py::gil_scoped_release>;
  py::class_<Gate, std::shared_ptr<Gate>>(m, "Gate")
      .def(py::init<py::object>())
      .def("add_group", &Gate::addGroup, nogil())
      .def("remove_group", &Gate::removeGroup, nogil())
      .def("setup_begin", &Gate::setupBegin, nogil())
      .def("setup_end", &Gate::setupEnd, nogil())
      .def(
          "enter",
          [](Gate& g, const std::string& key) { return g.enter(key, false); },
          nogil())
      .def("track", &Gate::trackPy)
      .def("in_flight", &Gate::inFlight, nogil())
      .def("held", &Gate::held, nogil())
      .def("state", &Gate::state, nogil())
      .def("counts", &Gate::counts, nogil())
      .def("prepare", &Gate::prepare, nogil())
      .def("arm", &Gate::arm, nogil())
      .def("abort", &Gate::abort, nogil())
      .def("expire_hold", &Gate::expireHold, nogil())
      .def("suspend", &Gate::suspend, nogil())
      .def("release", &Gate::release, nogil());
  py::class_<CountingBackend, c10d::Backend, intrusive_ptr<CountingBackend>>(
      m, "CountingBackend", py::dynamic_attr())
      .def(py::init([](int rank, int size, std::shared_ptr<Gate> gate, std::string key,
                       std::string name) {
        return c10::make_intrusive<CountingBackend>(
            rank, size, std::move(gate), std::move(key), std::move(name));
      }))
      .def("set_inner", &CountingBackend::setInner)
      .def("get_inner", &CountingBackend::getInner)
      .def("clear_inner", &CountingBackend::clearInner, py::call_guard<py::gil_scoped_release>())
      .def("destroyed", &CountingBackend::destroyed)
      .def_property_readonly("key", &CountingBackend::key);
}
