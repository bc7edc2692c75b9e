#pragma once
// Part of the hook's native collective path; csrc/gate.cpp says why it exists.

#include <cstdlib>
#include <memory>

#include "gate/work.h"

namespace snapshotter {

enum class State { Idle, Holding, Armed, Parked, Suspended };

inline const char* stateName(State s) {
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
  explicit Gate(py::object onParked) : onParked_(std::move(onParked)) {
    // SNAPSHOTTER_TELEMETRY=0 turns the latency record off (bench/hook_overhead.py compares).
    const char* env = std::getenv("SNAPSHOTTER_TELEMETRY");
    if (env == nullptr || std::string(env) != "0") {
      telemetry_ = std::make_shared<Telemetry>();
    }
  }

  // Where ops record their latencies; null when the record is off.
  const std::shared_ptr<Telemetry>& telemetry() const {
    return telemetry_;
  }

  std::map<std::string, std::pair<int64_t, std::vector<Telemetry::Entry>>> latencies() {
    if (!telemetry_) {
      return {};
    }
    return telemetry_->latencies();
  }

  ~Gate() {
    // The callback (and any Python-made pending op) is a Python object: drop it with the GIL,
    // or leak it once the interpreter is going away (taking the GIL then would abort).
    pending_.clear();  // Python-made ops let go through their PyRef
    if (pythonAlive()) {
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
    if (telemetry_) {
      telemetry_->forget(key);
    }
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
    // The GIL is taken back only after the slow path let the gate's lock go: a thread never
    // waits for the GIL while it holds the lock.
    MaybeReleaseGil nogil;
    return enterSlow(key, native);
  }

 private:
  int64_t enterSlow(const std::string& key, bool native) {
    std::unique_lock<std::mutex> lk(m_);
    auto it = issued_.find(key);
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

 public:
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

  // Seconds the oldest op still in flight has been (0: none): a collective stuck this long
  // on a link that drops its traffic is what the agents reroute around.
  double oldestInFlightS() {
    MaybeReleaseGil nogil;
    std::lock_guard<std::mutex> g(m_);
    const auto now = std::chrono::steady_clock::now();
    double worst = 0.0;
    for (const auto& p : pending_) {
      if (!p.done()) {
        worst = std::max(worst, std::chrono::duration<double>(now - p.at).count());
      }
    }
    return worst;
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
    p.at = std::chrono::steady_clock::now();
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
  std::shared_ptr<Telemetry> telemetry_;
};

}  // namespace snapshotter
