// Launchers of the forward kernels: template dispatch, shared-memory opt-in, launch checks.
// No argument checking here: opm_api.cpp validates everything before calling in.
#include <c10/cuda/CUDAException.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>
#include <new>
#include <tuple>
#include <type_traits>
#include <vector>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <utility>

#include "opm_backward_kernel.cuh"
#include "opm_kernels.cuh"
#include "opm_ln_backward_kernel.cuh"
#include "opm_small_kernel.cuh"
#include "opm_small_f16_chain_kernel.cuh"
#include "opm_small_f16_kernel.cuh"
#include "opm_small_tc_kernel.cuh"
#include "opm_tc16_kernel.cuh"
#include "opm_tc_kernel.cuh"

namespace flashopm {
namespace {

constexpr int kMaxDevices = 64;

// Lets `Kernel` use all the dynamic shared memory device `dev` allows (once per device).  With
// kMaxCarveout, the SMs running it are also configured for the most shared memory (a hint): the
// LayerNorm/projection kernels need little, and on an SM set up for little shared memory their
// programmatic dependent, which needs much, could only start once the SM had drained.
template <auto Kernel, bool kMaxCarveout = false>
void allow_smem(int dev) {
  static std::array<std::once_flag, kMaxDevices> flags;
  std::call_once(flags[dev % kMaxDevices], [dev] {
    int optin = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    if (const long limit = smem_limit_setting(); limit > 0 && limit < optin) optin = int(limit);
    cudaFuncAttributes attr{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, Kernel));
    C10_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        optin - int(attr.sharedSizeBytes)));
    if (kMaxCarveout)
      C10_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          int(cudaSharedmemCarveoutMaxShared)));
  });
}

// ---- launches ----
// Every kernel goes out through launch_kernel.  By default it calls the driver's cuLaunchKernelEx
// with the kernel's CUfunction, looked up once per device: the runtime's launch finds that handle
// again on every call, and at the small shapes a call's host time is mostly its launches.  The
// runtime's launch stays as the fallback: where the driver library's functions are not found, on
// a thread whose current context is not the one the handles came from (or none yet: the
// runtime's launch makes the device's context current), and when set_driver_launch(false) or
// FLASHOPM_RUNTIME_LAUNCH=1 asks for it.

struct DriverLaunchApi {
  PFN_cuLaunchKernelEx_v11060 launch = nullptr;
  PFN_cuCtxGetCurrent_v4000 current_context = nullptr;
  PFN_cuGetErrorString_v6000 error_string = nullptr;
  // the 16-bit kernel's tensor-copy forms (may stay null)
  PFN_cuTensorMapEncodeTiled_v12000 encode_tiled = nullptr;
};

// The driver library is the one the runtime has loaded already (dlopen hands back that copy);
// a process without it keeps the runtime's launches.
const DriverLaunchApi& driver_launch_api() {
  static const DriverLaunchApi api = [] {
    DriverLaunchApi a;
    void* const driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (driver == nullptr) return a;
    a.launch = reinterpret_cast<PFN_cuLaunchKernelEx_v11060>(dlsym(driver, "cuLaunchKernelEx"));
    a.current_context = reinterpret_cast<PFN_cuCtxGetCurrent_v4000>(dlsym(driver, "cuCtxGetCurrent"));
    a.error_string = reinterpret_cast<PFN_cuGetErrorString_v6000>(dlsym(driver, "cuGetErrorString"));
    if (a.launch == nullptr || a.current_context == nullptr || a.error_string == nullptr) a = DriverLaunchApi{};
    a.encode_tiled = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(dlsym(driver, "cuTensorMapEncodeTiled"));
    return a;
  }();
  return api;
}

std::atomic<bool>& driver_launch_enabled() {
  static std::atomic<bool> enabled{!env_is("FLASHOPM_RUNTIME_LAUNCH", "1")};
  return enabled;
}

// The context in which each device's kernel handles were looked up.
std::array<std::atomic<CUcontext>, kMaxDevices> g_lookup_context{};

// Kernel's CUfunction on device `dev` in the current context, or nullptr where the driver path
// does not apply (the caller then launches through the runtime).
template <auto Kernel>
CUfunction driver_function(int dev) {
  static std::array<std::atomic<CUfunction>, kMaxDevices> functions{};
  const DriverLaunchApi& api = driver_launch_api();
  if (api.launch == nullptr || dev < 0 || dev >= kMaxDevices ||
      !driver_launch_enabled().load(std::memory_order_relaxed))
    return nullptr;
  CUcontext current = nullptr;
  if (api.current_context(&current) != CUDA_SUCCESS || current == nullptr) return nullptr;
  CUfunction fn = functions[dev].load(std::memory_order_acquire);
  if (fn != nullptr) return current == g_lookup_context[dev].load(std::memory_order_acquire) ? fn : nullptr;
  // First launch of Kernel on dev: the runtime's handle is the driver's CUfunction in the current
  // context, which is recorded with it; a later launch from another context takes the runtime.
  cudaFunction_t found = nullptr;
  if (cudaGetFuncBySymbol(&found, reinterpret_cast<const void*>(Kernel)) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  CUcontext after = nullptr;
  if (api.current_context(&after) != CUDA_SUCCESS || after != current) return nullptr;
  CUcontext expected = nullptr;
  if (!g_lookup_context[dev].compare_exchange_strong(expected, current) && expected != current) return nullptr;
  fn = reinterpret_cast<CUfunction>(found);
  functions[dev].store(fn, std::memory_order_release);
  return fn;
}

template <typename... P, typename... A>
CUresult driver_launch(const CUlaunchConfig& config, CUfunction fn, void (*)(P...), const A&... args) {
  // Each argument converted to the kernel's parameter type, as the runtime's launch template does.
  std::tuple<std::decay_t<P>...> values(args...);
  return std::apply(
      [&](auto&... value) {
        void* params[] = {static_cast<void*>(&value)...};
        return driver_launch_api().launch(&config, fn, params, nullptr);
      },
      values);
}

static_assert(sizeof(cudaLaunchAttribute) == sizeof(CUlaunchAttribute) &&
                  sizeof(cudaLaunchAttributeValue) == sizeof(CUlaunchAttributeValue),
              "the runtime's and the driver's launch attributes differ in layout");
static_assert(int(cudaLaunchAttributeClusterDimension) == int(CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION) &&
                  int(cudaLaunchAttributeCooperative) == int(CU_LAUNCH_ATTRIBUTE_COOPERATIVE) &&
                  int(cudaLaunchAttributeProgrammaticStreamSerialization) ==
                      int(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION),
              "the runtime's and the driver's launch attribute ids differ");

// ---- launches batched into a CUDA graph ----
// Between begin_launch_batch and end_launch_batch, launch_kernel records its launches instead of
// making them; end_launch_batch then sends them to the GPU as one launch of a graph holding the
// same launches (the same attributes, programmatic dependencies included), instantiated once per
// sequence of launch shapes and reused with each call's parameters.  H200: two empty kernels take
// 4.6 us of host time that way against 8.9 us as two launches, and the GPU receives both kernels
// at once, so the second no longer waits for the host's second launch.

constexpr int kBatchMaxLaunches = 4;
constexpr size_t kBatchArenaBytes = 16384;  // the recorded launches' parameter values

struct BatchedLaunch {
  const void* func = nullptr;  // the kernel's runtime handle
  cudaLaunchConfig_t cfg{};    // cfg.attrs points into attrs
  std::array<cudaLaunchAttribute, 4> attrs{};
  std::array<void*, 8> params{};  // into the arena, one per kernel parameter
};

struct LaunchBatch {
  bool active = false;
  int dev = 0;  // the device of the recorded launches (the launcher's current device)
  int count = 0;
  size_t used = 0;
  std::array<BatchedLaunch, kBatchMaxLaunches> launches{};
  alignas(16) unsigned char arena[kBatchArenaBytes];
};

LaunchBatch& thread_batch() {
  static thread_local LaunchBatch batch;
  return batch;
}

std::atomic<bool>& graph_launch_enabled() {
  static std::atomic<bool> enabled{true};
  return enabled;
}

// Records Kernel(args...) with cfg into the thread's batch, each argument converted to the
// kernel's parameter type (as a launch converts it) and kept until the batch is sent.
template <auto Kernel, typename... P, typename... A>
void batch_record(LaunchBatch& batch, int dev, const cudaLaunchConfig_t& cfg, void (*)(P...), const A&... args) {
  using Values = std::tuple<std::decay_t<P>...>;
  static_assert((std::is_trivially_copyable_v<std::decay_t<P>> && ...) && std::is_trivially_destructible_v<Values>,
                "kernel parameters are plain values (the arena is reused without destroying them)");
  static_assert(sizeof...(P) <= std::tuple_size_v<decltype(BatchedLaunch::params)>, "too many kernel parameters");
  TORCH_CHECK(batch.count < kBatchMaxLaunches, "flashopm: internal error: too many launches in one batch");
  TORCH_CHECK(batch.count == 0 || batch.dev == dev, "flashopm: internal error: one batch's launches on two devices");
  batch.dev = dev;
  TORCH_CHECK(cfg.numAttrs <= 4, "flashopm: internal error: too many launch attributes");
  const size_t offset = (batch.used + alignof(Values) - 1) / alignof(Values) * alignof(Values);
  TORCH_CHECK(offset + sizeof(Values) <= kBatchArenaBytes, "flashopm: internal error: launch parameters past the batch's arena");
  Values* const values = new (batch.arena + offset) Values(args...);
  batch.used = offset + sizeof(Values);
  BatchedLaunch& l = batch.launches[batch.count++];
  l.func = reinterpret_cast<const void*>(Kernel);
  l.cfg = cfg;
  for (unsigned k = 0; k < cfg.numAttrs; ++k) l.attrs[k] = cfg.attrs[k];
  l.cfg.attrs = cfg.numAttrs ? l.attrs.data() : nullptr;
  std::apply([&](auto&... v) {
    int k = 0;
    ((l.params[k++] = static_cast<void*>(&v)), ...);
  }, *values);
}

// What a launch sets up for its kernel first, once per device: nothing, the opt-in to all the
// dynamic shared memory (allow_smem), or that and the carveout hint.
enum class SmemSetup { kNone, kOptIn, kOptInMaxCarveout };

// Launches Kernel(args...) with cfg (grid, block, dynamic shared memory, stream, attributes) and
// checks that the launch was taken.
template <auto Kernel, SmemSetup kSmem = SmemSetup::kNone, typename... A>
void launch_kernel(const cudaLaunchConfig_t& cfg, const A&... args) {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if constexpr (kSmem != SmemSetup::kNone) allow_smem<Kernel, kSmem == SmemSetup::kOptInMaxCarveout>(dev);
  if (LaunchBatch& batch = thread_batch(); batch.active) return batch_record<Kernel>(batch, dev, cfg, Kernel, args...);
  if (const CUfunction fn = driver_function<Kernel>(dev)) {
    std::array<CUlaunchAttribute, 4> attrs{};
    TORCH_CHECK(cfg.numAttrs <= attrs.size(), "flashopm: internal error: too many launch attributes");
    for (unsigned k = 0; k < cfg.numAttrs; ++k) {
      attrs[k].id = CUlaunchAttributeID(cfg.attrs[k].id);
      std::memcpy(&attrs[k].value, &cfg.attrs[k].val, sizeof(CUlaunchAttributeValue));
    }
    CUlaunchConfig config{};
    config.gridDimX = cfg.gridDim.x, config.gridDimY = cfg.gridDim.y, config.gridDimZ = cfg.gridDim.z;
    config.blockDimX = cfg.blockDim.x, config.blockDimY = cfg.blockDim.y, config.blockDimZ = cfg.blockDim.z;
    config.sharedMemBytes = unsigned(cfg.dynamicSmemBytes);
    config.hStream = reinterpret_cast<CUstream>(cfg.stream);
    config.attrs = attrs.data();
    config.numAttrs = cfg.numAttrs;
    const CUresult r = driver_launch(config, fn, Kernel, args...);
    if (r != CUDA_SUCCESS) {
      const char* what = nullptr;
      if (driver_launch_api().error_string(r, &what) != CUDA_SUCCESS || what == nullptr) what = "unknown error";
      // the message assembled with std::to_string, as in opm_api.cpp (no integers through c10::str)
      TORCH_CHECK(false, "flashopm: kernel launch failed (grid " + std::to_string(cfg.gridDim.x) + "x" +
                             std::to_string(cfg.gridDim.y) + "x" + std::to_string(cfg.gridDim.z) + ", block " +
                             std::to_string(cfg.blockDim.x) + ", " + std::to_string(cfg.dynamicSmemBytes) +
                             " bytes of shared memory): CUDA driver error " + std::to_string(int(r)) + ": " + what);
    }
    return;
  }
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, Kernel, args...));
}

// The same without launch attributes.
template <auto Kernel, SmemSetup kSmem = SmemSetup::kNone, typename... A>
void launch_kernel(dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream, const A&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  launch_kernel<Kernel, kSmem>(cfg, args...);
}

// The launch of a grid in clusters of cluster.x x cluster.y x cluster.z blocks (the grid a multiple
// of it), attr holding its one attribute.
cudaLaunchConfig_t cluster_config(dim3 grid, unsigned threads, int smem_bytes, cudaStream_t stream, dim3 cluster,
                                  cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = size_t(smem_bytes);
  cfg.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster.x;
  attr[0].val.clusterDim.y = cluster.y;
  attr[0].val.clusterDim.z = cluster.z;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// Calls f(TypeTag<T>{}) with T the element type of x (kMaskFloat, kMaskHalf or kMaskBFloat16).
template <typename T>
struct TypeTag {
  using type = T;
};
template <typename F>
void with_x_type(int x_kind, F&& f) {
  if (x_kind == kMaskHalf) f(TypeTag<__half>{});
  else if (x_kind == kMaskBFloat16) f(TypeTag<__nv_bfloat16>{});
  else f(TypeTag<float>{});
}

template <int Q, int RW, bool kProjectW, typename XT, bool kWholeW = false>
void launch_prep_t(const PrepArgs& args, int warps, cudaStream_t stream) {
  const int R = warps * RW;  // launch_prep passes kPrepWarps in project-first mode
  const dim3 grid(unsigned((args.N + R - 1) / R) * unsigned(kProjectW ? args.o_chunks : 1), unsigned(args.S),
                  unsigned(args.B));
  constexpr auto kernel = opm_prep_kernel<Q, RW, kProjectW, XT, kWholeW>;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(unsigned(R / RW * 32));
  cfg.dynamicSmemBytes = prep_smem_bytes(args.H, RW, kProjectW, kWholeW, args.C);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (args.after_previous) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  launch_kernel<kernel, SmemSetup::kOptInMaxCarveout>(cfg, args);
}

template <int Q, int RW, bool kProjectW>
void launch_prep_x(const PrepArgs& args, int warps, cudaStream_t stream) {
  with_x_type(args.x_kind,
              [&](auto t) { launch_prep_t<Q, RW, kProjectW, typename decltype(t)::type>(args, warps, stream); });
}

template <int RW, bool kProjectW>
void launch_prep_q(const PrepArgs& args, int warps, cudaStream_t stream) {
  const int q = (2 * args.H + 31) / 32;
  if (q <= 1) return launch_prep_x<1, RW, kProjectW>(args, warps, stream);
  if (q <= 2) return launch_prep_x<2, RW, kProjectW>(args, warps, stream);
  return launch_prep_x<4, RW, kProjectW>(args, warps, stream);
}

// Tile configurations of the project-first GEMM: a large one, and a small one for problems that
// would otherwise leave most of the GPU idle.
using BigGemm = ProjectGemmConfig<128, 128, 8, 8, 8, 4>;
using SmallGemm = ProjectGemmConfig<32, 32, 32, 2, 2, 4>;

}  // namespace

int prep_smem_bytes(int H, int rows_per_warp, bool project_w, bool whole_w, int C) {
  return int((whole_w ? prep_whole_smem_floats(C) : prep_smem_floats(H, rows_per_warp, project_w)) * sizeof(float));
}

bool prep_whole_weights_apply(const PrepArgs& args, bool project_w, int rows_per_warp) {
  const auto aligned16 = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return !project_w && rows_per_warp == 1 && args.x_kind == kMaskFloat && 2 * args.H <= 64 && args.C % 4 == 0 &&
         args.C <= kPrepWholeMaxC && aligned16(args.wa) && aligned16(args.wb);
}

void launch_prep(const PrepArgs& args, bool project_w, int rows_per_warp, int warps, cudaStream_t stream,
                 bool whole_w) {
  if (whole_w) {
    TORCH_CHECK(prep_whole_weights_apply(args, project_w, rows_per_warp),
                "flashopm: internal error: the whole-weights projection form does not apply here");
    if (2 * args.H <= 32) return launch_prep_t<1, 1, false, float, true>(args, warps, stream);
    return launch_prep_t<2, 1, false, float, true>(args, warps, stream);
  }
  if (project_w) {
    if (rows_per_warp == 4) return launch_prep_q<4, true>(args, kPrepWarps, stream);
    return launch_prep_q<1, true>(args, kPrepWarps, stream);
  }
  if (rows_per_warp == 4) return launch_prep_q<4, false>(args, warps, stream);
  return launch_prep_q<1, false>(args, warps, stream);
}

namespace {
// x as 16-byte vectors when its base, every stride and msa_dim keep them aligned.
bool project_rows_vec(const PrepArgs& args) {
  const int64_t V = 16 / (args.x_kind == kMaskFloat ? 4 : 2);
  return reinterpret_cast<uintptr_t>(args.x) % 16 == 0 && args.C % V == 0 && args.x_sb % V == 0 &&
         args.x_ss % V == 0 && args.x_sn % V == 0;
}
// The block's rows as launched: args.block_rows in the tensor-core form where it is allowed, else 128.
int project_rows_block(const PrepArgs& args) {
  if (project_rows_mma_terms(args) == 0 || args.block_rows <= 0 ||
      !project_rows_block_allowed(args.block_rows, args.H, x_is_16bit(args)))
    return kProjRows;
  return args.block_rows;
}
}  // namespace

int project_rows_mma_terms(const PrepArgs& args) {
  if (!project_rows_vec(args)) return 0;
  return x_is_16bit(args) ? 1 : args.mma_terms;
}

int project_rows_smem_bytes(const PrepArgs& args) {
  return int(project_rows_smem_floats(args.H, project_rows_mma_terms(args), project_rows_block(args)) * sizeof(float));
}

namespace {
template <int CT, typename XT, bool kVec, int kMmaTerms, int kRows>
void launch_project_rows_r(const PrepArgs& args, cudaStream_t stream) {
  const int64_t rows = project_rows_count(args);
  constexpr auto kernel = opm_project_rows_kernel<CT, XT, kVec, kMmaTerms, kRows>;
  launch_kernel<kernel, SmemSetup::kOptInMaxCarveout>(unsigned((rows + kRows - 1) / kRows), kProjThreads,
                                                      project_rows_smem_bytes(args), stream, args);
}
template <int CT, typename XT, bool kVec, int kMmaTerms>
void launch_project_rows_t(const PrepArgs& args, cudaStream_t stream) {
  if constexpr (kMmaTerms > 0 && kVec) {
    const int rows = project_rows_block(args);
    if (rows == 64) return launch_project_rows_r<CT, XT, kVec, kMmaTerms, 64>(args, stream);
    // 32 only where allowed: 2H > 16 (CT >= 2) and 32-bit x
    if constexpr (CT >= 2 && sizeof(XT) == 4) {
      if (rows == 32) return launch_project_rows_r<CT, XT, kVec, kMmaTerms, 32>(args, stream);
    }
  }
  launch_project_rows_r<CT, XT, kVec, kMmaTerms, kProjRows>(args, stream);
}
template <typename XT, bool kVec, int kMmaTerms>
void launch_project_rows_v(const PrepArgs& args, cudaStream_t stream) {
  switch (proj_cols_per_thread(args.H)) {
    case 1: return launch_project_rows_t<1, XT, kVec, kMmaTerms>(args, stream);
    case 2: return launch_project_rows_t<2, XT, kVec, kMmaTerms>(args, stream);
    case 4: return launch_project_rows_t<4, XT, kVec, kMmaTerms>(args, stream);
    default: return launch_project_rows_t<8, XT, kVec, kMmaTerms>(args, stream);
  }
}
template <typename XT>
void launch_project_rows_x(const PrepArgs& args, cudaStream_t stream) {
  if (!project_rows_vec(args)) return launch_project_rows_v<XT, false, 0>(args, stream);
  const int terms = project_rows_mma_terms(args);
  if constexpr (std::is_same_v<XT, float>) {
    if (terms == 3) return launch_project_rows_v<XT, true, 3>(args, stream);
  }
  if (terms > 0) return launch_project_rows_v<XT, true, 1>(args, stream);
  launch_project_rows_v<XT, true, 0>(args, stream);
}
}  // namespace

namespace {
template <typename XT, int kStages>
void launch_project_stream_s(const PrepArgs& args, cudaStream_t stream) {
  constexpr auto kernel = opm_project_stream_kernel<XT, kStages>;
  launch_kernel<kernel, SmemSetup::kOptInMaxCarveout>(unsigned(args.stream_blocks), kPsThreads,
                                                      project_stream_smem_bytes(args.C, kStages), stream, args);
}
template <typename XT>
void launch_project_stream(const PrepArgs& args, cudaStream_t stream) {
  if constexpr (sizeof(XT) == 2) {
    switch (args.stream_stages) {
      case 2: return launch_project_stream_s<XT, 2>(args, stream);
      case 3: return launch_project_stream_s<XT, 3>(args, stream);
      case 4: return launch_project_stream_s<XT, 4>(args, stream);
      default: break;
    }
  }
  TORCH_CHECK(false, "flashopm: internal error: the streamed projection takes 16-bit x and 2 to ", kPsMaxStages,
              " stages, got x kind ", args.x_kind, " and ", args.stream_stages, " stages");
}
}  // namespace

namespace {
template <typename XT, int kQ>
void launch_project_regs_q(const PrepArgs& args, cudaStream_t stream) {
  constexpr auto kernel = opm_project_regs_kernel<XT, kQ>;
  launch_kernel<kernel, SmemSetup::kOptInMaxCarveout>(unsigned(args.regs_blocks), kPrThreads,
                                                      project_regs_smem_bytes(args.C, args.H), stream, args);
}
template <typename XT>
void launch_project_regs(const PrepArgs& args, cudaStream_t stream) {
  if constexpr (sizeof(XT) == 2) {
    switch (project_regs_groups(args.C)) {
      case 1: return launch_project_regs_q<XT, 1>(args, stream);
      case 2: return launch_project_regs_q<XT, 2>(args, stream);
      case 4: return launch_project_regs_q<XT, 4>(args, stream);
      default:
        if (args.C <= 32 * kPrMaxGroups) return launch_project_regs_q<XT, kPrMaxGroups>(args, stream);
    }
  }
  TORCH_CHECK(false, "flashopm: internal error: the register-resident projection takes 16-bit x and msa_dim up to ",
              32 * kPrMaxGroups, ", got x kind ", args.x_kind, " and msa_dim ", args.C);
}
}  // namespace

void launch_project_rows(const PrepArgs& args, cudaStream_t stream) {
  if (args.stream_blocks > 0)
    return with_x_type(args.x_kind, [&](auto t) { launch_project_stream<typename decltype(t)::type>(args, stream); });
  if (args.regs_blocks > 0)
    return with_x_type(args.x_kind, [&](auto t) { launch_project_regs<typename decltype(t)::type>(args, stream); });
  with_x_type(args.x_kind, [&](auto t) { launch_project_rows_x<typename decltype(t)::type>(args, stream); });
}

int outer_smem_bytes() { return kOuterSmemBytes; }

void launch_outer(const OuterArgs& args, cudaStream_t stream) {
  const dim3 grid(unsigned((args.N + args.Tj - 1) / args.Tj), unsigned((args.Na + args.Ti - 1) / args.Ti),
                  unsigned(args.B));
  if (args.H % 4 == 0) {
    launch_kernel<opm_outer_fused_kernel<true>, SmemSetup::kOptIn>(grid, kOuterThreads, kOuterSmemBytes, stream, args);
  } else {
    launch_kernel<opm_outer_fused_kernel<false>, SmemSetup::kOptIn>(grid, kOuterThreads, kOuterSmemBytes, stream, args);
  }
}

int outer_tc_smem_bytes(int H, int Ti, int Tj, bool wgmma, bool wgmma2, TcMmaSyncStaging staging) {
  return tc_layout(H, Ti, Tj, wgmma, wgmma2, staging.half_stages ? kTcBKSmall : kTcBK,
                   staging.half_w ? kTcKCSmall : kTcKC, staging.narrow ? kTcNTNarrow : kTcNT)
             .total *
         int(sizeof(float));
}

namespace {
template <int kTerms, bool kWgmma, bool kWgmma2, bool kHalfSplit = false, int kBK = kTcBK, int kKC = kTcKC,
          int kNT = kTcNT, bool kFused = false>
void launch_tc_t(const OuterArgs& args, const dim3& grid, int smem, cudaStream_t stream) {
  constexpr auto kernel = opm_outer_tc_kernel<kTerms, kWgmma, kWgmma2, kHalfSplit, kBK, kKC, kNT, kFused>;
  launch_kernel<kernel, SmemSetup::kOptIn>(grid, kTcThreads, smem, stream, args);
}
// The mma.sync form with its staging: stage depth, W chunk, phase 1's width.
template <int kTerms, int kBK, int kKC>
void launch_tc_mma_sync_nt(const OuterArgs& args, TcMmaSyncStaging staging, const dim3& grid, int smem,
                           cudaStream_t stream) {
  if (staging.narrow) launch_tc_t<kTerms, false, false, false, kBK, kKC, kTcNTNarrow>(args, grid, smem, stream);
  else launch_tc_t<kTerms, false, false, false, kBK, kKC>(args, grid, smem, stream);
}
template <int kTerms, int kBK>
void launch_tc_mma_sync_kc(const OuterArgs& args, TcMmaSyncStaging staging, const dim3& grid, int smem,
                           cudaStream_t stream) {
  if (staging.half_w) launch_tc_mma_sync_nt<kTerms, kBK, kTcKCSmall>(args, staging, grid, smem, stream);
  else launch_tc_mma_sync_nt<kTerms, kBK, kTcKC>(args, staging, grid, smem, stream);
}
template <int kTerms>
void launch_tc_mma_sync(const OuterArgs& args, TcMmaSyncStaging staging, const dim3& grid, int smem,
                        cudaStream_t stream) {
  if (staging.half_stages) launch_tc_mma_sync_kc<kTerms, kTcBKSmall>(args, staging, grid, smem, stream);
  else launch_tc_mma_sync_kc<kTerms, kTcBK>(args, staging, grid, smem, stream);
}
}  // namespace

void launch_outer_tc(const OuterArgs& args, int terms, bool wgmma, bool wgmma2, bool half_split,
                     TcMmaSyncStaging staging, cudaStream_t stream) {
  const dim3 grid(unsigned((args.N + args.Tj - 1) / args.Tj), unsigned((args.Na + args.Ti - 1) / args.Ti),
                  unsigned(args.B));
  const int smem = outer_tc_smem_bytes(args.H, args.Ti, args.Tj, wgmma, wgmma2, staging);
  TORCH_CHECK(!wgmma || (!staging.half_stages && !staging.half_w && !staging.narrow),
              "flashopm: internal error: smaller stages for the mma.sync form alone");
  TORCH_CHECK(!staging.narrow || args.Tj * args.H <= kTcNTNarrow,
              "flashopm: internal error: a narrow phase 1 for a column tile wider than it");
  if (!wgmma) {
    if (terms == 3) launch_tc_mma_sync<3>(args, staging, grid, smem, stream);
    else launch_tc_mma_sync<1>(args, staging, grid, smem, stream);
  } else if (half_split) {
    if (args.fp.x != nullptr) launch_tc_t<3, true, true, true, kTcBK, kTcKC, kTcNT, true>(args, grid, smem, stream);
    else launch_tc_t<3, true, true, true>(args, grid, smem, stream);
  } else if (wgmma2) {
    launch_tc_t<1, true, true>(args, grid, smem, stream);
  } else {
    if (terms == 3) launch_tc_t<3, true, false>(args, grid, smem, stream);
    else launch_tc_t<1, true, false>(args, grid, smem, stream);
  }
}

// the waves form's space starts at a 16-byte boundary past the tile's
int outer_waves_smem_bytes() { return outer_tc_smem_bytes(kFpH, kTcMT / kFpH, kTcNT / kFpH, true, true, {}) + 16 + kWvBytes; }

void launch_outer_waves(const OuterArgs& args, int blocks, cudaStream_t stream) {
  TORCH_CHECK(args.H == kFpH && args.Ti == kTcMT / kFpH && args.Tj == kTcNT / kFpH && args.wv.ws != nullptr,
              "flashopm: internal error: the waves form takes hidden 32 in full tiles");
  constexpr auto kernel = opm_outer_tc_kernel<3, true, true, true, kTcBK, kTcKC, kTcNT, false, true>;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(blocks));
  cfg.blockDim = dim3(kTcThreads);
  cfg.dynamicSmemBytes = size_t(outer_waves_smem_bytes());
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;  // every block resident: the grid's barriers
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  launch_kernel<kernel, SmemSetup::kOptIn>(cfg, args);
}

void launch_fused_exponents(const FusedExponentArgs& args, cudaStream_t stream) {
  const int64_t blocks = int64_t(args.B) * args.N;
  if (blocks == 0) return;
  launch_kernel<opm_fused_exponents_kernel>(unsigned(blocks), 256u, 0, stream, args);
}

void launch_bound_exponents(const FusedExponentArgs& args, cudaStream_t stream) {
  const int64_t blocks = int64_t(args.B) * ((args.N + 31) / 32);
  if (blocks == 0) return;
  launch_kernel<opm_bound_exponents_kernel>(unsigned(blocks), 1024u, 0, stream, args);
}

void launch_split_rows_f16(float* buf, int* exp_out, int64_t B, int64_t rows_n, int H, int64_t n_chunks,
                           cudaStream_t stream) {
  const int64_t blocks = B * rows_n;
  if (blocks == 0) return;
  // a warp per chunk, up to 8 (the chunks of a residue share a block)
  const int warps = int(std::min<int64_t>(std::max<int64_t>(n_chunks, 1), 8));
  launch_kernel<opm_split_rows_f16_kernel>(unsigned(blocks), unsigned(32 * warps), 0, stream, buf, exp_out, int(B),
                                           int(rows_n), H, int(n_chunks));
}

void launch_split_w_f16(const float* w, uint32_t* w_split, int* w_exp, int64_t D, int H, cudaStream_t stream) {
  if (D == 0) return;
  launch_kernel<opm_split_w_f16_kernel>(unsigned(D), 256, 0, stream, w, w_split, w_exp, H);
}

void launch_round_tf32(float* w, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  const unsigned blocks = unsigned(std::min<int64_t>((n + 255) / 256, 1024));
  launch_kernel<opm_round_tf32_kernel>(blocks, 256, 0, stream, w, n);
}

int outer_tc16_smem_bytes(int H, int Ti, int Tj, int form) { return tc16_layout(H, Ti, Tj, form).total; }

bool outer_tc16_wgmma_built() {
#ifdef FLASHOPM_SM90A
  return true;
#else
  return false;
#endif
}

int loaded_code_arch() {
  // Any kernel serves: the driver picks one target of the build for the whole module.
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, opm_round_tf32_kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return attr.ptxVersion;
}

namespace {
template <typename T, bool kWgmma, bool kWgmmaBoth, int kBK = kT16BK, int kNT = kTcNT>
void launch_tc16_t(const OuterArgs& args, const dim3& grid, int smem, cudaStream_t stream) {
  constexpr auto kernel = opm_outer_tc16_kernel<T, kWgmma, kWgmmaBoth, kBK, kNT>;
  launch_kernel<kernel, SmemSetup::kOptIn>(grid, kTcThreads, smem, stream, args);
}
template <typename T>
void launch_tc16_form(const OuterArgs& args, int form, const dim3& grid, int smem, cudaStream_t stream) {
  switch (form) {
    case kT16WgmmaBoth: return launch_tc16_t<T, true, true>(args, grid, smem, stream);
    case kT16WgmmaPhase1: return launch_tc16_t<T, true, false>(args, grid, smem, stream);
    case kT16MmaSyncHalfStages: return launch_tc16_t<T, false, false, kT16BKSmall>(args, grid, smem, stream);
    case kT16MmaSyncNarrow: return launch_tc16_t<T, false, false, kT16BK, kT16NTNarrow>(args, grid, smem, stream);
    case kT16MmaSyncNarrowHalfStages:
      return launch_tc16_t<T, false, false, kT16BKSmall, kT16NTNarrow>(args, grid, smem, stream);
    default: return launch_tc16_t<T, false, false>(args, grid, smem, stream);
  }
}
}  // namespace

namespace {
// The launch of a tensor-copy form's kernel: a row of clusters of kCluster blocks.
template <int kCluster, bool kWide>
cudaLaunchConfig_t tc16_cluster_config(dim3 grid, int smem, cudaStream_t stream, cudaLaunchAttribute (&attr)[1]) {
  return cluster_config(grid, Tc16Shape<kWide>::kTmaThreads, smem, stream, dim3(kCluster, 1, 1), attr);
}

template <typename T, int kCluster, bool kWide>
int tc16_max_active_clusters(int dev, int smem) {
  constexpr auto kernel = opm_outer_tc16_cluster_kernel<T, kCluster, kWide>;
  allow_smem<kernel>(dev);
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t cfg = tc16_cluster_config<kCluster, kWide>(dim3(kCluster, 1, 1), smem, nullptr, attr);
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();  // not runnable with this configuration: report none
    n = 0;
  }
  return n;
}
}  // namespace

int outer_tc16_max_clusters(int dev, int operand_kind, int cluster, int smem, bool wide) {
  if (driver_launch_api().encode_tiled == nullptr || (cluster != 1 && cluster != 2 && cluster != 4) ||
      (wide && cluster == 4))
    return 0;
  // Asked once per (device, operand type, cluster size, shared memory) for the kernel that would
  // launch: whether a cluster fits at all depends on the GPU's partition into GPCs.
  static std::mutex mu;
  static std::map<std::array<int, 5>, int> cache;
  const std::array<int, 5> key{dev, operand_kind == kMaskHalf ? 1 : 0, cluster, smem, int(wide)};
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it == cache.end()) {
    int n = 0;
    auto max_active = [&](auto tag) {
      using T = typename decltype(tag)::type;
      if (wide)
        return cluster == 2 ? tc16_max_active_clusters<T, 2, true>(dev, smem)
                            : tc16_max_active_clusters<T, 1, true>(dev, smem);
      return cluster == 4   ? tc16_max_active_clusters<T, 4, false>(dev, smem)
             : cluster == 2 ? tc16_max_active_clusters<T, 2, false>(dev, smem)
                            : tc16_max_active_clusters<T, 1, false>(dev, smem);
    };
    n = operand_kind == kMaskHalf ? max_active(TypeTag<__half>{}) : max_active(TypeTag<__nv_bfloat16>{});
    it = cache.emplace(key, n).first;
  }
  return it->second;
}

int outer_tc16_resident_blocks(int dev, int operand_kind, int smem) {
  // asked once per (device, operand type, shared memory), as for the clusters above
  static std::mutex mu;
  static std::map<std::array<int, 3>, int> cache;
  const std::array<int, 3> key{dev, operand_kind == kMaskHalf ? 1 : 0, smem};
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it == cache.end()) {
    auto per_sm = [&](auto tag) {
      using T = typename decltype(tag)::type;
      constexpr auto kernel = opm_outer_tc16_kernel<T, true, true>;
      allow_smem<kernel>(dev);
      int n = 0;
      if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kTcThreads, smem) != cudaSuccess) {
        (void)cudaGetLastError();
        n = 0;
      }
      return n;
    };
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    const int n = operand_kind == kMaskHalf ? per_sm(TypeTag<__half>{}) : per_sm(TypeTag<__nv_bfloat16>{});
    it = cache.emplace(key, n * sms).first;
  }
  return it->second;
}

namespace {
// A 128-byte-swizzled tensor map of 16-bit elements (dims and boxes innermost first; strides in
// bytes of every dimension past the first).
// Whether the driver took it (required: the caller checks).
bool encode_map16_if_taken(unsigned char (&out)[128], int operand_kind, const void* base, int rank, const cuuint64_t* dims,
                      const cuuint64_t* strides, const cuuint32_t* box, CUresult* result = nullptr) {
  static_assert(sizeof(CUtensorMap) == 128, "CUtensorMap is 128 bytes");
  const PFN_cuTensorMapEncodeTiled_v12000 encode = driver_launch_api().encode_tiled;
  TORCH_CHECK(encode != nullptr,
              "flashopm: the driver's cuTensorMapEncodeTiled was not found (the tensor-copy forms need it)");
  CUtensorMap map;
  const cuuint32_t elem_strides[5] = {1, 1, 1, 1, 1};
  const CUresult r = encode(&map, operand_kind == kMaskHalf ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                            cuuint32_t(rank), const_cast<void*>(base), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != nullptr) *result = r;
  if (r != CUDA_SUCCESS) return false;
  std::memcpy(out, &map, sizeof(map));
  return true;
}
void encode_map16(unsigned char (&out)[128], int operand_kind, const void* base, int rank, const cuuint64_t* dims,
                  const cuuint64_t* strides, const cuuint32_t* box) {
  CUresult r = CUDA_SUCCESS;
  TORCH_CHECK(encode_map16_if_taken(out, operand_kind, base, rank, dims, strides, box, &r), "flashopm: cuTensorMapEncodeTiled failed (",
              int(r), ") for a tensor of rank ", rank, " with inner dimension ", dims[0]);
}

template <typename T, int kCluster, bool kWide>
void launch_tc16_clusters(const OuterArgs& args, int operand_kind, int clusters, int smem, cudaStream_t stream) {
  // a (B, S, Na·H) and b (B, S, N·H) in boxes of kT16WgBK s x 64 columns; W in o_k_order as
  // (D, H²) in boxes of kTcDG / kCluster rows of d x 64 k (kWide: half a chunk, 64 rows, each
  // into its own place: tc16_wide_w_half)
  Tc16Maps maps{};
  const cuuint64_t NaH = cuuint64_t(args.Na) * args.H, NH = cuuint64_t(args.N) * args.H, S = cuuint64_t(args.S);
  const cuuint64_t K2 = cuuint64_t(args.H) * args.H;
  const cuuint32_t box_ab[3] = {64, cuuint32_t(kT16WgBK), 1}, box_w[2] = {64, cuuint32_t(kWide ? kTcDG / 2 : kTcDG / kCluster)};
  const cuuint64_t dims_a[3] = {NaH, S, cuuint64_t(args.B)}, strides_a[2] = {NaH * 2, S * NaH * 2};
  const cuuint64_t dims_b[3] = {NH, S, cuuint64_t(args.B)}, strides_b[2] = {NH * 2, S * NH * 2};
  const cuuint64_t dims_w[2] = {K2, cuuint64_t(args.D)}, strides_w[1] = {K2 * 2};
  encode_map16(maps.a, operand_kind, args.a, 3, dims_a, strides_a, box_ab);
  encode_map16(maps.b, operand_kind, args.b, 3, dims_b, strides_b, box_ab);
  encode_map16(maps.w, operand_kind, args.w_blocked, 2, dims_w, strides_w, box_w);
  OuterArgs kargs = args;
  // the kernel's groups of tiles (as it counts them: tc16_group_tile)
  const Tc16GroupCounts counts = tc16_group_counts(args.N, args.Na, args.Ti, args.Tj, kCluster);
  kargs.tc16_groups_per_b = make_fast_divisor(uint32_t(counts.col_blocks) * uint32_t(counts.row_groups));
  kargs.tc16_group_span = make_fast_divisor(uint32_t(kTileGroupRows) * uint32_t(counts.col_blocks));
  if (kWide && args.tc16_b_pairs) {
    // b as (64 columns, s, groups of 64 columns, batch): one box takes a block's two groups of a
    // stage, each kT16WgBK rows of 128 bytes, group after group as the stage lays them.  Its
    // strides do not grow with the dimension; where a driver refuses that, a copy a group.
    TORCH_CHECK(NH % 64 == 0, "flashopm: internal error: b in pairs of 64-column groups needs N·hidden a multiple of 64, got ", NH);
    const cuuint32_t box_b2[4] = {64, cuuint32_t(kT16WgBK), 2, 1};
    const cuuint64_t dims_b2[4] = {64, S, NH / 64, cuuint64_t(args.B)}, strides_b2[3] = {NH * 2, 128, S * NH * 2};
    CUresult r = CUDA_SUCCESS;
    kargs.tc16_b_pairs = encode_map16_if_taken(maps.b2, operand_kind, args.b, 4, dims_b2, strides_b2, box_b2, &r);
    if (!kargs.tc16_b_pairs)
      TORCH_WARN_ONCE("flashopm: the driver refused b's map in pairs of 64-column groups (", int(r),
                      "); the tensor-copy forms copy b a group at a time");
  }
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t cfg =
      tc16_cluster_config<kCluster, kWide>(dim3(unsigned(clusters * kCluster)), smem, stream, attr);
  launch_kernel<opm_outer_tc16_cluster_kernel<T, kCluster, kWide>, SmemSetup::kOptIn>(cfg, kargs, maps);
}
template <typename T>
void launch_tc16_clusters_of(const OuterArgs& args, int operand_kind, int cluster, bool wide, int clusters, int smem,
                             cudaStream_t stream) {
  if (wide) {
    if (cluster == 2) return launch_tc16_clusters<T, 2, true>(args, operand_kind, clusters, smem, stream);
    return launch_tc16_clusters<T, 1, true>(args, operand_kind, clusters, smem, stream);
  }
  if (cluster == 4) return launch_tc16_clusters<T, 4, false>(args, operand_kind, clusters, smem, stream);
  if (cluster == 2) return launch_tc16_clusters<T, 2, false>(args, operand_kind, clusters, smem, stream);
  launch_tc16_clusters<T, 1, false>(args, operand_kind, clusters, smem, stream);
}
}  // namespace

void launch_outer_tc16(const OuterArgs& args, int operand_kind, int form, int max_clusters, cudaStream_t stream) {
  const int tj_block = args.Tj * kT16JSub;
  const dim3 grid(unsigned((args.N + tj_block - 1) / tj_block), unsigned((args.Na + args.Ti - 1) / args.Ti),
                  unsigned(args.B));
  const int smem = outer_tc16_smem_bytes(args.H, args.Ti, args.Tj, form);
  if (tc16_form_tma(form)) {
    const int cluster = tc16_form_cluster(form);
    const bool wide = tc16_form_wide(form);
    const int mt = wide ? Tc16Shape<true>::kMT : kTcMT;
    TORCH_CHECK(args.Ti * args.H == mt && args.Tj * args.H == kTcNT && args.w_blocked != nullptr &&
                    (!wide || (args.D <= kTcDG && args.Ti * args.Tj * kT16JSub == Tc16Shape<true>::kRound)),
                "flashopm: internal error: the tensor-copy forms need whole tiles (Ti·H = ", mt, ", Tj·H = ", kTcNT,
                ") and W in blocks", wide ? ", the wide ones one round of pairs a tile and D <= 128" : "", ", got Ti ",
                args.Ti, ", Tj ", args.Tj, ", H ", args.H, ", D ", args.D);
    // groups of tiles: a column block, `cluster` row tiles (those past Na copy their shares of b
    // and W for their peers), a batch element; each cluster takes them in turn, so that max_clusters
    // (> 0) keeps every cluster resident and its next tile's first stages load beside its last
    // tile's phase 2
    const Tc16GroupCounts counts = tc16_group_counts(args.N, args.Na, args.Ti, args.Tj, cluster);
    const int64_t groups = int64_t(counts.col_blocks) * counts.row_groups * args.B;
    const int64_t clusters = max_clusters > 0 ? std::min<int64_t>(groups, max_clusters) : groups;
    TORCH_CHECK(groups < (int64_t(1) << 31) && clusters * cluster < (int64_t(1) << 31),
                "flashopm: too many tiles for one launch of the tensor-copy form (", groups, " groups)");
    if (operand_kind == kMaskHalf)
      return launch_tc16_clusters_of<__half>(args, operand_kind, cluster, wide, int(clusters), smem, stream);
    return launch_tc16_clusters_of<__nv_bfloat16>(args, operand_kind, cluster, wide, int(clusters), smem, stream);
  }
  if (form == kT16WgmmaBoth) {
    // a row of blocks taking tiles in turn: max_clusters (> 0) resident blocks, else one a tile
    const int64_t tiles = int64_t(grid.x) * grid.y * grid.z;
    const int64_t blocks = max_clusters > 0 ? std::min<int64_t>(tiles, max_clusters) : tiles;
    TORCH_CHECK(tiles < (int64_t(1) << 31), "flashopm: too many tiles for one launch of the 16-bit kernel (", tiles, ")");
    const dim3 row(unsigned(blocks), 1, 1);
    if (operand_kind == kMaskHalf) launch_tc16_form<__half>(args, form, row, smem, stream);
    else launch_tc16_form<__nv_bfloat16>(args, form, row, smem, stream);
    return;
  }
  if (operand_kind == kMaskHalf) launch_tc16_form<__half>(args, form, grid, smem, stream);
  else launch_tc16_form<__nv_bfloat16>(args, form, grid, smem, stream);
}

bool ln_backward_regs(int C, int H) {
  return ln_backward_regs_form(C, H) && !env_is("FLASHOPM_LN_BACKWARD_REGS", "0");
}

int ln_backward_mma_smem_bytes(int C, bool tf32) {
  if (tf32) return C == 64 ? LnTf32Layout<1>::bytes : C == 128 ? LnTf32Layout<2>::bytes : LnTf32Layout<4>::bytes;
  return C == 64 ? LnMmaLayout<1>::bytes : C == 128 ? LnMmaLayout<2>::bytes : LnMmaLayout<4>::bytes;
}

int ln_backward_smem_bytes(int C, int H, bool regs) {
  return int((regs ? ln_backward_regs_smem_floats(C, H) : ln_backward_smem_floats(C, H)) * sizeof(float));
}

namespace {
template <auto Kernel>
void launch_ln_backward_k(const LnBackwardArgs& args, int blocks, cudaStream_t stream) {
  const int smem = ln_backward_smem_bytes(args.C, args.H, args.regs != 0);
  launch_kernel<Kernel, SmemSetup::kOptIn>(blocks, kLnBwdThreads, smem, stream, args);
}
template <typename XT, int kMT>
void launch_ln_backward_mma(const LnBackwardArgs& args, int blocks, cudaStream_t stream) {
  launch_kernel<opm_ln_backward_mma_kernel<XT, kMT>, SmemSetup::kOptIn>(blocks, kLnBwdThreads, LnMmaLayout<kMT>::bytes,
                                                                        stream, args);
}
template <int kMT, int kTerms>
void launch_ln_backward_tf32_t(const LnBackwardArgs& args, int blocks, cudaStream_t stream) {
  launch_kernel<opm_ln_backward_tf32_kernel<kMT, kTerms>, SmemSetup::kOptIn>(blocks, kLnBwdThreads,
                                                                             LnTf32Layout<kMT>::bytes, stream, args);
}
template <int kMT>
void launch_ln_backward_tf32(const LnBackwardArgs& args, int blocks, cudaStream_t stream) {
  if (args.mma == 3) launch_ln_backward_tf32_t<kMT, 3>(args, blocks, stream);
  else launch_ln_backward_tf32_t<kMT, 1>(args, blocks, stream);
}
template <typename XT>
void launch_ln_backward_x(const LnBackwardArgs& args, int blocks, cudaStream_t stream) {
  if (args.mma) {
    TORCH_CHECK(ln_backward_mma_form(args.C, args.H), "flashopm: internal: no tensor-core LayerNorm backward for C=" +
                                                          std::to_string(args.C) + ", H=" + std::to_string(args.H));
    if constexpr (std::is_same_v<XT, float>) {
      if (args.C == 64) launch_ln_backward_tf32<1>(args, blocks, stream);
      else if (args.C == 128) launch_ln_backward_tf32<2>(args, blocks, stream);
      else launch_ln_backward_tf32<4>(args, blocks, stream);
    } else {
      if (args.C == 64) launch_ln_backward_mma<XT, 1>(args, blocks, stream);
      else if (args.C == 128) launch_ln_backward_mma<XT, 2>(args, blocks, stream);
      else launch_ln_backward_mma<XT, 4>(args, blocks, stream);
    }
  } else if (args.regs) {
    const int h2 = ln_backward_regs_h2(args.H);
    if (h2 == 16) launch_ln_backward_k<opm_ln_backward_regs_kernel<16, XT>>(args, blocks, stream);
    else if (h2 == 32) launch_ln_backward_k<opm_ln_backward_regs_kernel<32, XT>>(args, blocks, stream);
    else launch_ln_backward_k<opm_ln_backward_regs_kernel<64, XT>>(args, blocks, stream);
  } else if (ln_backward_cols(args.C) == 1) {
    launch_ln_backward_k<opm_ln_backward_kernel<1, XT>>(args, blocks, stream);
  } else {
    launch_ln_backward_k<opm_ln_backward_kernel<2, XT>>(args, blocks, stream);
  }
}
}  // namespace

void launch_ln_backward(const LnBackwardArgs& args, int blocks, cudaStream_t stream) {
  with_x_type(args.x_kind, [&](auto t) { launch_ln_backward_x<typename decltype(t)::type>(args, blocks, stream); });
}

void launch_ln_backward_reduce(const LnBackwardReduceArgs& args, cudaStream_t stream) {
  const int64_t P = ln_backward_partial_floats(args.C, args.H);
  launch_kernel<opm_ln_backward_reduce_kernel>(unsigned((P + kLnBwdReduceThreads - 1) / kLnBwdReduceThreads),
                                               kLnBwdReduceThreads, 0, stream, args);
}

namespace {
template <int kKind>
void launch_pair_count_mma(const PairCountArgs& args, cudaStream_t stream) {
  const dim3 grid(unsigned((args.N + pair_mma_cols(kKind) - 1) / pair_mma_cols(kKind)),
                  unsigned((args.rows + kPairMmaTR - 1) / kPairMmaTR), unsigned(args.B));
  launch_kernel<opm_pair_count_mma_kernel<kKind>, SmemSetup::kOptIn>(grid, kPairMmaThreads,
                                                                     pair_mma_smem_bytes(kKind), stream, args);
}
}  // namespace

void launch_pair_count(const PairCountArgs& args, cudaStream_t stream) {
  if (args.mma) {
    switch (args.mask.kind) {
      case kMaskBool: return launch_pair_count_mma<kMaskBool>(args, stream);
      case kMaskHalf: return launch_pair_count_mma<kMaskHalf>(args, stream);
      case kMaskBFloat16: return launch_pair_count_mma<kMaskBFloat16>(args, stream);
      default: return launch_pair_count_mma<kMaskFloat>(args, stream);
    }
  }
  const dim3 grid(unsigned((args.N + kPairTJ - 1) / kPairTJ), unsigned((args.rows + kPairTR - 1) / kPairTR),
                  unsigned(args.B));
  launch_kernel<opm_pair_count_kernel>(grid, kPairThreads, 0, stream, args);
}

void launch_row_denominators(const RowDenArgs& args, cudaStream_t stream) {
  const dim3 grid(unsigned((args.rows + kRowDenWarps - 1) / kRowDenWarps), unsigned(args.B));
  launch_kernel<opm_row_denominator_kernel>(grid, kRowDenWarps * 32, 0, stream, args);
}

int project_gemm_smem_bytes(bool big_tiles) { return big_tiles ? BigGemm::kSmemBytes : SmallGemm::kSmemBytes; }

void launch_project_gemm(const ProjectArgs& args, bool big_tiles, cudaStream_t stream) {
  if (big_tiles) {
    constexpr auto kernel = opm_project_gemm_kernel<128, 128, 8, 8, 8, 4>;
    const dim3 grid(unsigned((args.NC + 127) / 128), unsigned((args.M + 127) / 128), unsigned(args.B));
    launch_kernel<kernel, SmemSetup::kOptIn>(grid, BigGemm::kThreads, BigGemm::kSmemBytes, stream, args);
  } else {
    constexpr auto kernel = opm_project_gemm_kernel<32, 32, 32, 2, 2, 4>;
    const dim3 grid(unsigned((args.NC + 31) / 32), unsigned((args.M + 31) / 32), unsigned(args.B));
    launch_kernel<kernel, SmemSetup::kOptIn>(grid, SmallGemm::kThreads, SmallGemm::kSmemBytes, stream, args);
  }
}

namespace {

cudaLaunchConfig_t small_config(dim3 grid, int cluster_size, int smem_bytes, cudaStream_t stream,
                                cudaLaunchAttribute* attr) {
  return cluster_config(grid, kSmallThreads, smem_bytes, stream, dim3(unsigned(cluster_size)), attr);
}

}  // namespace

void launch_small(const SmallArgs& args, int smem_bytes, cudaStream_t stream) {
  const unsigned gx = unsigned((args.n_itiles + args.CL - 1) / args.CL * args.CL);
  const dim3 grid(gx, unsigned((args.D + args.Dc - 1) / args.Dc), unsigned(args.B));
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t cfg = small_config(grid, args.CL, smem_bytes, stream, attr);
  if (args.N % 4 == 0) {
    launch_kernel<opm_small_kernel<true>, SmemSetup::kOptIn>(cfg, args);
  } else {
    launch_kernel<opm_small_kernel<false>, SmemSetup::kOptIn>(cfg, args);
  }
}

int small_max_active_clusters(int cluster_size, int smem_bytes) {
  // Asked once per (device, cluster size, shared memory): the answer depends on the GPU's
  // partition into GPCs, which no formula gives.
  static std::mutex mu;
  static std::map<std::pair<int, std::pair<int, int>>, int> cache;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const auto key = std::make_pair(dev, std::make_pair(cluster_size, smem_bytes));
  std::lock_guard<std::mutex> lock(mu);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  allow_smem<opm_small_kernel<true>>(dev);
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t cfg = small_config(dim3(unsigned(cluster_size)), cluster_size, smem_bytes, nullptr, attr);
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, opm_small_kernel<true>, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();  // not runnable with this configuration: report none
    n = 0;
  }
  cache.emplace(key, n);
  return n;
}

int small_tc_smem_bytes(int S, int N, int H, int TI, int Dc, bool fma) {
  return (fma ? small_tc_fma_layout(S, N, H, TI, Dc) : small_tc_layout(S, N, H, TI, Dc)).total * int(sizeof(float));
}

namespace {
template <auto Kernel>
void launch_small_tc_t(const cudaLaunchConfig_t& cfg, const SmallTcArgs& args) {
  launch_kernel<Kernel, SmemSetup::kOptIn>(cfg, args);
}

// The chained float16 split form: the exact number of m tiles of j, and whole tiles (no row of i,
// j or position s past the problem's in any block, and both rows i of every item in its tile) or
// not.
template <int kJT, bool kWhole>
void launch_small_f16_chain_jt(const cudaLaunchConfig_t& cfg, const SmallTcArgs& args) {
  if (args.fused) return launch_small_tc_t<opm_small_f16_chain_fused_kernel<kJT, kWhole>>(cfg, args);
  launch_small_tc_t<opm_small_f16_chain_kernel<kJT, kWhole>>(cfg, args);
}
template <bool kWhole>
void launch_small_f16_chain_t(const cudaLaunchConfig_t& cfg, const SmallTcArgs& args) {
  switch (args.f16_chain) {
    case 1: return launch_small_f16_chain_jt<1, kWhole>(cfg, args);
    case 2: return launch_small_f16_chain_jt<2, kWhole>(cfg, args);
    default: return launch_small_f16_chain_jt<3, kWhole>(cfg, args);
  }
}
void launch_small_f16_chain(const cudaLaunchConfig_t& cfg, const SmallTcArgs& args) {
  const bool whole = args.N % args.TI == 0 && args.TI % kSmallF16ChainIG == 0 && args.N % 16 == 0 &&
                     args.S % 8 == 0 && args.D % args.Dc == 0;
  if (whole) return launch_small_f16_chain_t<true>(cfg, args);
  launch_small_f16_chain_t<false>(cfg, args);
}
}  // namespace

void launch_small_tc(const SmallTcArgs& args, int terms, cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned((args.D + args.Dc - 1) / args.Dc), unsigned((args.N + args.TI - 1) / args.TI),
                     unsigned(args.B));
  cfg.blockDim = dim3(kSmallTcThreads);
  cfg.dynamicSmemBytes =
      size_t(args.f16_chain ? small_f16_chain_layout(args.S, args.N, args.H, args.TI, args.Dc).total
             : args.f16     ? small_f16_layout(args.S, args.N, args.H, args.TI, args.Dc).total
                            : small_tc_smem_bytes(args.S, args.N, args.H, args.TI, args.Dc, args.fma != 0));
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  if (args.fused) {
    attr[0].id = cudaLaunchAttributeCooperative;
    attr[0].val.cooperative = 1;
  } else {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
  }
  if (args.pair_copies) {  // pairs of blocks along d share their copies (SmallTcArgs::pair_copies)
    attr[1].id = cudaLaunchAttributeClusterDimension;
    attr[1].val.clusterDim.x = 2;
    attr[1].val.clusterDim.y = 1;
    attr[1].val.clusterDim.z = 1;
    cfg.numAttrs = 2;
  }
  if (args.f16_chain) {
    launch_small_f16_chain(cfg, args);
  } else if (args.f16) {
    launch_small_tc_t<opm_small_f16_kernel>(cfg, args);
  } else if (args.fma) {
    if (args.fused) launch_small_tc_t<opm_small_tc_kernel<0, true, false>>(cfg, args);
    else if (args.local_a) launch_small_tc_t<opm_small_tc_kernel<0, false, true>>(cfg, args);
    else launch_small_tc_t<opm_small_tc_kernel<0, false, false>>(cfg, args);
  } else if (terms == 3) {
    if (args.fused) launch_small_tc_t<opm_small_tc_kernel<3, true, false>>(cfg, args);
    else launch_small_tc_t<opm_small_tc_kernel<3, false, false>>(cfg, args);
  } else {
    if (args.fused) launch_small_tc_t<opm_small_tc_kernel<1, true, false>>(cfg, args);
    else launch_small_tc_t<opm_small_tc_kernel<1, false, false>>(cfg, args);
  }
}

int bwd_side_smem_bytes() { return kBwSideSmemFloats * int(sizeof(float)); }
int bwd_w_smem_bytes() { return kBwWSmemFloats * int(sizeof(float)); }

namespace {
template <int kTerms, int kH>
void launch_bwd_side_t(const BwdSideArgs& args, cudaStream_t stream) {
  constexpr int hc = kBwSideCols / kH, ti = kBwSideRows / hc;
  const dim3 grid(unsigned((args.Nr + ti - 1) / ti), unsigned(kH / hc),
                  unsigned(args.B * args.n_sblocks * args.jsplits));
  constexpr auto kernel = opm_bwd_side_kernel<kTerms, kH>;
  launch_kernel<kernel, SmemSetup::kOptIn>(grid, kBwThreads, bwd_side_smem_bytes(), stream, args);
}
template <int kTerms, int kH>
void launch_bwd_w_t(const BwdWArgs& args, int splits, cudaStream_t stream) {
  constexpr int hc = kBwWCols / kH;
  const dim3 grid(unsigned(kH / hc), unsigned((args.D + kBwWDG - 1) / kBwWDG), unsigned(splits));
  constexpr auto kernel = opm_bwd_w_kernel<kTerms, kH>;
  launch_kernel<kernel, SmemSetup::kOptIn>(grid, kBwThreads, bwd_w_smem_bytes(), stream, args);
}
template <int kTerms>
void launch_bwd_side_h(const BwdSideArgs& args, cudaStream_t stream) {
  if (args.H == 16) return launch_bwd_side_t<kTerms, 16>(args, stream);
  if (args.H == 32) return launch_bwd_side_t<kTerms, 32>(args, stream);
  return launch_bwd_side_t<kTerms, 64>(args, stream);
}
template <int kTerms>
void launch_bwd_w_h(const BwdWArgs& args, int splits, cudaStream_t stream) {
  if (args.H == 16) return launch_bwd_w_t<kTerms, 16>(args, splits, stream);
  if (args.H == 32) return launch_bwd_w_t<kTerms, 32>(args, splits, stream);
  return launch_bwd_w_t<kTerms, 64>(args, splits, stream);
}
}  // namespace

// hidden_dim 16, 32 or 64 (checked by the caller)
void launch_bwd_side(const BwdSideArgs& args, int terms, cudaStream_t stream) {
  if (terms == 3) return launch_bwd_side_h<3>(args, stream);
  launch_bwd_side_h<1>(args, stream);
}

namespace {
// The float16 split kernels' launch: kKernel3 for three terms, else kKernel1 (one block of
// kBwThreads per grid cell, opted-in shared memory).
template <auto kKernel3, auto kKernel1, typename... Args>
void launch_by_terms(int terms, const dim3& grid, int smem_bytes, cudaStream_t stream, const Args&... args) {
  if (terms == 3) return launch_kernel<kKernel3, SmemSetup::kOptIn>(grid, kBwThreads, smem_bytes, stream, args...);
  launch_kernel<kKernel1, SmemSetup::kOptIn>(grid, kBwThreads, smem_bytes, stream, args...);
}
}  // namespace

void launch_bwd_side_f16(const BwdSideArgs& args, const float* g_inv, bool swap_hh, int terms, cudaStream_t stream) {
  TORCH_CHECK(g_inv == nullptr || args.Dp % 32 == 0,
              "flashopm: internal error: g split for the side kernels with pair_dim ", args.Dp, ", not a multiple of 32");
  const int HH = args.H * args.H;
  launch_kernel<opm_split_side_w_kernel>(unsigned(HH / 32), 256, 0, stream, args.w, const_cast<uint32_t*>(args.w_split),
                                         const_cast<float*>(args.w_inv), args.H, args.D, swap_hh);
  launch_kernel<opm_split_side_y_kernel>(unsigned(int64_t(args.B) * args.S), 128, 0, stream, args.y,
                                         const_cast<uint32_t*>(args.y_split), const_cast<float*>(args.y_inv), args.S,
                                         args.Nc * args.H);
  constexpr int kH = 32, hc = kBwSideCols / kH, ti = kBwSideRows / hc;
  const dim3 grid(unsigned((args.Nr + ti - 1) / ti), unsigned(kH / hc),
                  unsigned(args.B * args.n_sblocks * args.jsplits));
  if (g_inv == nullptr)
    launch_by_terms<opm_bwd_side_f16_kernel<3, kH>, opm_bwd_side_f16_kernel<1, kH>>(terms, grid, kBsfSmemBytes, stream,
                                                                                    args);
  else
    launch_by_terms<opm_bwd_side_f16_g_split_kernel<3, kH>, opm_bwd_side_f16_g_split_kernel<1, kH>>(
        terms, grid, kBsfSmemBytes, stream, args, g_inv);
}

namespace {
// The W kernel's float16 split form for terms, g split or not, overlapped or not.
template <bool kGSplit>
void launch_bwd_w_f16_kernel(const dim3& grid, int terms, bool overlap, cudaStream_t stream, const BwdWArgs& args) {
  constexpr int kH = 32;
  if (overlap)
    launch_by_terms<opm_bwd_w_f16_kernel<3, kH, kGSplit, true>, opm_bwd_w_f16_kernel<1, kH, kGSplit, true>>(
        terms, grid, kBwfOverlapSmemBytes, stream, args);
  else
    launch_by_terms<opm_bwd_w_f16_kernel<3, kH, kGSplit>, opm_bwd_w_f16_kernel<1, kH, kGSplit>>(terms, grid, kBwfSmemBytes,
                                                                                               stream, args);
}
}  // namespace

void launch_bwd_w_f16(const BwdWArgs& args, int splits, int terms, bool overlap, cudaStream_t stream) {
  launch_kernel<opm_split_ab_f16_kernel>(unsigned(int64_t(args.B) * args.Nr), 256, 0, stream, args.a,
                                         const_cast<uint32_t*>(args.a_split), const_cast<float*>(args.a_inv), args.S,
                                         args.Nr);
  launch_kernel<opm_split_ab_f16_kernel>(unsigned(int64_t(args.B) * args.Nc), 256, 0, stream, args.b,
                                         const_cast<uint32_t*>(args.b_split), const_cast<float*>(args.b_inv), args.S,
                                         args.Nc);
  constexpr int kH = 32, hc = kBwWCols / kH;
  const dim3 grid(unsigned(kH / hc), unsigned((args.D + kBwWDG - 1) / kBwWDG), unsigned(splits));
  if (args.g_inv_split == nullptr) return launch_bwd_w_f16_kernel<false>(grid, terms, overlap, stream, args);
  // g split in place once (after the side kernels have read it as float32, or before the side
  // split writes it again from grad_out), then the kernel that reads it split
  const int64_t chunks = w_g_split_chunks(args.B, args.Nr, args.Nc);
  TORCH_CHECK(w_g_split_fits(args.Nr, args.Nc, args.Dp) && chunks <= INT32_MAX,
              "flashopm: internal error: g split for the W kernel with units that are not whole");
  const dim3 split_grid(unsigned(chunks), unsigned(args.Dp / kBwWDG));
  float* g = const_cast<float*>(args.g);
  if (terms == 3) launch_kernel<opm_split_w_g_kernel<3>>(split_grid, kBwWDG, 0, stream, args, g, args.g_inv_split);
  else launch_kernel<opm_split_w_g_kernel<1>>(split_grid, kBwWDG, 0, stream, args, g, args.g_inv_split);
  launch_bwd_w_f16_kernel<true>(grid, terms, overlap, stream, args);
}

void launch_bwd_w(const BwdWArgs& args, int splits, int terms, cudaStream_t stream) {
  if (terms == 3) return launch_bwd_w_h<3>(args, splits, stream);
  launch_bwd_w_h<1>(args, splits, stream);
}

namespace {
// Blocks along x for a launch over `count` tensors (one per blockIdx.y) of n[k] elements each,
// grid-strided past `cap` blocks; 0 when there is nothing to do.
template <typename Args>
int64_t per_tensor_blocks(const Args& args, int threads, int64_t cap) {
  int64_t n = 0;
  for (int k = 0; k < args.count; ++k) n = std::max(n, args.n[k]);
  return std::min<int64_t>((n + threads - 1) / threads, cap);
}
}  // namespace

// ---- the batch's graphs ----
namespace {

// A sequence of launches by what its graph fixes: kernels, grids, blocks, shared memory and
// attributes (the parameters are set per launch).  Only the attributes the launchers use are
// known; a batch with another goes out launch by launch (valid = false).
struct GraphKey {
  struct Launch {
    const void* func = nullptr;
    unsigned grid[3] = {}, block[3] = {};
    size_t smem = 0;
    int pdl = 0;
    unsigned cluster[3] = {};
    bool operator==(const Launch& o) const {
      return func == o.func && std::equal(grid, grid + 3, o.grid) && std::equal(block, block + 3, o.block) &&
             smem == o.smem && pdl == o.pdl && std::equal(cluster, cluster + 3, o.cluster);
    }
  };
  int dev = 0, count = 0;
  bool valid = true;
  std::array<Launch, kBatchMaxLaunches> launches{};
  bool operator==(const GraphKey& o) const {
    if (dev != o.dev || count != o.count) return false;
    for (int i = 0; i < count; ++i)
      if (!(launches[i] == o.launches[i])) return false;
    return true;
  }
};

GraphKey graph_key(const LaunchBatch& batch, int dev) {
  GraphKey key;
  key.dev = dev;
  key.count = batch.count;
  for (int i = 0; i < batch.count; ++i) {
    const BatchedLaunch& l = batch.launches[i];
    GraphKey::Launch& k = key.launches[i];
    k.func = l.func;
    k.grid[0] = l.cfg.gridDim.x, k.grid[1] = l.cfg.gridDim.y, k.grid[2] = l.cfg.gridDim.z;
    k.block[0] = l.cfg.blockDim.x, k.block[1] = l.cfg.blockDim.y, k.block[2] = l.cfg.blockDim.z;
    k.smem = l.cfg.dynamicSmemBytes;
    for (unsigned a = 0; a < l.cfg.numAttrs; ++a) {
      const cudaLaunchAttribute& attr = l.attrs[a];
      if (attr.id == cudaLaunchAttributeProgrammaticStreamSerialization) {
        k.pdl = attr.val.programmaticStreamSerializationAllowed;
      } else if (attr.id == cudaLaunchAttributeCooperative) {
        // Cooperative launches (the one-launch forms, not the defaults) go out as they are: their
        // graph form is not tested.
        if (attr.val.cooperative) key.valid = false;
      } else if (attr.id == cudaLaunchAttributeClusterDimension) {
        k.cluster[0] = attr.val.clusterDim.x, k.cluster[1] = attr.val.clusterDim.y, k.cluster[2] = attr.val.clusterDim.z;
      } else {
        key.valid = false;
      }
    }
  }
  return key;
}

struct BatchGraph {
  GraphKey key;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::array<cudaGraphNode_t, kBatchMaxLaunches> nodes{};  // in launch order
  uint64_t last_use = 0;

  // Frees the instantiation and its graph (an instantiation still running is freed once it ends).
  void drop() {
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    exec = nullptr;
    graph = nullptr;
  }
};

// Makes one recorded launch on `stream`, with its recorded attributes, less its programmatic one
// where `first_in_graph` (the first kernel of a graph has nothing before it to overlap with; the
// graph launch follows the stream's earlier work).
cudaError_t send_launch(const BatchedLaunch& l, cudaStream_t stream, bool first_in_graph = false) {
  cudaLaunchConfig_t cfg = l.cfg;
  cfg.stream = stream;
  std::array<cudaLaunchAttribute, 4> attrs{};
  if (first_in_graph) {
    unsigned kept = 0;
    for (unsigned a = 0; a < cfg.numAttrs; ++a)
      if (cfg.attrs[a].id != cudaLaunchAttributeProgrammaticStreamSerialization) attrs[kept++] = cfg.attrs[a];
    cfg.attrs = kept ? attrs.data() : nullptr;
    cfg.numAttrs = kept;
  }
  return cudaLaunchKernelExC(&cfg, l.func, const_cast<void**>(l.params.data()));
}

// Instantiated graphs, a few per device: each distinct problem shape has its own, so the least
// recently used goes when a device has kMaxGraphsPerDevice (an instantiated graph still running
// is freed once it ends).  One lock for all: setting a graph's parameters and launching it must
// not interleave with another thread's use of the same graph.
constexpr int kMaxGraphsPerDevice = 32;
struct GraphCache {
  std::mutex mutex;
  uint64_t built = 0, launched = 0, failed = 0;
  std::string failure;  // the last failed build's step and error
  std::vector<BatchGraph> graphs;
  uint64_t clock = 0;
  std::array<cudaStream_t, kMaxDevices> capture_streams{};
};
GraphCache& graph_cache() {
  static GraphCache* cache = new GraphCache;  // never destroyed: graphs may be in use at exit
  return *cache;
}

// Captures the batch's launches (with their attributes) on a private stream into a graph and
// instantiates it.  Where the runtime refuses a step, out.exec stays null, the error is cleared
// and its step and message go into `failure` (the launches then go out one by one).
void build_batch_graph(const LaunchBatch& batch, cudaStream_t capture_stream, BatchGraph& out, std::string& failure) {
  cudaGraph_t graph = nullptr;
  const char* step = nullptr;
  cudaError_t err = cudaSuccess;
  const auto check = [&](cudaError_t e, const char* what) {
    if (step == nullptr && e != cudaSuccess) step = what, err = e;
    return step == nullptr;
  };
  if (check(cudaStreamBeginCapture(capture_stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture")) {
    for (int i = 0; i < batch.count; ++i)
      if (!check(send_launch(batch.launches[i], capture_stream, i == 0), "cudaLaunchKernelExC under capture")) break;
    // The capture ends whatever happened in it.
    const cudaError_t end = cudaStreamEndCapture(capture_stream, &graph);
    check(end, "cudaStreamEndCapture");
  }
  // The nodes in launch order: one stream's capture is a chain from its single root.  The edges
  // are queried with their data, as programmatic ones are not default edges.
  cudaGraphNode_t node = nullptr;
  size_t count = 1;
  if (step == nullptr && check(cudaGraphGetRootNodes(graph, &node, &count), "cudaGraphGetRootNodes") && count != 1)
    step = "one root node", err = cudaErrorInvalidValue;
  for (int i = 0; step == nullptr && i < batch.count; ++i) {
    cudaGraphNodeType type{};
    if (check(cudaGraphNodeGetType(node, &type), "cudaGraphNodeGetType") && type != cudaGraphNodeTypeKernel)
      step = "kernel nodes", err = cudaErrorInvalidValue;
    out.nodes[i] = node;
    if (step == nullptr && i + 1 < batch.count) {
      cudaGraphNode_t next[2] = {};
      cudaGraphEdgeData edges[2] = {};
      count = 2;
#if CUDART_VERSION >= 13000
      check(cudaGraphNodeGetDependentNodes(node, next, edges, &count), "cudaGraphNodeGetDependentNodes");
#else
      check(cudaGraphNodeGetDependentNodes_v2(node, next, edges, &count), "cudaGraphNodeGetDependentNodes");
#endif
      if (step == nullptr && count != 1) step = "a chain of nodes", err = cudaErrorInvalidValue;
      node = next[0];
    }
  }
  if (step == nullptr) check(cudaGraphInstantiate(&out.exec, graph, 0), "cudaGraphInstantiate");
  // The graph stays with its instantiation: the nodes that name the instantiation's nodes when
  // their parameters are set are the graph's.
  out.graph = graph;
  if (step != nullptr) {
    out.drop();
    (void)cudaGetLastError();
    failure = std::string(step) + ": " + cudaGetErrorString(err);
  }
}

// Sends the batch as one graph launch on `stream`; false where no graph could be built for it.
bool launch_batch_graph(const LaunchBatch& batch, cudaStream_t stream) {
  const int dev = batch.dev;
  if (dev < 0 || dev >= kMaxDevices) return false;
  const GraphKey key = graph_key(batch, dev);
  if (!key.valid) return false;
  GraphCache& cache = graph_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  BatchGraph* found = nullptr;
  int on_device = 0;
  for (BatchGraph& g : cache.graphs) {
    if (g.key.dev == dev) ++on_device;
    if (found == nullptr && g.key == key) found = &g;
  }
  if (found == nullptr) {
    if (cache.capture_streams[dev] == nullptr)
      C10_CUDA_CHECK(cudaStreamCreateWithFlags(&cache.capture_streams[dev], cudaStreamNonBlocking));
    BatchGraph built;
    built.key = key;
    build_batch_graph(batch, cache.capture_streams[dev], built, cache.failure);
    if (built.exec == nullptr) ++cache.failed;
    if (on_device >= kMaxGraphsPerDevice) {
      auto oldest = cache.graphs.end();
      for (auto it = cache.graphs.begin(); it != cache.graphs.end(); ++it)
        if (it->key.dev == dev && (oldest == cache.graphs.end() || it->last_use < oldest->last_use)) oldest = it;
      oldest->drop();
      cache.graphs.erase(oldest);
    }
    cache.graphs.push_back(built);
    if (built.exec != nullptr) ++cache.built;
    found = &cache.graphs.back();
  }
  found->last_use = ++cache.clock;
  if (found->exec == nullptr) return false;  // no graph for these launches (cache.failure says why)
  // A refusal here drops the graph for good (the launches then go out one by one), with its reason.
  const auto refused = [&](cudaError_t e, const std::string& step) {
    (void)cudaGetLastError();
    cache.failure = step + ": " + cudaGetErrorString(e);
    ++cache.failed;
    found->drop();
    return false;
  };
  for (int i = 0; i < batch.count; ++i) {
    const BatchedLaunch& l = batch.launches[i];
    cudaKernelNodeParams kp{};
    kp.func = const_cast<void*>(l.func);
    kp.gridDim = l.cfg.gridDim;
    kp.blockDim = l.cfg.blockDim;
    kp.sharedMemBytes = unsigned(l.cfg.dynamicSmemBytes);
    kp.kernelParams = const_cast<void**>(l.params.data());
    if (const cudaError_t e = cudaGraphExecKernelNodeSetParams(found->exec, found->nodes[i], &kp); e != cudaSuccess)
      return refused(e, "cudaGraphExecKernelNodeSetParams, node " + std::to_string(i));
  }
  if (const cudaError_t e = cudaGraphLaunch(found->exec, stream); e != cudaSuccess) return refused(e, "cudaGraphLaunch");
  ++cache.launched;
  return true;
}

}  // namespace

bool begin_launch_batch(cudaStream_t stream) {
  LaunchBatch& batch = thread_batch();
  TORCH_CHECK(!batch.active, "flashopm: internal error: launch batches do not nest");
  if (!graph_launch_enabled().load(std::memory_order_relaxed) || env_is("FLASHOPM_GRAPH_LAUNCH", "0")) return false;
  // Under stream capture the launches go into the caller's graph as they are.
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (status != cudaStreamCaptureStatusNone) return false;
  batch.active = true;
  batch.count = 0;
  batch.used = 0;
  return true;
}

void end_launch_batch(cudaStream_t stream) {
  LaunchBatch& batch = thread_batch();
  if (!batch.active) return;
  batch.active = false;
  // The thread's batch is empty again however this ends (a launch error throws).
  struct Reset {
    LaunchBatch& batch;
    ~Reset() { batch.count = 0; }
  } reset{batch};
  if (batch.count == 0 || launch_batch_graph(batch, stream)) return;
  for (int i = 0; i < batch.count; ++i) C10_CUDA_CHECK(send_launch(batch.launches[i], stream));
}

void abandon_launch_batch() {
  LaunchBatch& batch = thread_batch();
  batch.active = false;
  batch.count = 0;
}

bool graph_launch() { return graph_launch_enabled().load(); }
GraphLaunchCounts graph_launch_counts() {
  GraphCache& cache = graph_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  return {cache.built, cache.launched, cache.failed, cache.failure};
}
bool set_graph_launch(bool enabled) { return graph_launch_enabled().exchange(enabled); }

bool driver_launch() { return driver_launch_enabled().load(); }
bool set_driver_launch(bool enabled) { return driver_launch_enabled().exchange(enabled); }

void launch_convert(const ConvertArgs& args, cudaStream_t stream) {
  const int64_t blocks = per_tensor_blocks(args, 256, 1024);
  if (blocks == 0) return;
  launch_kernel<opm_convert_kernel>(dim3(unsigned(blocks), unsigned(args.count)), 256, 0, stream, args);
}

void launch_block_w16(const void* w, void* w_blocked, int64_t D, int H, cudaStream_t stream) {
  const int64_t pieces = D * H * H / 8;
  if (pieces == 0) return;
  launch_kernel<opm_block_w16_kernel>(unsigned((pieces + 255) / 256), 256, 0, stream, static_cast<const uint4*>(w),
                                      static_cast<uint4*>(w_blocked), pieces, H);
}

void launch_grad_scale(const GradScaleArgs& args, int blocks, cudaStream_t stream) {
  launch_kernel<opm_grad_scale_kernel<false>>(unsigned(blocks), kGradScaleThreads, 0, stream, args);
}

void launch_grad_scale_side_split(const GradScaleArgs& args, int blocks, cudaStream_t stream) {
  TORCH_CHECK(grad_scale_side_split_fits(args) && args.side_inv != nullptr,
              "flashopm: internal error: g split for the side kernels where its chunks are not whole");
  launch_kernel<opm_grad_scale_kernel<true>>(unsigned(blocks), kGradScaleThreads, 0, stream, args);
}

void launch_bias_grad_reduce(const double* part, int blocks, int D, float* bias, cudaStream_t stream) {
  launch_kernel<opm_bias_grad_reduce_kernel>(unsigned((D + kGradScaleThreads - 1) / kGradScaleThreads),
                                             kGradScaleThreads, 0, stream, part, blocks, D, bias);
}

void launch_sum_parts(const SumPartsArgs& args, cudaStream_t stream) {
  // a thread per four elements where they go as vectors (the others grid-stride over the same blocks)
  const int64_t blocks = (per_tensor_blocks(args, kSumPartsThreads, 8192) + 3) / 4;
  if (blocks == 0) return;
  launch_kernel<opm_sum_parts_kernel>(dim3(unsigned(blocks), unsigned(args.count)), kSumPartsThreads, 0, stream, args);
}

void launch_transpose_hh(const float* x, float* y, int H, int64_t D, int sm_count, cudaStream_t stream) {
  const int64_t n = D * H * H;
  if (n == 0) return;
  const int64_t blocks = std::min<int64_t>((n + kSumPartsThreads - 1) / kSumPartsThreads, int64_t(sm_count) * 8);
  launch_kernel<opm_transpose_hh_kernel>(unsigned(blocks), kSumPartsThreads, 0, stream, x, y, H, n);
}

void launch_swap_middle(const SwapMiddleArgs& args, int sm_count, cudaStream_t stream) {
  if (args.total == 0) return;
  const int64_t per_block = int64_t(kSwapThreads) * kSwapPieces;
  const int64_t blocks = std::min<int64_t>((args.total + per_block - 1) / per_block, int64_t(sm_count) * 16);
  if (args.total <= int64_t(UINT32_MAX) - per_block)
    launch_kernel<opm_swap_middle_kernel<uint32_t>>(unsigned(blocks), kSwapThreads, 0, stream, args);
  else
    launch_kernel<opm_swap_middle_kernel<int64_t>>(unsigned(blocks), kSwapThreads, 0, stream, args);
}

}  // namespace flashopm
