/*
 * The runtime half of a shipped TileLang program (scripts/export_programs.py).
 *
 * TileLang's host code for a program (validation of every tensor argument, the
 * grid and TMA descriptor arithmetic) is plain C.  It asks its environment for
 * three kinds of functions by name, through TVMBackendGetFuncFromEnv, which
 * TileLang's own runtime library provides:
 *
 *   __tvm_set_device(device_type, device_id)
 *   __tvm_tensormap_create_tiled(map, dtype, rank, address, dims[r], strides[r],
 *                                box[r], element_strides[r], interleave, swizzle,
 *                                l2_promotion, oob_fill)
 *   <kernel>(kernel arguments..., launch values...)
 *
 * The export compiles that host code with TVMBackendGetFuncFromEnv renamed to
 * fqla_get_func, defined here, so a shipped program needs neither TileLang nor
 * nvcc: only apache-tvm-ffi's C ABI (the host code's calling convention, and the
 * stream torch hands it) and the CUDA driver, opened with dlopen at first use.
 * Nothing is registered globally, so TileLang can still be imported beside it.
 *
 * The export's generated part of each program defines FQLA_KERNELS and the
 * embedded cubin (program_launcher.h).  A launch
 * does what TileLang's CUDA runtime does for these programs: the module loaded
 * once per device, the dynamic shared memory attribute set when its size
 * changes, cuLaunchKernel on the caller's current stream.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include "program_launcher.h"

/* Bind to the oldest versions of these glibc symbols (x86-64's baseline, 2.2.5): built on a new glibc, the
 * library would otherwise ask for dlopen@GLIBC_2.34 and not load on an older system. */
#if defined(__x86_64__) && defined(__GLIBC__)
__asm__(".symver dlopen,dlopen@GLIBC_2.2.5");
__asm__(".symver dlsym,dlsym@GLIBC_2.2.5");
__asm__(".symver pthread_once,pthread_once@GLIBC_2.2.5");
#endif

/* ---- the CUDA driver, opened on first use ---- */

static struct {
  CUresult (*init)(unsigned int);
  CUresult (*get_error_name)(CUresult, const char**);
  CUresult (*device_get)(CUdevice*, int);
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice);
  CUresult (*ctx_get_current)(CUcontext*);
  CUresult (*ctx_set_current)(CUcontext);
  CUresult (*ctx_get_device)(CUdevice*);
  CUresult (*module_load_data)(CUmodule*, const void*);
  CUresult (*module_get_function)(CUfunction*, CUmodule, const char*);
  CUresult (*func_set_attribute)(CUfunction, CUfunction_attribute, int);
  CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            unsigned, CUstream, void**, void**);
  CUresult (*tensor_map_encode_tiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                      const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                      const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                      CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  const char* error;
} driver;

static pthread_once_t driver_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t module_lock = PTHREAD_MUTEX_INITIALIZER;
static CUmodule modules[FQLA_MAX_DEVICES];
static __thread int current_device = -1;

static void open_driver(void) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    driver.error = "the CUDA driver (libcuda.so.1) could not be opened";
    return;
  }
#define FQLA_SYMBOL(field, name)                                   \
  if ((*(void**)&driver.field = dlsym(lib, name)) == NULL) {        \
    driver.error = "the CUDA driver has no " name " (CUDA 12 or newer is needed)"; \
    return;                                                        \
  }
  FQLA_SYMBOL(init, "cuInit")
  FQLA_SYMBOL(get_error_name, "cuGetErrorName")
  FQLA_SYMBOL(device_get, "cuDeviceGet")
  FQLA_SYMBOL(primary_ctx_retain, "cuDevicePrimaryCtxRetain")
  FQLA_SYMBOL(ctx_get_current, "cuCtxGetCurrent")
  FQLA_SYMBOL(ctx_set_current, "cuCtxSetCurrent")
  FQLA_SYMBOL(ctx_get_device, "cuCtxGetDevice")
  FQLA_SYMBOL(module_load_data, "cuModuleLoadData")
  FQLA_SYMBOL(module_get_function, "cuModuleGetFunction")
  FQLA_SYMBOL(func_set_attribute, "cuFuncSetAttribute")
  FQLA_SYMBOL(launch_kernel, "cuLaunchKernel")
  FQLA_SYMBOL(tensor_map_encode_tiled, "cuTensorMapEncodeTiled")
#undef FQLA_SYMBOL
  if (driver.init(0) != CUDA_SUCCESS) driver.error = "cuInit failed: no usable CUDA device";
}

static int raise_error(const char* message) {
  TVMFFIErrorSetRaisedFromCStr("RuntimeError", message);
  return -1;
}

static int check(CUresult result, const char* what, const char* kernel) {
  if (result == CUDA_SUCCESS) return 0;
  const char* name = "unknown error";
  driver.get_error_name(result, &name);
  char message[256];
  snprintf(message, sizeof message, "flash-qla: %s failed for %s: %s (%d)", what, kernel, name, (int)result);
  return raise_error(message);
}

static int driver_ready(void) {
  pthread_once(&driver_once, open_driver);
  return driver.error == NULL ? 0 : raise_error(driver.error);
}

/* ---- __tvm_set_device: the device's primary context current on this thread, as cudaSetDevice ---- */

static int set_device(void* self, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result) {
  (void)self;
  (void)result;
  if (driver_ready() != 0) return -1;
  if (num_args != 2 || args[1].v_int64 < 0 || args[1].v_int64 >= FQLA_MAX_DEVICES)
    return raise_error("flash-qla: __tvm_set_device takes (device_type, device_id < 64)");
  int device_id = (int)args[1].v_int64;
  CUcontext context = NULL;
  CUdevice device = -1;
  if (check(driver.ctx_get_current(&context), "cuCtxGetCurrent", "set_device") != 0) return -1;
  if (context != NULL && driver.ctx_get_device(&device) != CUDA_SUCCESS) device = -1;
  if (context == NULL || device != device_id) {
    CUdevice wanted;
    if (check(driver.device_get(&wanted, device_id), "cuDeviceGet", "set_device") != 0 ||
        check(driver.primary_ctx_retain(&context, wanted), "cuDevicePrimaryCtxRetain", "set_device") != 0 ||
        check(driver.ctx_set_current(context), "cuCtxSetCurrent", "set_device") != 0)
      return -1;
  }
  current_device = device_id;
  return 0;
}

/* ---- __tvm_tensormap_create_tiled: one TMA descriptor into the host code's stack ---- */

static int create_tensor_map(void* self, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result) {
  (void)self;
  if (driver_ready() != 0) return -1;
  int rank = num_args >= 8 ? (int)args[2].v_int64 : 0;
  if (rank < 1 || rank > 5 || num_args != 8 + 4 * rank)
    return raise_error("flash-qla: __tvm_tensormap_create_tiled got a malformed argument list");
  cuuint64_t dims[5], strides[5];
  cuuint32_t box[5], element_strides[5];
  const TVMFFIAny* a = args + 4;
  for (int i = 0; i < rank; ++i) dims[i] = (cuuint64_t)a[i].v_int64;
  for (int i = 0; i < rank; ++i) strides[i] = (cuuint64_t)a[rank + i].v_int64;
  for (int i = 0; i < rank; ++i) box[i] = (cuuint32_t)a[2 * rank + i].v_int64;
  for (int i = 0; i < rank; ++i) element_strides[i] = (cuuint32_t)a[3 * rank + i].v_int64;
  const TVMFFIAny* tail = a + 4 * rank;
  /* strides[0] is the element size: the driver takes the rank - 1 outer strides in bytes */
  CUresult status = driver.tensor_map_encode_tiled(
      (CUtensorMap*)args[0].v_ptr, (CUtensorMapDataType)args[1].v_int64, (cuuint32_t)rank, args[3].v_ptr,
      dims, strides + 1, box, element_strides, (CUtensorMapInterleave)tail[0].v_int64,
      (CUtensorMapSwizzle)tail[1].v_int64, (CUtensorMapL2promotion)tail[2].v_int64,
      (CUtensorMapFloatOOBfill)tail[3].v_int64);
  if (check(status, "cuTensorMapEncodeTiled", "a TMA descriptor") != 0) return -1;
  result->type_index = kTVMFFIInt;
  result->v_int64 = 0;
  return 0;
}

/* ---- a kernel launch ---- */

static int load_function(fqla_kernel* kernel, int device) {
  int status = 0;
  pthread_mutex_lock(&module_lock);
  if (modules[device] == NULL)
    status = check(driver.module_load_data(&modules[device], fqla_cubin), "cuModuleLoadData", kernel->name);
  if (status == 0 && kernel->function[device] == NULL)
    status = check(driver.module_get_function(&kernel->function[device], modules[device], kernel->name),
                   "cuModuleGetFunction", kernel->name);
  pthread_mutex_unlock(&module_lock);
  return status;
}

static int launch(void* self, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result) {
  (void)result;
  fqla_kernel* kernel = (fqla_kernel*)self;
  if (num_args != kernel->num_args + kernel->num_launch + kernel->dynamic_shared_memory)
    return raise_error("flash-qla: a shipped kernel was called with the wrong number of arguments");
  int device = current_device;
  if (device < 0) return raise_error("flash-qla: a shipped kernel was launched before __tvm_set_device");
  if (kernel->function[device] == NULL && load_function(kernel, device) != 0) return -1;

  void* addresses[FQLA_MAX_ARGS];
  union { int32_t i; uint32_t u; float f; } narrowed[FQLA_MAX_ARGS];
  for (int i = 0; i < kernel->num_args; ++i) {
    switch (kernel->args[i]) {
      case FQLA_ARG_INT32: narrowed[i].i = (int32_t)args[i].v_int64; addresses[i] = &narrowed[i]; break;
      case FQLA_ARG_UINT32: narrowed[i].u = (uint32_t)args[i].v_int64; addresses[i] = &narrowed[i]; break;
      case FQLA_ARG_FLOAT32: narrowed[i].f = (float)args[i].v_float64; addresses[i] = &narrowed[i]; break;
      case FQLA_ARG_BY_VALUE: addresses[i] = args[i].v_ptr; break;
      default: addresses[i] = (void*)&args[i].v_int64; break;
    }
  }
  size_t extent[6] = {1, 1, 1, 1, 1, 1};
  const TVMFFIAny* values = args + kernel->num_args;
  for (int i = 0; i < kernel->num_launch; ++i) extent[kernel->launch[i]] = (size_t)values[i].v_int64;
  size_t shared = kernel->dynamic_shared_memory ? (size_t)values[kernel->num_launch].v_int64 : 0;
  if (extent[0] == 0 || extent[1] == 0 || extent[2] == 0) {
    char message[256];
    snprintf(message, sizeof message, "flash-qla: %s launched with an empty grid (%zu, %zu, %zu)", kernel->name,
             extent[0], extent[1], extent[2]);
    return raise_error(message);
  }
  CUfunction function = kernel->function[device];
  if (shared > 0 && kernel->shared_bytes[device] != shared) {
    if (check(driver.func_set_attribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)shared),
              "cuFuncSetAttribute", kernel->name) != 0)
      return -1;
    kernel->shared_bytes[device] = shared;
  }
  CUstream stream = (CUstream)TVMFFIEnvGetStream(kDLCUDA, device);
  return check(driver.launch_kernel(function, (unsigned)extent[0], (unsigned)extent[1], (unsigned)extent[2],
                                    (unsigned)extent[3], (unsigned)extent[4], (unsigned)extent[5],
                                    (unsigned)shared, stream, addresses, NULL),
               "cuLaunchKernel", kernel->name);
}

/* ---- the host code's lookup (TVMBackendGetFuncFromEnv, renamed by the export) ---- */

int fqla_get_func(void* library, const char* name, TVMFFIObjectHandle* out) {
  (void)library;
  if (strcmp(name, "__tvm_set_device") == 0) return TVMFFIFunctionCreate(NULL, set_device, NULL, out);
  if (strcmp(name, "__tvm_tensormap_create_tiled") == 0)
    return TVMFFIFunctionCreate(NULL, create_tensor_map, NULL, out);
  for (int i = 0; i < FQLA_NUM_KERNELS; ++i)
    if (strcmp(name, FQLA_KERNELS[i].name) == 0) return TVMFFIFunctionCreate(&FQLA_KERNELS[i], launch, NULL, out);
  char message[256];
  snprintf(message, sizeof message, "flash-qla: a shipped program asked for an unknown function %s", name);
  return raise_error(message);
}
