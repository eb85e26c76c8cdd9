// pybind11 module vmalloc._C: the Arena class over one Allocator, the global (torch) arenas, size parsing.
#include <dlfcn.h>
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>

#include "detail/test_backend.h"
#include "global.h"
#include "vmalloc_c.h"

#ifdef VMALLOC_HAVE_CUDA_H
#include <cuda.h>
#endif

namespace py = pybind11;
using vmalloc::Allocator;
using vmalloc::Config;
using vmalloc::detail::TestBackend;

namespace {

using ArenaPtr = std::shared_ptr<Allocator>;

std::size_t index_to_size(const py::int_& value, const char* what);

// A non-negative byte count from an int (or anything with __index__) or a size string; None -> 0.
std::size_t to_size(const py::handle& value, const char* what) {
  if (value.is_none()) return 0;
  if (py::isinstance<py::str>(value)) {
    try {
      return vmalloc::parse_size(value.cast<std::string>());
    } catch (const std::invalid_argument& e) {
      throw py::value_error(std::string(what) + ": " + e.what());
    }
  }
  if (py::isinstance<py::bool_>(value) || !PyIndex_Check(value.ptr()))  // ints, and numpy's integers
    throw py::type_error(std::string(what) + " must be an int or a string such as \"512MiB\", not " +
                         std::string(py::str(py::type::of(value).attr("__name__"))));
  const py::int_ index = py::reinterpret_steal<py::int_>(PyNumber_Index(value.ptr()));
  if (!index) throw py::error_already_set();
  return index_to_size(index, what);
}

std::size_t index_to_size(const py::int_& value, const char* what) {
  const int negative = PyObject_RichCompareBool(value.ptr(), py::int_(0).ptr(), Py_LT);
  if (negative < 0) throw py::error_already_set();
  if (negative)
    throw py::value_error(std::string(what) + " must not be negative (got " + std::string(py::str(value)) + ")");
  const unsigned long long v = PyLong_AsUnsignedLongLong(value.ptr());
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::value_error(std::string(what) + " " + std::string(py::str(value)) + " does not fit in 64 bits");
  }
  return static_cast<std::size_t>(v);
}

int to_int(const py::handle& value, const char* what) {
  if (py::isinstance<py::bool_>(value) || !py::isinstance<py::int_>(value))
    throw py::type_error(std::string(what) + " must be an int, not " +
                         std::string(py::str(py::type::of(value).attr("__name__"))));
  const long long v = value.cast<long long>();
  if (v < INT_MIN || v > INT_MAX) throw py::value_error(std::string(what) + " is out of range");
  return static_cast<int>(v);
}

double to_fraction(const py::handle& value, const char* what) {
  if (py::isinstance<py::bool_>(value) || !(py::isinstance<py::int_>(value) || py::isinstance<py::float_>(value)))
    throw py::type_error(std::string(what) + " must be a number, not " +
                         std::string(py::str(py::type::of(value).attr("__name__"))));
  return value.cast<double>();
}

Config make_config(const std::string& backend, const py::object& capacity, const py::object& chunk_size,
                   const py::object& small_max, int device, const py::object& history, bool eager_growth,
                   int devices, const py::object& block_size, const py::object& growth_slack,
                   const py::object& mid_chunks) {
  Config c;
  c.backend = backend;
  c.capacity = to_size(capacity, "capacity");
  if (!capacity.is_none() && c.capacity == 0) throw py::value_error("capacity must be positive (or None for the default)");
  c.chunk_size = to_size(chunk_size, "chunk_size");
  c.small_max = to_size(small_max, "small_max");
  c.block_size = to_size(block_size, "block_size");
  c.device = device;
  c.devices = devices;
  c.history = to_size(history, "history");
  c.eager_growth = eager_growth;
  if (!growth_slack.is_none()) c.growth_slack = to_fraction(growth_slack, "growth_slack");
  if (!mid_chunks.is_none()) c.mid_chunks = to_size(mid_chunks, "mid_chunks");
  return c;  // validated by Allocator (after its granularity checks) or global::configure
}

py::dict config_dict(const Config& c) {
  py::dict d;
  d["backend"] = c.backend;
  d["capacity"] = c.capacity;
  d["chunk_size"] = c.chunk_size;
  d["small_max"] = c.small_max;
  d["block_size"] = c.block_size;
  d["device"] = c.device;
  d["devices"] = c.devices;
  d["history"] = c.history;
  d["eager_growth"] = c.eager_growth;
  d["growth_slack"] = c.growth_slack;
  d["mid_chunks"] = c.mid_chunks;
  d["step_plan"] = c.step_plan;
  return d;
}

bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsInitialized() || Py_IsFinalizing();
#else
  return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
}

// A Python object that C++ may drop on any thread: the GIL is taken to drop it, and during interpreter
// shutdown the reference is left alone (taking the GIL then would hang a non-Python thread).
struct PyHandle {
  explicit PyHandle(py::object o) : obj(std::move(o)) {}
  PyHandle(const PyHandle&) = delete;
  PyHandle& operator=(const PyHandle&) = delete;
  ~PyHandle() {
    if (python_finalizing()) {
      obj.release();
      return;
    }
    py::gil_scoped_acquire gil;
    obj = py::object();
  }
  py::object obj;
};

// Note [Python OOM handlers]
// The handler is called by Allocator::malloc with the arena unlocked, on the allocating thread, which takes
// the GIL for the call (it may hold it already: gil_scoped_acquire nests). During interpreter shutdown the
// handler is not called (malloc fails with OutOfMemory). Callers that allocate under a lock of their own use
// malloc(call_oom_handler=false) (Note [OOM handler and locks] in allocator.cpp). The handler object is held
// strongly here; vmalloc.Arena (arena.py) passes a trampoline that holds its arena weakly, so a handler that
// refers to its own arena forms a cycle the garbage collector sees.
Allocator::OomHandler wrap_handler(py::object fn) {
  if (fn.is_none()) return nullptr;
  if (!PyCallable_Check(fn.ptr())) throw py::type_error("the OOM handler must be callable as fn(nbytes) -> bool");
  auto held = std::make_shared<PyHandle>(std::move(fn));
  return [held](std::size_t nbytes) {
    if (python_finalizing()) return false;
    py::gil_scoped_acquire gil;
    return py::bool_(held->obj(nbytes)).cast<bool>();
  };
}

// Exports [addr, addr + size) of an arena's memory through the buffer protocol and keeps the arena alive as
// long as a memoryview of it exists, so a view never outlives the mapping it reads.
struct ArenaBuffer {
  ArenaPtr arena;
  std::uintptr_t addr;
  std::size_t size;
};

TestBackend& test_backend(Allocator& a) {
  auto* t = dynamic_cast<TestBackend*>(&a.backend());
  if (!t) throw py::value_error("this arena was not made with _test_backend=True");
  return *t;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "vmalloc core: a chunked virtual-address caching allocator (see vmalloc/__init__.py)";
  // Both a MemoryError and a RuntimeError, the base of torch.cuda.OutOfMemoryError: code that catches either
  // (e.g. accelerate's should_reduce_batch_size) sees vmalloc's out-of-memory.
  py::tuple oom_bases = py::make_tuple(py::handle(PyExc_RuntimeError), py::handle(PyExc_MemoryError));
  py::register_exception<vmalloc::OutOfMemory>(m, "OutOfMemoryError", oom_bases);
  py::register_exception<vmalloc::CaptureError>(m, "CaptureError", PyExc_RuntimeError);
  py::register_exception<vmalloc::BackendError>(m, "BackendError", PyExc_RuntimeError);

  py::class_<ArenaBuffer>(m, "_ArenaBuffer", py::buffer_protocol())
      .def_buffer([](ArenaBuffer& b) {
        return py::buffer_info(reinterpret_cast<void*>(b.addr), 1, py::format_descriptor<std::uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size)}, {1});
      });

  py::class_<Allocator, ArenaPtr>(m, "Arena")
      .def(py::init([](const std::string& backend, const py::object& capacity, const py::object& chunk_size,
                       const py::object& small_max, int device, const py::object& history, bool eager_growth,
                       int devices, const py::object& block_size, const py::object& growth_slack,
                       const py::object& mid_chunks, bool step_plan, bool test_backend) {
             Config c = make_config(backend, capacity, chunk_size, small_max, device, history, eager_growth, devices,
                                    block_size, growth_slack, mid_chunks);
             c.step_plan = step_plan;
             if (!test_backend) return std::make_shared<Allocator>(c);
             vmalloc::check_device(c, device);
             return std::make_shared<Allocator>(c,
                                                std::make_unique<TestBackend>(vmalloc::make_backend(c.backend, device)));
           }),
           py::arg("backend") = "cuda", py::arg("capacity") = py::none(), py::arg("chunk_size") = "2MiB",
           py::arg("small_max") = "1MiB", py::arg("device") = 0, py::arg("history") = 0,
           py::arg("eager_growth") = false, py::arg("devices") = 1, py::arg("block_size") = 0,
           py::arg("growth_slack") = py::none(), py::arg("mid_chunks") = py::none(), py::arg("step_plan") = true,
           py::arg("_test_backend") = false)
      .def(
          "malloc",
          [](Allocator& a, const py::object& nbytes, vmalloc::Stream stream, bool call_oom_handler) {
            const std::size_t n = to_size(nbytes, "nbytes");
            py::gil_scoped_release unlocked;
            return a.malloc(n, stream, call_oom_handler);
          },
          py::arg("nbytes"), py::arg("stream") = 0, py::arg("call_oom_handler") = true,
          "Allocate nbytes on stream; returns the address. call_oom_handler=False fails at once instead of "
          "calling the OOM handler.")
      .def("free", &Allocator::free, py::arg("addr"), py::call_guard<py::gil_scoped_release>(),
           "Free an address returned by malloc. ValueError, changing nothing, if it is not live.")
      .def("record_stream", &Allocator::record_stream, py::arg("addr"), py::arg("stream"))
      .def("empty_cache", &Allocator::empty_cache, py::call_guard<py::gil_scoped_release>())
      .def("set_capacity", [](Allocator& a, const py::object& c) { a.set_capacity(to_size(c, "capacity")); })
      .def("set_oom_handler", [](Allocator& a, py::object fn) { a.set_oom_handler(wrap_handler(std::move(fn))); },
           py::arg("fn"))
      .def("set_history", [](Allocator& a, const py::object& n) { a.set_history(to_size(n, "history")); })
      .def("reset_peak_stats", &Allocator::reset_peak_stats)
      .def(
          "largest_allocatable",
          [](const Allocator& a, const py::object& device_free) {
            return a.largest_allocatable(device_free.is_none() ? SIZE_MAX : to_size(device_free, "device_free"));
          },
          py::arg("device_free") = py::none(),
          "The largest request that can succeed now (what torch's cacheInfo reports for cuDNN's benchmark "
          "mode): idle chunks plus what may still be created under the capacity (at most device_free bytes of "
          "it), capped by the workspace limit minus the allocated bytes.")
      .def(
          "set_workspace_limit",
          [](Allocator& a, const py::object& limit) { a.set_workspace_limit(limit.is_none() ? 0 : to_size(limit, "limit")); },
          py::arg("limit"),
          "Caps largest_allocatable() (cuDNN's workspace offers) at limit minus the allocated bytes; None "
          "removes the cap. The swap runtime sets its budget here.")
      .def_property_readonly("workspace_limit",
                             [](const Allocator& a) -> py::object {
                               const std::size_t l = a.workspace_limit();
                               return l ? py::object(py::int_(l)) : py::object(py::none());
                             })
      .def("capture_begin", &Allocator::capture_begin,
           "A CUDA graph capture begins: until capture_end(), nothing is waited for or unmapped, on any stream.")
      .def("capture_end", &Allocator::capture_end)
      .def("stats",
           [](const Allocator& a) {
             py::dict d;
             for (auto& [k, v] : a.stats()) d[py::str(k)] = v;
             return d;
           })
      .def("_segments",
           [](const Allocator& a) {
             py::list out;
             for (const auto& s : a.segments()) {
               py::list blocks;
               for (const auto& b : s.blocks) {
                 const char* state = b.pending ? "active_pending_free" : b.allocated ? "active_allocated" : "inactive";
                 blocks.append(py::make_tuple(b.addr, b.size, b.requested, state));
               }
               out.append(py::make_tuple(s.addr, s.size, s.stream, s.small, blocks));
             }
             return out;
           })
      .def("_trace",
           [](const Allocator& a) {
             py::list out;
             for (const auto& e : a.trace())
               out.append(py::make_tuple(vmalloc::action_name(e.action), e.addr, e.size, e.stream, e.time_us,
                                         e.device_free));
             return out;
           })
      .def("check_invariants", &Allocator::check_invariants,
           "Recount every statistic from the data structures; raise RuntimeError naming a violated invariant.")
      .def("is_live", &Allocator::is_live, py::arg("addr"), py::arg("nbytes"))
      .def(
          "buffer",
          [](const ArenaPtr& a, std::uintptr_t addr, std::size_t nbytes) {
            if (!a->backend().host_accessible())
              throw py::value_error(std::string("buffer() needs the host backend; this arena's backend is '") +
                                    a->backend().name() + "'");
            if (!a->is_live(addr, nbytes))
              throw py::value_error("buffer(): [addr, addr + nbytes) is not inside one live allocation");
            return py::memoryview(py::cast(ArenaBuffer{a, addr, nbytes}));
          },
          py::arg("addr"), py::arg("nbytes"),
          "A writable memoryview of [addr, addr + nbytes) inside one live allocation (host backend); it keeps "
          "the arena alive.")
      // One counter each, ~10x cheaper than stats() (which builds a dict of every statistic).
      .def_property_readonly("allocated_bytes", &Allocator::allocated_bytes,
                             "stats()['allocated_bytes.all.current'], read alone.")
      .def_property_readonly("peak_allocated_bytes", &Allocator::peak_allocated_bytes,
                             "stats()['allocated_bytes.all.peak'] (since reset_peak_stats()), read alone.")
      .def_property_readonly("reserved_bytes", &Allocator::reserved_bytes,
                             "stats()['reserved_bytes.all.current'], read alone.")
      .def_property_readonly("held_bytes", &Allocator::held_bytes,
                             "stats()['held_bytes.all.current'], read alone: bytes of the chunks no request can have "
                             "now (allocated, pending, slabs with a block in use); held_bytes + allocation_size(n) "
                             "<= capacity means malloc(n) finds enough free chunks.")
      .def_property_readonly("peak_held_bytes", &Allocator::peak_held_bytes,
                             "stats()['held_bytes.all.peak'] (since reset_peak_stats()), read alone.")
      .def_property_readonly("last_backend_error", &Allocator::last_backend_error)
      .def_property_readonly("backend", [](Allocator& a) { return std::string(a.backend().name()); })
      .def_property_readonly("granularity", [](Allocator& a) { return a.backend().granularity(); })
      .def_property_readonly("chunk_size", &Allocator::chunk_size)
      .def_property_readonly(
          "maps_at_offsets", [](Allocator& a) { return a.backend().maps_at_offsets(); },
          "Whether the backend maps a chunk at an offset into a larger physical allocation (the cuda backend asks "
          "the driver once: Note [Probing map offsets]); False makes every block one chunk.")
      .def(
          "allocation_size", [](const Allocator& a, const py::object& n) { return a.allocation_size(to_size(n, "nbytes")); },
          py::arg("nbytes"),
          "The bytes a request of nbytes holds once served, as allocated_bytes counts it (512 B steps in a slab, "
          "quarter chunks in a mid-size slab, whole chunks otherwise).")
      .def_property_readonly("capacity", &Allocator::capacity)
      .def_property_readonly("device", [](const Allocator& a) { return a.config().device; })
      .def_property_readonly("config", [](const Allocator& a) { return config_dict(a.config()); })
      // Test hooks (arenas made with _test_backend=True): faults, simulated events and capture.
      .def("_inject_fault",
           [](Allocator& a, const std::string& op, std::size_t nth, bool once, bool out_of_memory) {
             test_backend(a).fail(op, nth, once, out_of_memory);
           },
           py::arg("op"), py::arg("nth") = 1, py::arg("once") = true, py::arg("out_of_memory") = true)
      .def("_clear_faults", [](Allocator& a) { test_backend(a).clear_faults(); })
      .def("_backend_calls", [](Allocator& a) { return test_backend(a).calls(); })
      .def("_faults_fired", [](Allocator& a) { return test_backend(a).faults_fired(); })
      .def("_set_capturing", [](Allocator& a, vmalloc::Stream s, bool on) { test_backend(a).set_capturing(s, on); },
           py::arg("stream"), py::arg("capturing"))
      .def("_complete_events",
           [](Allocator& a, const py::object& stream) {
             if (stream.is_none()) test_backend(a).complete_all();
             else test_backend(a).complete(stream.cast<vmalloc::Stream>());
           },
           py::arg("stream") = py::none())
      .def("_outstanding_events", [](Allocator& a) { return test_backend(a).outstanding(); })
      .def("_host_waits", [](Allocator& a) { return test_backend(a).host_waits(); });

  m.def("parse_size", [](const py::object& v) { return to_size(v, "size"); }, py::arg("size"),
        "Bytes from an int or a string such as \"512MiB\", \"1.5GiB\", \"10MB\".");
  m.def("parse_conf", [](const std::string& text) { return config_dict(vmalloc::parse_conf(text)); });
  m.def(
      "configure",
      [](const std::string& backend, const py::object& capacity, const py::object& chunk_size,
         const py::object& small_max, const py::object& history, const py::object& eager_growth,
         const py::object& devices, const py::object& block_size, const py::object& growth_slack,
         const py::object& mid_chunks) {
        // Start from VMALLOC_CONF so explicit options override the environment key by key.
        Config base = vmalloc::global::configuration();
        bool eager = base.eager_growth;
        if (!eager_growth.is_none()) {
          if (!py::isinstance<py::bool_>(eager_growth))
            throw py::type_error("eager_growth must be True or False, not " +
                                 std::string(py::str(py::type::of(eager_growth).attr("__name__"))));
          eager = eager_growth.cast<bool>();
        }
        Config c = make_config(backend.empty() ? base.backend : backend, capacity.is_none() ? py::none() : capacity,
                               chunk_size.is_none() ? py::cast(base.chunk_size) : chunk_size,
                               small_max.is_none() ? py::cast(base.small_max) : small_max, 0,
                               history.is_none() ? py::cast(base.history) : history, eager,
                               devices.is_none() ? base.devices : to_int(devices, "devices"),
                               block_size.is_none() ? py::cast(base.block_size) : block_size,
                               growth_slack.is_none() ? py::cast(base.growth_slack) : growth_slack,
                               mid_chunks.is_none() ? py::cast(base.mid_chunks) : mid_chunks);
        if (capacity.is_none()) c.capacity = base.capacity;
        vmalloc::global::configure(c);
      },
      py::arg("backend") = "", py::arg("capacity") = py::none(), py::arg("chunk_size") = py::none(),
      py::arg("small_max") = py::none(), py::arg("history") = py::none(), py::arg("eager_growth") = py::none(),
      py::arg("devices") = py::none(), py::arg("block_size") = py::none(), py::arg("growth_slack") = py::none(),
      py::arg("mid_chunks") = py::none());
  m.def("global_configuration", [] { return config_dict(vmalloc::global::configuration()); });
  m.def("global_arena", &vmalloc::global::arena, py::arg("device") = 0);
  m.def("existing_global_arena", &vmalloc::global::existing, py::arg("device") = 0);
  m.def("device_count", [] { return vmalloc::device_count(vmalloc::global::configuration()); },
        "Devices the configured backend has (the driver's count for cuda; devices=N for host and sim).");
  m.def("library_path", [] {
    Dl_info info{};
    if (!dladdr(reinterpret_cast<void*>(&vmalloc_malloc), &info) || !info.dli_fname)
      throw std::runtime_error("cannot locate the vmalloc shared library");
    return std::string(info.dli_fname);
  });
  m.def("build_info", [] {
    py::dict d;
#ifdef VMALLOC_SANITIZED
    d["sanitized"] = true;
#else
    d["sanitized"] = false;
#endif
#ifdef VMALLOC_HAVE_CUDA_H
    d["cuda_h_version"] = CUDA_VERSION;
#else
    d["cuda_h_version"] = py::none();
#endif
    return d;
  });
}
