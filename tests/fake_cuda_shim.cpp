// Fake CUDA for a CPU-only build of torch: enough for autograd to run a backward on FakeTensorMode's
// cuda tensors (tests/fake_cuda.py builds this with g++ and loads it before `import torch`).
//
// A CPU build has no CUDA device guard, so the autograd engine finds no accelerator and asks for a CUDA
// stream nobody can give. Two registrations answer it: torch's own fake guard (a device index and a
// stream id per device, nothing else), and CUDA hooks that say CUDA is built, with the CPU allocator
// standing in for pinned host memory. No kernel runs: FakeTensorMode computes shapes only.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace {
struct FakeCUDAHooks : at::CUDAHooksInterface {
  FakeCUDAHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }  // at::accelerator: CUDA is the accelerator
  void init() const override {}                    // lazy CUDA init: nothing to initialise
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }  // the autograd engine asks
  at::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }  // pin_memory=True
};
}  // namespace

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
namespace at {  // the registry lives in `at`; getCUDAHooks() creates the class registered as "CUDAHooks"
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", FakeCUDAHooks);
}
