// The C++ part of the Strict Eager hit path (torchtpu/runtime/native.py): making an op's output
// tensor. A tpu tensor is a plain PrivateUse1 tensor whose storage has the right byte size and a fake
// data pointer (runtime/storage.py); in Python that takes three torch calls (an empty tensor, a
// storage from a pointer, a boxed set_ redispatch) at ~3 us together, here one call builds the
// TensorImpl over its storage directly.
#include <torch/extension.h>

#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>

#include <cstdint>
#include <vector>

namespace {

at::Tensor make_tensor(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                       at::ScalarType dtype, int64_t nbytes, uint64_t data_ptr) {
  TORCH_CHECK(sizes.size() == strides.size(), "torchtpu make_tensor: ", sizes.size(), " sizes and ",
              strides.size(), " strides");
  const c10::Device device(c10::DeviceType::PrivateUse1, 0);
  // no deleter: the address is fake (never dereferenced), the bytes live in a jax array
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(nbytes),
                       c10::DataPtr(reinterpret_cast<void*>(data_ptr), device), /*allocator=*/nullptr,
                       /*resizable=*/false);
  // (TensorImpl adds the autograd and ADInplaceOrView keys of the backend itself)
  auto tensor = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), c10::scalarTypeToTypeMeta(dtype));
  tensor.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides);
  return tensor;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("make_tensor", &make_tensor, "A tpu tensor of sizes/strides/dtype over a fresh storage of nbytes at data_ptr");
}
