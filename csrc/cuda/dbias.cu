// The device counters of the in-kernel dbias reductions (dbias.cuh's dbias_finish): one buffer
// of int32 zeros per (device, stream), made on the first eager use and never freed (a graph
// captured later may hold its address for as long as it lives). Kernels on one stream run one
// after another, and each leaves its counters zero, so they share the buffer; kernels on other
// streams get their own. Graphs captured on one stream share it too: two such graphs must not
// replay at the same time on two streams (as for torch's per-stream cuBLAS workspaces).
#include <map>
#include <mutex>
#include <utility>

#include "dbias.cuh"

namespace graphfp8::cuda {
namespace {

constexpr int64_t kCounterCapacity = int64_t{1} << 16;  // columns of tiles: 4M columns of 64

// Zeroed counters for a stream that is not capturing, or nullptr.
int* make_counters(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess ||
      status != cudaStreamCaptureStatusNone) {
    cudaGetLastError();
    return nullptr;
  }
  // Another thread's capture in global mode must not see this allocation as an unsafe call.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  int* p = nullptr;
  const size_t bytes = static_cast<size_t>(kCounterCapacity) * sizeof(int);
  const bool ok = cudaMalloc(&p, bytes) == cudaSuccess && cudaMemsetAsync(p, 0, bytes, stream) ==
                                                              cudaSuccess;
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (!ok) {
    cudaGetLastError();  // the caller falls back to the second kernel
    if (p != nullptr) cudaFree(p);
    return nullptr;
  }
  return p;
}

}  // namespace

int* dbias_counters(cudaStream_t stream, int64_t count) {
  int device = 0;
  if (count > kCounterCapacity || cudaGetDevice(&device) != cudaSuccess) return nullptr;
  static std::mutex mutex;
  static std::map<std::pair<int, cudaStream_t>, int*> buffers;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, stream);
  const auto it = buffers.find(key);
  if (it != buffers.end()) return it->second;
  int* p = make_counters(stream);
  if (p != nullptr) buffers.emplace(key, p);
  return p;
}

}  // namespace graphfp8::cuda
