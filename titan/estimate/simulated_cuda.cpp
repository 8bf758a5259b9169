// The dry run's simulated GPU, loaded into the simulating process before torch (titan/estimate/gpu_rank.py).
//
// torch's autograd engine asks the build's accelerator for the streams of every CUDA tensor it differentiates, and
// records each new gradient's stream through the CUDA device guard. A CPU-only torch has neither, and a CUDA build
// with no GPU visible fails to find a device context. So without this file no fake CUDA tensor can run backward,
// though every op runs forward on one. With it, CUDA is the accelerator, no device ever holds a context, and the
// device guard's streams and events do nothing, as fits tensors without storage.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace at {

struct SimulatedCUDAHooks : CUDAHooksInterface {
  explicit SimulatedCUDAHooks(CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return false; }
};

// Preferred over a CUDA build's own hooks, which would look for the GPU the simulating process is not shown.
C10_REGISTER_TYPED_CLASS_WITH_PRIORITY(CUDAHooksRegistry, "CUDAHooks", c10::REGISTRY_PREFERRED, SimulatedCUDAHooks)

}  // namespace at

namespace {

// A CUDA build registers its own guard when it loads, over this one; FakeTensorMode then installs this same fake
// guard by itself, as no GPU is visible (torch._C._ensureCUDADeviceGuardSet).
c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> simulated_cuda_guard;
c10::impl::DeviceGuardImplRegistrar register_simulated_cuda_guard(c10::DeviceType::CUDA, &simulated_cuda_guard);

}  // namespace
