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
// gate/work.h: the work handed to callers and what the gate keeps in flight; gate/gate.h: the
// barrier; gate/backend.h: the counting backend; here: the Python module.
//
// Built by `python -m snapshotter.hook.native --build` against the torch it runs with;
// snapshotter/hook/native.py loads it only when that torch is the one the rank imports.

#include "gate/backend.h"

namespace py = pybind11;
using c10::intrusive_ptr;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace snapshotter;
  py::register_exception<GateError>(m, "GateError");
  // Before the interpreter finalizes, threads that let the GIL go must not take it back (see
  // restoreGil); atexit runs while they still could.
  py::module_::import("atexit").attr("register")(
      py::cpp_function([] { markExiting(); }));
  m.def("channel", &channel);
  // Whether a work an op returned still holds the real work (False once a teardown released it).
  m.def("holds_work", [](const intrusive_ptr<c10d::Work>& w) {
    auto* h = dynamic_cast<HandleWork*>(w.get());
    TORCH_CHECK(h != nullptr, "not a work of a resumable group");
    return h->holdsWork();
  });
  // Every method but `track` lets the GIL go before it takes the gate's lock: a thread holding
  // that lock may need the GIL (to report parked, or to poll a Python-made op).
  using nogil = py::call_guard<ReleaseGil>;
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
      .def("oldest_in_flight_s", &Gate::oldestInFlightS, nogil())
      .def("held", &Gate::held, nogil())
      .def("state", &Gate::state, nogil())
      .def("counts", &Gate::counts, nogil())
      .def("latencies", &Gate::latencies, nogil())
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
      .def("clear_inner", &CountingBackend::clearInner, py::call_guard<ReleaseGil>())
      .def("destroyed", &CountingBackend::destroyed)
      .def_property_readonly("key", &CountingBackend::key);
}
