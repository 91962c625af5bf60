// The eager hot path's direct entry (module `sched_lifetime._direct`): create / bind / retire /
// acquire / finalize / stats / destroy called from Python without the torch.ops round trip (Python frame, schema stack, dispatcher),
// which costs more than the work at one tensor. The same Rust entry points as the ops
// (src/ffi/lifetime_ops.rs) do all the work; this file only unpacks Python arguments.
//
// Stable ABI only (Py_LIMITED_API 3.10): one build loads in every CPython >= 3.10, as the ops
// library already does. No torch Python headers: a tensor is reached through its public
// `_cdata` (the TensorImpl address) and a stream through `stream_id` / `device_index` /
// `device_type`. Only exact torch.Tensor / nn.Parameter objects take this path; anything else
// (tensor subclasses, fakes, modes' wrappers) answers NotImplemented and the caller uses the op,
// which dispatches them correctly.
#define PY_SSIZE_T_CLEAN
#define Py_LIMITED_API 0x030A0000
#include <Python.h>

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/SmallVector.h>
#include <c10/util/Exception.h>

#include "sched-lifetime/cpp/shim.h"
#include "sched-lifetime/src/ffi/bridge.rs.h"

namespace sched_lifetime {
namespace {

struct Cache {
  PyObject* tensor_type = nullptr;     // torch.Tensor
  PyObject* parameter_type = nullptr;  // torch.nn.Parameter
  PyObject* stream_type = nullptr;     // torch.Stream (torch.cuda.Stream derives from it)
  PyObject* cdata = nullptr;
  PyObject* stream_id = nullptr;
  PyObject* device_index = nullptr;
  PyObject* device_type = nullptr;
};
Cache cache;

constexpr const char* kValueTag = "[ValueError] ";

std::string type_name(PyObject* obj) {
  PyObject* name = PyObject_GetAttrString(reinterpret_cast<PyObject*>(Py_TYPE(obj)), "__name__");
  std::string out = "object";
  if (name != nullptr) {
    const char* s = PyUnicode_AsUTF8AndSize(name, nullptr);
    if (s != nullptr) out = s;
    Py_DECREF(name);
  }
  PyErr_Clear();
  return out;
}

bool set_value_error(const std::string& msg) {
  PyErr_SetString(PyExc_ValueError, msg.c_str());
  return false;
}

bool long_attr(PyObject* obj, PyObject* name, long long& out) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == nullptr) return false;
  out = PyLong_AsLongLong(v);
  Py_DECREF(v);
  return !(out == -1 && PyErr_Occurred());
}

// The last streams seen, by identity: a stream's id and device never change, and the cache
// holds a strong reference, so an address cannot be reused by another object while cached.
// Callers hold their stream objects (the executor's roles, a user's streams); four slots cover
// an owner, a consumer and the EP / page streams.
struct StreamSlot {
  PyObject* obj = nullptr;
  StreamKey key{};
};
StreamSlot stream_slots[4];
unsigned next_slot = 0;

// A torch.Stream argument as the ops' StreamKey; false with a Python error set otherwise.
bool unpack_stream(PyObject* obj, const char* what, StreamKey& key) {
  for (const StreamSlot& slot : stream_slots) {
    if (slot.obj == obj) {
      key = slot.key;
      return true;
    }
  }
  int is = PyObject_IsInstance(obj, cache.stream_type);
  if (is < 0) return false;
  if (is == 0) {
    return set_value_error(std::string(what) + " must be a torch.Stream (or torch.cuda.Stream), got " + type_name(obj));
  }
  long long id = 0, index = 0, type = 0;
  if (!long_attr(obj, cache.stream_id, id) || !long_attr(obj, cache.device_index, index) ||
      !long_attr(obj, cache.device_type, type)) {
    return false;
  }
  key.id = id;
  key.device_index = static_cast<int8_t>(index);
  key.device_type = static_cast<int8_t>(type);
  StreamSlot& slot = stream_slots[next_slot++ % 4];
  Py_XDECREF(slot.obj);
  Py_INCREF(obj);
  slot.obj = obj;
  slot.key = key;
  return true;
}

// The unpacked tensors: on the stack for the eager hot path's few at a time.
using Tensors = c10::SmallVector<at::Tensor, 4>;

enum class Unpacked { kOk, kError, kNotPlain };

Unpacked unpack_tensor(PyObject* obj, const char* verb, Py_ssize_t i, Tensors& out) {
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(obj));
  if (type != cache.tensor_type && type != cache.parameter_type) {
    int is = PyObject_IsInstance(obj, cache.tensor_type);
    if (is < 0) return Unpacked::kError;
    if (is == 1) return Unpacked::kNotPlain;  // a subclass: the op dispatches it
    set_value_error(std::string(verb) + ": item " + std::to_string(i) + " is a " + type_name(obj) +
                    ", not a torch.Tensor");
    return Unpacked::kError;
  }
  PyObject* cd = PyObject_GetAttr(obj, cache.cdata);
  if (cd == nullptr) return Unpacked::kError;
  void* impl = PyLong_AsVoidPtr(cd);
  Py_DECREF(cd);
  if (impl == nullptr) {
    if (!PyErr_Occurred()) set_value_error(std::string(verb) + ": item " + std::to_string(i) + " is an undefined tensor");
    return Unpacked::kError;
  }
  // A new strong reference to the object's TensorImpl (the Python object keeps it alive now).
  out.emplace_back(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim_copy(
      static_cast<c10::TensorImpl*>(impl)));
  return Unpacked::kOk;
}

// A tensor or a list/tuple of tensors.
Unpacked unpack_tensors(PyObject* obj, const char* verb, Tensors& out) {
  if (PyList_Check(obj) || PyTuple_Check(obj)) {
    const bool list = PyList_Check(obj);
    const Py_ssize_t n = list ? PyList_Size(obj) : PyTuple_Size(obj);
    out.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = list ? PyList_GetItem(obj, i) : PyTuple_GetItem(obj, i);  // borrowed
      Unpacked u = unpack_tensor(item, verb, i, out);
      if (u != Unpacked::kOk) return u;
    }
    return Unpacked::kOk;
  }
  return unpack_tensor(obj, verb, 0, out);
}

bool unpack_handle(PyObject* obj, uint64_t& out) {
  long long h = PyLong_AsLongLong(obj);
  if (h == -1 && PyErr_Occurred()) return false;
  out = static_cast<uint64_t>(h);
  return true;
}

// Runs `f`; a C++ error becomes the Python error kind the ops raise (a tagged rust::Error and
// c10::ValueError: ValueError; any other: RuntimeError) and its message, in `msg`. Returns that
// kind, or nullptr when `f` returned.
template <typename F>
PyObject* run_catching(F&& f, std::string& msg) {
  try {
    f();
  } catch (const rust::Error& e) {
    msg = e.what();
    const std::string tag = kValueTag;
    if (msg.rfind(tag, 0) == 0) {
      msg = msg.substr(tag.size());
      return PyExc_ValueError;
    }
    return PyExc_RuntimeError;
  } catch (const c10::ValueError& e) {
    msg = e.what_without_backtrace();
    return PyExc_ValueError;
  } catch (const c10::Error& e) {
    msg = e.what_without_backtrace();
    return PyExc_RuntimeError;
  } catch (const std::exception& e) {
    msg = e.what();
    return PyExc_RuntimeError;
  } catch (...) {
    return PyExc_RuntimeError;
  }
  return nullptr;
}

// Runs a Rust entry point without the GIL; its errors become the Python errors the ops raise.
// The GIL is let go first (src/ffi/registry.rs, `enter`: the lock rule): an entry may wait for
// the registry lock, and a thread that holds that lock may need the GIL to release a tensor's
// Python object. Nothing inside `f` touches a Python object (the arguments are unpacked first).
template <typename F>
bool call_rust(F&& f) {
  std::string msg;
  PyThreadState* state = PyEval_SaveThread();
  PyObject* kind = run_catching(f, msg);
  PyEval_RestoreThread(state);
  if (kind == nullptr) return true;
  PyErr_SetString(kind, msg.empty() ? "sched_lifetime: unknown C++ error" : msg.c_str());
  return false;
}

bool check_nargs(const char* name, Py_ssize_t nargs, Py_ssize_t want) {
  if (nargs == want) return true;
  PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
  return false;
}

// The retire / retire_owned op's work on Python arguments (handle, tensors, consumer, action,
// owner_or_None); `release` also runs the owner's acquire in the same call. Returns None (or the
// count released), NotImplemented when a tensor is not a plain one (the caller then uses
// torch.ops.sched_lifetime.retire[_owned]), nullptr with a Python error set.
PyObject* retire_args(const char* verb, PyObject* const* args, bool release) {
  uint64_t mgr = 0;
  StreamKey consumer{}, owner{};
  if (!unpack_handle(args[0], mgr) || !unpack_stream(args[2], "consumer_stream", consumer)) return nullptr;
  const bool owned = args[4] != Py_None;
  if (owned && !unpack_stream(args[4], "owner_stream", owner)) return nullptr;
  long long action = PyLong_AsLongLong(args[3]);
  if (action == -1 && PyErr_Occurred()) return nullptr;
  Tensors ts;
  switch (unpack_tensors(args[1], verb, ts)) {
    case Unpacked::kError: return nullptr;
    case Unpacked::kNotPlain: Py_RETURN_NOTIMPLEMENTED;
    case Unpacked::kOk: break;
  }
  TensorList list{ts};
  if (release) {
    int64_t released = 0;
    if (!call_rust([&] { released = sl_release(mgr, list, owner, consumer, action); })) return nullptr;
    return PyLong_FromLongLong(released);
  }
  bool ok = owned ? call_rust([&] { sl_retire_owned(mgr, list, owner, consumer, action); })
                  : call_rust([&] { sl_retire(mgr, list, consumer, action); });
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

// retire(handle, tensors, consumer, action, owner_or_None) -> None, or NotImplemented.
PyObject* direct_retire(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_nargs("retire", nargs, 5)) return nullptr;
  return retire_args("retire", args, false);
}

// release(handle, tensors, consumer, action, owner) -> int: retire_owned, then acquire(owner),
// in one call (record_stream's one-call replacement); NotImplemented as retire.
PyObject* direct_release(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_nargs("release", nargs, 5)) return nullptr;
  if (args[4] == Py_None) {
    PyErr_SetString(PyExc_ValueError, "release_after: owner_stream is required");
    return nullptr;
  }
  return retire_args("release_after", args, true);
}

// bind(handle, tensors, owner) -> None, or NotImplemented (as retire).
PyObject* direct_bind(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_nargs("bind", nargs, 3)) return nullptr;
  uint64_t mgr = 0;
  StreamKey owner{};
  if (!unpack_handle(args[0], mgr) || !unpack_stream(args[2], "owner_stream", owner)) return nullptr;
  Tensors ts;
  switch (unpack_tensors(args[1], "bind", ts)) {
    case Unpacked::kError: return nullptr;
    case Unpacked::kNotPlain: Py_RETURN_NOTIMPLEMENTED;
    case Unpacked::kOk: break;
  }
  TensorList list{ts};
  if (!call_rust([&] { sl_bind(mgr, list, owner); })) return nullptr;
  Py_RETURN_NONE;
}

// acquire(handle, stream) -> int (tensors released).
PyObject* direct_acquire(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_nargs("acquire", nargs, 2)) return nullptr;
  uint64_t mgr = 0;
  StreamKey stream{};
  if (!unpack_handle(args[0], mgr) || !unpack_stream(args[1], "stream", stream)) return nullptr;
  int64_t released = 0;
  if (!call_rust([&] { released = sl_acquire(mgr, stream); })) return nullptr;
  return PyLong_FromLongLong(released);
}

// create(name) -> int handle.
PyObject* direct_create(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_nargs("create", nargs, 1)) return nullptr;
  Py_ssize_t n = 0;
  const char* name = PyUnicode_AsUTF8AndSize(args[0], &n);
  if (name == nullptr) return nullptr;
  uint64_t handle = 0;
  if (!call_rust([&] { handle = sl_create(rust::Str(name, static_cast<size_t>(n))); })) return nullptr;
  return PyLong_FromUnsignedLongLong(handle);
}

PyObject* int_list(const rust::Vec<int64_t>& v) {
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(v.size()));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < v.size(); ++i) {
    PyObject* x = PyLong_FromLongLong(v[i]);
    if (x == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SetItem(out, static_cast<Py_ssize_t>(i), x);  // steals x
  }
  return out;
}

// finalize(handle) / stats(handle) -> list of ints (the ops' int[]); destroy(handle) -> None.
PyObject* handle_to_ints(const char* name, PyObject* const* args, Py_ssize_t nargs, rust::Vec<int64_t> (*f)(uint64_t)) {
  if (!check_nargs(name, nargs, 1)) return nullptr;
  uint64_t mgr = 0;
  if (!unpack_handle(args[0], mgr)) return nullptr;
  rust::Vec<int64_t> st;
  if (!call_rust([&] { st = f(mgr); })) return nullptr;
  return int_list(st);
}

PyObject* direct_finalize(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return handle_to_ints("finalize", args, nargs, &sl_finalize);
}

PyObject* direct_stats(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return handle_to_ints("stats", args, nargs, &sl_stats);
}

PyObject* direct_destroy(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_nargs("destroy", nargs, 1)) return nullptr;
  uint64_t mgr = 0;
  if (!unpack_handle(args[0], mgr)) return nullptr;
  if (!call_rust([&] { sl_destroy(mgr); })) return nullptr;
  Py_RETURN_NONE;
}

// The version counter of a tensor, without its storage: what autograd's saved-tensor check
// compares. The compile paging pass saves a host copy in place of a device value; it keeps this
// to refuse, at page-in, a value the user changed in place after the forward (autograd would
// have). version_probe(tensor) -> capsule, None (an inference tensor: no counter) or
// NotImplemented (not a plain tensor); version_of(capsule) -> int, the counter now.
constexpr const char* kVersionCapsule = "sched_lifetime.version";

void drop_version(PyObject* capsule) {
  delete static_cast<c10::VariableVersion*>(PyCapsule_GetPointer(capsule, kVersionCapsule));
}

PyObject* direct_version_probe(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_nargs("version_probe", nargs, 1)) return nullptr;
  Tensors ts;
  switch (unpack_tensor(args[0], "version_probe", 0, ts)) {
    case Unpacked::kError: return nullptr;
    case Unpacked::kNotPlain: Py_RETURN_NOTIMPLEMENTED;
    case Unpacked::kOk: break;
  }
  const c10::VariableVersion& counter = ts[0].unsafeGetTensorImpl()->version_counter();
  if (!counter.enabled()) Py_RETURN_NONE;
  auto* held = new c10::VariableVersion(counter);
  PyObject* capsule = PyCapsule_New(held, kVersionCapsule, drop_version);
  if (capsule == nullptr) delete held;
  return capsule;
}

PyObject* direct_version_of(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_nargs("version_of", nargs, 1)) return nullptr;
  auto* held = static_cast<c10::VariableVersion*>(PyCapsule_GetPointer(args[0], kVersionCapsule));
  if (held == nullptr) return nullptr;
  return PyLong_FromUnsignedLong(held->current_version());
}

// One page copy, queued with what surrounds it, in one call (the pager's hot path: through
// torch.cuda's Python API the same calls cost several Python frames each):
// page_copy(dst, src, stream, after, mark, wait, done, slot) -> None or NotImplemented.
// `stream` waits for the work queued on `after` so far (event `mark` re-recorded there) when
// `after` is not None, then for event `wait` when non-zero; `dst.copy_(src, non_blocking)` is
// queued on `stream` (made current for the copy, the previous current stream restored); events
// `done` and `slot` are recorded on `stream` after it when non-zero. Events are raw handles
// (`torch.cuda.Event.cuda_event`) of events already created (the caller keeps the objects);
// `mark` non-zero when `after` is given. The same CUDA calls in the same order as the Python
// path (paging/streams.py); which waits and records a copy needs is the caller's rule
// (paging/slot_order.py). NotImplemented when a tensor is not a plain one.
PyObject* direct_page_copy(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_nargs("page_copy", nargs, 8)) return nullptr;
  Tensors ts;
  for (Py_ssize_t i = 0; i < 2; ++i) {
    switch (unpack_tensor(args[i], "page_copy", i, ts)) {
      case Unpacked::kError: return nullptr;
      case Unpacked::kNotPlain: Py_RETURN_NOTIMPLEMENTED;
      case Unpacked::kOk: break;
    }
  }
  StreamKey page{}, after{};
  if (!unpack_stream(args[2], "stream", page)) return nullptr;
  const bool has_after = args[3] != Py_None;
  if (has_after && !unpack_stream(args[3], "after", after)) return nullptr;
  void* ev[4] = {nullptr, nullptr, nullptr, nullptr};  // mark, wait, done, slot
  for (int i = 0; i < 4; ++i) {
    ev[i] = PyLong_AsVoidPtr(args[4 + i]);
    if (ev[i] == nullptr && PyErr_Occurred()) return nullptr;
  }
  if (has_after && ev[0] == nullptr) {
    PyErr_SetString(PyExc_ValueError, "page_copy: `after` needs a created `mark` event");
    return nullptr;
  }
  // Errors as the ops raise them (`run_catching`); a Python one raised inside the copy (a dispatch
  // mode's) stays as it was raised. The GIL is held: the copy may call into Python.
  std::string msg;
  PyObject* kind = run_catching([&] {
    const c10::Stream s = c10::Stream::unpack3(page.id, static_cast<c10::DeviceIndex>(page.device_index),
                                               static_cast<c10::DeviceType>(page.device_type));
    const c10::impl::VirtualGuardImpl impl(s.device_type());
    const c10::DeviceGuard device(s.device());  // the current device as it was, on every path
    if (has_after) {
      const c10::Stream a = c10::Stream::unpack3(after.id, static_cast<c10::DeviceIndex>(after.device_index),
                                                 static_cast<c10::DeviceType>(after.device_type));
      impl.record(&ev[0], a, a.device_index(), c10::EventFlag::PYTORCH_DEFAULT);
      impl.block(ev[0], s);
    }
    if (ev[1] != nullptr) impl.block(ev[1], s);
    const c10::Stream prev = impl.exchangeStream(s);
    try {
      ts[0].copy_(ts[1], /*non_blocking=*/true);
    } catch (...) {
      impl.exchangeStream(prev);
      throw;
    }
    impl.exchangeStream(prev);
    for (int i = 2; i < 4; ++i) {
      if (ev[i] != nullptr) impl.record(&ev[i], s, s.device_index(), c10::EventFlag::PYTORCH_DEFAULT);
    }
  }, msg);
  if (kind != nullptr) {
    if (PyErr_Occurred()) return nullptr;  // torch's python_error: the Python error is set already
    PyErr_SetString(kind, msg.empty() ? "page_copy failed" : msg.c_str());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"retire", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(direct_retire)), METH_FASTCALL,
     "retire(handle, tensors, consumer, action, owner_or_None): the retire / retire_owned op's work"},
    {"release", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(direct_release)), METH_FASTCALL,
     "release(handle, tensors, consumer, action, owner) -> int: retire_owned, then acquire(owner)"},
    {"bind", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(direct_bind)), METH_FASTCALL,
     "bind(handle, tensors, owner): the bind op's work"},
    {"acquire", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(direct_acquire)), METH_FASTCALL,
     "acquire(handle, stream) -> int: the acquire op's work"},
    {"create", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(direct_create)), METH_FASTCALL,
     "create(name) -> int: the create op's work"},
    {"finalize", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(direct_finalize)), METH_FASTCALL,
     "finalize(handle) -> list[int]: the finalize op's work"},
    {"stats", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(direct_stats)), METH_FASTCALL,
     "stats(handle) -> list[int]: the stats op's work"},
    {"destroy", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(direct_destroy)), METH_FASTCALL,
     "destroy(handle): the destroy op's work"},
    {"version_probe", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(direct_version_probe)), METH_FASTCALL,
     "version_probe(tensor) -> capsule | None | NotImplemented: the tensor's version counter, not its storage"},
    {"version_of", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(direct_version_of)), METH_FASTCALL,
     "version_of(capsule) -> int: that counter's version now"},
    {"page_copy", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(direct_page_copy)), METH_FASTCALL,
     "page_copy(dst, src, stream, after, mark, wait, done, slot): a page copy and its waits and records, one call"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_direct",
    "Direct entry for the eager hot path (bind/retire/acquire without torch.ops); same Rust calls as the ops.",
    -1, methods, nullptr, nullptr, nullptr, nullptr,
};

PyObject* attr_of(const char* module, const char* name) {
  PyObject* m = PyImport_ImportModule(module);
  if (m == nullptr) return nullptr;
  PyObject* a = PyObject_GetAttrString(m, name);
  Py_DECREF(m);
  return a;
}

}  // namespace

extern "C" void* sched_lifetime_direct_module_init() {
  if (cache.tensor_type == nullptr) {
    cache.tensor_type = attr_of("torch", "Tensor");
    cache.parameter_type = cache.tensor_type ? attr_of("torch.nn", "Parameter") : nullptr;
    cache.stream_type = cache.parameter_type ? attr_of("torch", "Stream") : nullptr;
    if (cache.stream_type == nullptr) return nullptr;
    cache.cdata = PyUnicode_InternFromString("_cdata");
    cache.stream_id = PyUnicode_InternFromString("stream_id");
    cache.device_index = PyUnicode_InternFromString("device_index");
    cache.device_type = PyUnicode_InternFromString("device_type");
  }
  return PyModule_Create(&module_def);
}

}  // namespace sched_lifetime
