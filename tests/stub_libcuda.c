/*
 * A stand-in for the CUDA driver (libcuda.so.1) on a machine without a GPU, for
 * tests/test_shipped.py: it answers the calls that a shipped program's launcher
 * makes (scripts/program_launcher.c) and writes each one to a log, one line per
 * call, which stub_log() returns.  Nothing runs on a device.
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void* CUcontext;
typedef void* CUmodule;
typedef void* CUfunction;
typedef void* CUstream;

static char log_text[1 << 16];
static size_t log_length;
static int context_token, module_token, function_token;
static CUcontext current;
static int num_params;

static void record(const char* format, ...) {
  va_list args;
  va_start(args, format);
  log_length += vsnprintf(log_text + log_length, sizeof log_text - log_length, format, args);
  va_end(args);
  if (log_length >= sizeof log_text) log_length = sizeof log_text - 1;
}

const char* stub_log(void) { return log_text; }
void stub_clear(void) { log_length = 0; log_text[0] = 0; }
/* how many parameters the next launches take (the driver would read it from the cubin) */
void stub_expect_params(int count) { num_params = count; }

CUresult cuInit(unsigned int flags) { record("cuInit %u\n", flags); return 0; }
CUresult cuGetErrorName(CUresult error, const char** name) { (void)error; *name = "STUB_ERROR"; return 0; }
CUresult cuDeviceGet(CUdevice* device, int ordinal) { *device = ordinal; return 0; }
CUresult cuDevicePrimaryCtxRetain(CUcontext* context, CUdevice device) {
  record("cuDevicePrimaryCtxRetain %d\n", device);
  *context = &context_token;
  return 0;
}
CUresult cuCtxGetCurrent(CUcontext* context) { *context = current; return 0; }
CUresult cuCtxSetCurrent(CUcontext context) { record("cuCtxSetCurrent\n"); current = context; return 0; }
CUresult cuCtxGetDevice(CUdevice* device) { *device = 0; return 0; }

CUresult cuModuleLoadData(CUmodule* module, const void* image) {
  /* a cubin is an ELF image: its first bytes say so */
  record("cuModuleLoadData elf=%d\n", memcmp(image, "\177ELF", 4) == 0);
  *module = &module_token;
  return 0;
}
CUresult cuModuleGetFunction(CUfunction* function, CUmodule module, const char* name) {
  (void)module;
  record("cuModuleGetFunction %s\n", name);
  *function = &function_token;
  return 0;
}
CUresult cuFuncSetAttribute(CUfunction function, int attribute, int value) {
  (void)function;
  record("cuFuncSetAttribute %d %d\n", attribute, value);
  return 0;
}

CUresult cuLaunchKernel(CUfunction function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, CUstream stream, void** params, void** extra) {
  (void)function;
  (void)extra;
  record("cuLaunchKernel grid=%u,%u,%u block=%u,%u,%u shared=%u stream=%p params=", gx, gy, gz, bx, by, bz,
         shared, stream);
  for (int i = 0; i < num_params; ++i) {
    /* every parameter's first 4 bytes, as hex: enough to tell pointers, sizes and descriptors apart */
    uint32_t word;
    memcpy(&word, params[i], sizeof word);
    record("%s%08x", i ? "," : "", word);
  }
  record("\n");
  return 0;
}

CUresult cuTensorMapEncodeTiled(void* map, int type, uint32_t rank, void* address, const uint64_t* dims,
                                const uint64_t* strides, const uint32_t* box, const uint32_t* element_strides,
                                int interleave, int swizzle, int l2, int oob) {
  record("cuTensorMapEncodeTiled type=%d rank=%u address=%p dims=", type, rank, address);
  for (uint32_t i = 0; i < rank; ++i) record("%s%llu", i ? "," : "", (unsigned long long)dims[i]);
  record(" strides=");
  for (uint32_t i = 0; i + 1 < rank; ++i) record("%s%llu", i ? "," : "", (unsigned long long)strides[i]);
  record(" box=");
  for (uint32_t i = 0; i < rank; ++i) record("%s%u", i ? "," : "", box[i]);
  record(" element_strides=%u interleave=%d swizzle=%d l2=%d oob=%d\n", element_strides[0], interleave, swizzle,
         l2, oob);
  /* a descriptor the test can recognise in the launch's parameters */
  memset(map, 0, 128);
  memcpy(map, &rank, sizeof rank);
  ((unsigned char*)map)[3] = 0xd5;
  return 0;
}
