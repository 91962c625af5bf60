// TORCH_LIBRARY(sched_lifetime) registration and the c10 adapters the Rust core drives.
// Kernels unpack torch arguments, call the Rust entry point, and turn its error message into
// a torch error (ValueError for tagged input errors, RuntimeError otherwise).

#include "sched-lifetime/cpp/shim.h"

#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include <c10/core/Stream.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include "sched-lifetime/src/ffi/bridge.rs.h"

namespace sched_lifetime {

namespace {

c10::Stream to_stream(const StreamKey& k) {
  return c10::Stream::unpack3(k.id, static_cast<c10::DeviceIndex>(k.device_index),
                              static_cast<c10::DeviceType>(k.device_type));
}

StreamKey to_key(const c10::Stream& s) {
  StreamKey k;
  k.id = s.id();
  k.device_index = static_cast<int8_t>(s.device_index());
  k.device_type = static_cast<int8_t>(s.device_type());
  return k;
}

// Rust errors arrive as rust::Error; input errors carry this tag.
constexpr const char* kValueTag = "[ValueError] ";

template <typename F>
auto guarded(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const rust::Error& e) {
    std::string msg = e.what();
    const std::string tag = kValueTag;
    if (msg.rfind(tag, 0) == 0) {
      TORCH_CHECK_VALUE(false, msg.substr(tag.size()));
    }
    TORCH_CHECK(false, msg);
  }
}

int64_t op_create(std::string name) {
  return guarded([&] { return static_cast<int64_t>(sl_create(rust::Str(name.data(), name.size()))); });
}

void op_bind(int64_t mgr, at::TensorList tensors, c10::Stream owner) {
  TensorList list{tensors};
  guarded([&] { sl_bind(static_cast<uint64_t>(mgr), list, to_key(owner)); });
}

void op_retire(int64_t mgr, at::TensorList tensors, c10::Stream consumer, int64_t action) {
  TensorList list{tensors};
  guarded([&] { sl_retire(static_cast<uint64_t>(mgr), list, to_key(consumer), action); });
}

void op_retire_owned(int64_t mgr, at::TensorList tensors, c10::Stream owner, c10::Stream consumer, int64_t action) {
  TensorList list{tensors};
  guarded([&] { sl_retire_owned(static_cast<uint64_t>(mgr), list, to_key(owner), to_key(consumer), action); });
}

void op_passthrough(int64_t mgr, at::TensorList tensors) {
  TensorList list{tensors};
  guarded([&] { sl_passthrough(static_cast<uint64_t>(mgr), list); });
}

int64_t op_acquire(int64_t mgr, c10::Stream stream) {
  return guarded([&] { return sl_acquire(static_cast<uint64_t>(mgr), to_key(stream)); });
}

std::vector<int64_t> to_vector(const rust::Vec<int64_t>& v) { return std::vector<int64_t>(v.begin(), v.end()); }

std::vector<int64_t> op_finalize(int64_t mgr) {
  return guarded([&] { return to_vector(sl_finalize(static_cast<uint64_t>(mgr))); });
}

std::vector<int64_t> op_stats(int64_t mgr) {
  return guarded([&] { return to_vector(sl_stats(static_cast<uint64_t>(mgr))); });
}

void op_destroy(int64_t mgr) {
  guarded([&] { sl_destroy(static_cast<uint64_t>(mgr)); });
}

rust::Str str(const std::string& s) { return rust::Str(s.data(), s.size()); }

std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

std::string json_value(const c10::IValue& v, const std::string& name) {
  if (v.isString()) return json_quote(v.toStringRef());
  if (v.isBool()) return v.toBool() ? "true" : "false";
  if (v.isInt()) return std::to_string(v.toInt());
  if (v.isDouble()) {
    std::ostringstream os;
    os.precision(17);
    os << v.toDouble();
    return os.str();
  }
  if (v.isNone()) return "null";
  TORCH_CHECK(false, "sched_lifetime: argument '", name, "' has a type JSON ops do not take (", v.tagKind(), ")");
}

// One boxed kernel for every JSON op (the table in src/ffi/json_ops.rs): the arguments as a
// JSON object keyed by the schema's names, the result as the op's str (or nothing).
class JsonKernel final : public c10::OperatorKernel {
 public:
  explicit JsonKernel(std::string name) : name_(std::move(name)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    const auto& schema = op.schema();
    const size_t n = schema.arguments().size();
    std::string args = "{";
    for (size_t i = 0; i < n; ++i) {
      const std::string& arg = schema.arguments()[i].name();
      if (i) args += ",";
      args += json_quote(arg) + ":" + json_value((*stack)[stack->size() - n + i], arg);
    }
    args += "}";
    torch::jit::drop(*stack, n);
    std::string out = guarded([&] { return std::string(sl_json_call(str(name_), str(args))); });
    if (!schema.returns().empty()) stack->emplace_back(std::move(out));
  }

 private:
  std::string name_;
};

}  // namespace

size_t list_len(const TensorList& list) { return list.tensors.size(); }

// Bytes from the start of the storage to the end of the tensor's last element, when the tensor
// starts at the storage's first byte; otherwise a value that never equals the storage size.
static uint64_t storage_span(const at::Tensor& t) {
  if (t.storage_offset() != 0) return ~uint64_t{0};
  if (t.numel() == 0) return 0;
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) < 0) return ~uint64_t{0};
    last += (t.size(d) - 1) * t.stride(d);
  }
  return static_cast<uint64_t>(last + 1) * static_cast<uint64_t>(t.element_size());
}

TensorInfo list_info(const TensorList& list, size_t i) {
  const at::Tensor& t = list.tensors[i];
  TensorInfo info;
  info.tensor = reinterpret_cast<uint64_t>(t.unsafeGetTensorImpl());
  const bool has = t.has_storage();
  info.storage = has ? reinterpret_cast<uint64_t>(t.storage().unsafeGetStorageImpl()) : 0;
  info.nbytes = has ? static_cast<uint64_t>(t.storage().nbytes()) : 0;
  info.covers_storage = !has || storage_span(t) == info.nbytes;
  info.device_type = static_cast<int8_t>(t.device().type());
  info.device_index = static_cast<int8_t>(t.device().index());
  return info;
}

std::unique_ptr<TensorRef> list_take(const TensorList& list, size_t i) {
  return std::make_unique<TensorRef>(TensorRef{list.tensors[i]});
}

std::unique_ptr<EventRef> new_event(const StreamKey& stream) {
  return std::make_unique<EventRef>(static_cast<c10::DeviceType>(stream.device_type));
}

void event_record(EventRef& event, const StreamKey& stream) { event.event.record(to_stream(stream)); }

void event_block(const EventRef& event, const StreamKey& stream) { event.event.block(to_stream(stream)); }

void empty_storage(const TensorRef& ref) {
  const at::Tensor& t = ref.tensor;
  if (!t.has_storage()) return;
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  if (impl->nbytes() == 0) return;
  TORCH_CHECK(impl->resizable(), "sched_lifetime: empty_storage on a storage that is not resizable "
              "(external memory?); retire it with action='preserve'");
  // What untyped_storage().resize_(0) does: drop the allocation, keep the StorageImpl.
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, impl->device()));
  impl->set_nbytes(0);
}

void record_stream(const TensorRef& ref, const StreamKey& stream) {
  const_cast<at::Tensor&>(ref.tensor).record_stream(to_stream(stream));
}

uint32_t registration_anchor() { return 0x5c4ed; }

}  // namespace sched_lifetime

TORCH_LIBRARY(sched_lifetime, m) {
  using namespace sched_lifetime;
  // Ops without tensor arguments have one kernel for every dispatch key.
  m.def("create(str name) -> int", &op_create);
  m.def("acquire(int mgr, Stream stream) -> int", &op_acquire);
  m.def("finalize(int mgr) -> int[]", &op_finalize);
  m.def("stats(int mgr) -> int[]", &op_stats);
  m.def("destroy(int mgr) -> ()", &op_destroy);
  // JSON ops (scheduler, simulator, scenarios, info): registered from Rust's table.
  for (const auto& schema : sl_json_schemas()) {
    std::string text(schema);
    std::string name = text.substr(0, text.find('('));
    m.def(torch::schema(text.c_str(), c10::AliasAnalysisKind::FROM_SCHEMA),
          torch::CppFunction::makeFromBoxedFunctor(std::make_unique<JsonKernel>(name)));
  }
  // Ops on tensors: a real kernel for every backend, fakes registered from Python.
  m.def("bind(int mgr, Tensor[] tensors, Stream owner) -> ()");
  m.def("retire(int mgr, Tensor(a!)[] tensors, Stream consumer, int action) -> ()");
  m.def("retire_owned(int mgr, Tensor(a!)[] tensors, Stream owner, Stream consumer, int action) -> ()");
  m.def("passthrough(int mgr, Tensor[] tensors) -> ()");
}

TORCH_LIBRARY_IMPL(sched_lifetime, CompositeExplicitAutograd, m) {
  using namespace sched_lifetime;
  m.impl("bind", &op_bind);
  m.impl("retire", &op_retire);
  m.impl("retire_owned", &op_retire_owned);
  m.impl("passthrough", &op_passthrough);
}
