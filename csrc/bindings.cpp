// pybind11 module vmalloc._C: the Arena class over one Allocator, the global (torch) arenas, size parsing.
#include <dlfcn.h>
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "global.h"

#ifdef VMALLOC_HAVE_CUDA_H
#include <cuda.h>
#endif

extern "C" void* vmalloc_malloc(ssize_t size, int device, void* stream);

namespace py = pybind11;
using vmalloc::Allocator;
using vmalloc::Config;

namespace {

std::size_t to_size(const py::handle& value, const char* what) {
  if (value.is_none()) return 0;
  if (py::isinstance<py::str>(value)) return vmalloc::parse_size(value.cast<std::string>());
  if (py::isinstance<py::bool_>(value) || !py::isinstance<py::int_>(value))
    throw py::type_error(std::string(what) + " must be an int or a string such as \"512MiB\", not " +
                         std::string(py::str(py::type::of(value).attr("__name__"))));
  const auto v = value.cast<long long>();
  if (v < 0) throw py::value_error(std::string(what) + " must not be negative (got " + std::to_string(v) + ")");
  return static_cast<std::size_t>(v);
}

Config make_config(const std::string& backend, const py::object& capacity, const py::object& chunk_size,
                   const py::object& small_max, int device, const py::object& history, bool eager_growth = false) {
  Config c;
  c.backend = backend;
  c.capacity = to_size(capacity, "capacity");
  if (!capacity.is_none() && c.capacity == 0) throw py::value_error("capacity must be positive (or None for the default)");
  c.chunk_size = to_size(chunk_size, "chunk_size");
  c.small_max = to_size(small_max, "small_max");
  c.device = device;
  c.history = to_size(history, "history");
  c.eager_growth = eager_growth;
  return c;
}

py::dict config_dict(const Config& c) {
  py::dict d;
  d["backend"] = c.backend;
  d["capacity"] = c.capacity;
  d["chunk_size"] = c.chunk_size;
  d["small_max"] = c.small_max;
  d["device"] = c.device;
  d["history"] = c.history;
  d["eager_growth"] = c.eager_growth;
  return d;
}

// An OOM handler holds a Python callable: take the GIL to call it and to drop it.
Allocator::OomHandler wrap_handler(py::object fn) {
  if (fn.is_none()) return nullptr;
  if (!PyCallable_Check(fn.ptr())) throw py::type_error("the OOM handler must be callable as fn(nbytes) -> bool");
  auto held = std::shared_ptr<py::object>(new py::object(std::move(fn)), [](py::object* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
  return [held](std::size_t nbytes) {
    py::gil_scoped_acquire gil;
    return py::bool_((*held)(nbytes)).cast<bool>();
  };
}

using ArenaPtr = std::shared_ptr<Allocator>;

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "vmalloc core: a chunked virtual-address caching allocator (see vmalloc/__init__.py)";
  // Both a MemoryError and a RuntimeError, the base of torch.cuda.OutOfMemoryError: code that catches either
  // (e.g. accelerate's should_reduce_batch_size) sees vmalloc's out-of-memory.
  py::tuple oom_bases = py::make_tuple(py::handle(PyExc_RuntimeError), py::handle(PyExc_MemoryError));
  py::register_exception<vmalloc::OutOfMemory>(m, "OutOfMemoryError", oom_bases);

  py::class_<Allocator, ArenaPtr>(m, "Arena")
      .def(py::init([](const std::string& backend, const py::object& capacity, const py::object& chunk_size,
                       const py::object& small_max, int device, const py::object& history, bool eager_growth) {
             return std::make_shared<Allocator>(
                 make_config(backend, capacity, chunk_size, small_max, device, history, eager_growth));
           }),
           py::arg("backend") = "cuda", py::arg("capacity") = py::none(), py::arg("chunk_size") = "2MiB",
           py::arg("small_max") = "1MiB", py::arg("device") = 0, py::arg("history") = 0,
           py::arg("eager_growth") = false)
      .def("malloc", &Allocator::malloc, py::arg("nbytes"), py::arg("stream") = 0, py::arg("call_handler") = true,
           py::call_guard<py::gil_scoped_release>(),
           "Allocate nbytes on stream; returns the address. call_handler=False skips the OOM handler.")
      .def("free", &Allocator::free, py::arg("addr"), py::call_guard<py::gil_scoped_release>(),
           "Free an address returned by malloc. ValueError, changing nothing, if it is not live.")
      .def("record_stream", &Allocator::record_stream, py::arg("addr"), py::arg("stream"))
      .def("empty_cache", &Allocator::empty_cache, py::call_guard<py::gil_scoped_release>())
      .def("set_capacity", [](Allocator& a, const py::object& c) { a.set_capacity(to_size(c, "capacity")); })
      .def("set_oom_handler", [](Allocator& a, py::object fn) { a.set_oom_handler(wrap_handler(std::move(fn))); },
           py::arg("fn"))
      .def("set_history", [](Allocator& a, const py::object& n) { a.set_history(to_size(n, "history")); })
      .def("reset_peak_stats", &Allocator::reset_peak_stats)
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
               for (const auto& b : s.blocks) blocks.append(py::make_tuple(b.addr, b.size, b.requested, b.allocated));
               out.append(py::make_tuple(s.addr, s.size, s.stream, s.small, blocks));
             }
             return out;
           })
      .def("_trace",
           [](const Allocator& a) {
             py::list out;
             for (const auto& e : a.trace())
               out.append(py::make_tuple(vmalloc::action_name(e.action), e.addr, e.size, e.stream, e.time_us));
             return out;
           })
      .def("check_invariants", &Allocator::check_invariants,
           "Recount every statistic from the data structures; raise RuntimeError naming a violated invariant.")
      .def("is_live", &Allocator::is_live, py::arg("addr"), py::arg("nbytes"))
      .def("buffer",
           [](Allocator& a, std::uintptr_t addr, std::size_t nbytes) {
             if (!a.backend().host_accessible())
               throw py::value_error(std::string("buffer() needs the host backend; this arena's backend is '") +
                                     a.backend().name() + "'");
             if (!a.is_live(addr, nbytes))
               throw py::value_error("buffer(): [addr, addr + nbytes) is not inside one live allocation");
             return py::memoryview::from_memory(reinterpret_cast<void*>(addr), static_cast<py::ssize_t>(nbytes));
           },
           py::arg("addr"), py::arg("nbytes"))
      .def_property_readonly("backend", [](Allocator& a) { return std::string(a.backend().name()); })
      .def_property_readonly("granularity", [](Allocator& a) { return a.backend().granularity(); })
      .def_property_readonly("chunk_size", &Allocator::chunk_size)
      .def_property_readonly("capacity", &Allocator::capacity)
      .def_property_readonly("device", [](const Allocator& a) { return a.config().device; })
      .def_property_readonly("config", [](const Allocator& a) { return config_dict(a.config()); });

  m.def("parse_size", [](const py::object& v) { return to_size(v, "size"); }, py::arg("size"),
        "Bytes from an int or a string such as \"512MiB\", \"1.5GiB\", \"10MB\".");
  m.def("parse_conf", [](const std::string& text) { return config_dict(vmalloc::parse_conf(text)); });
  m.def(
      "configure",
      [](const std::string& backend, const py::object& capacity, const py::object& chunk_size,
         const py::object& small_max, const py::object& history, const py::object& eager_growth) {
        // Start from VMALLOC_CONF so explicit options override the environment key by key.
        Config base = vmalloc::global::configuration();
        Config c = make_config(backend.empty() ? base.backend : backend, capacity, chunk_size, small_max, 0, history,
                               eager_growth.is_none() ? base.eager_growth : eager_growth.cast<bool>());
        if (capacity.is_none()) c.capacity = base.capacity;
        if (chunk_size.is_none()) c.chunk_size = base.chunk_size;
        if (small_max.is_none()) c.small_max = base.small_max;
        if (history.is_none()) c.history = base.history;
        vmalloc::global::configure(c);
      },
      py::arg("backend") = "", py::arg("capacity") = py::none(), py::arg("chunk_size") = py::none(),
      py::arg("small_max") = py::none(), py::arg("history") = py::none(), py::arg("eager_growth") = py::none());
  m.def("global_configuration", [] { return config_dict(vmalloc::global::configuration()); });
  m.def("global_arena", &vmalloc::global::arena, py::arg("device") = 0);
  m.def("existing_global_arena", &vmalloc::global::existing, py::arg("device") = 0);
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
