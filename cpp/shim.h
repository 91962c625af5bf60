// Thin adapters between the Rust core (src/ffi.rs) and c10/ATen. No policy lives here:
// every decision is made in Rust; these functions only carry it out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/util/ArrayRef.h>

#include "rust/cxx.h"

namespace sched_lifetime {

struct StreamKey;
struct TensorInfo;

// One strong reference to a tensor, owned by Rust.
struct TensorRef {
  at::Tensor tensor;
};

// The Tensor[] argument of the op being executed; valid for the duration of the call.
struct TensorList {
  c10::ArrayRef<at::Tensor> tensors;
};

// A c10::Event (device-generic: CUDA through the registered guard impl, no CUDA headers).
struct EventRef {
  explicit EventRef(c10::DeviceType type) : event(type) {}
  c10::Event event;
};

size_t list_len(const TensorList& list);
TensorInfo list_info(const TensorList& list, size_t i);
std::unique_ptr<TensorRef> list_take(const TensorList& list, size_t i);
std::unique_ptr<EventRef> new_event(const StreamKey& stream);
void event_record(EventRef& event, const StreamKey& stream);
void event_block(const EventRef& event, const StreamKey& stream);
void empty_storage(const TensorRef& tensor);
void record_stream(const TensorRef& tensor, const StreamKey& stream);
uint32_t registration_anchor();

}  // namespace sched_lifetime
