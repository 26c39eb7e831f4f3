/*
 * What program_launcher.c knows of a shipped program's kernels: one fqla_kernel
 * each, in the table FQLA_KERNELS that scripts/export_programs.py generates from
 * TVM's serialised CUDA module, beside the embedded cubin fqla_cubin.
 */
#ifndef FQLA_PROGRAM_LAUNCHER_H_
#define FQLA_PROGRAM_LAUNCHER_H_

#include <stddef.h>

#include <cuda.h>

/* How one kernel argument reaches cuLaunchKernel (TVM's pack_args.h conversions). */
enum fqla_arg {
  FQLA_ARG_ADDRESS = 0, /* int64, float64, pointer: the address of the value itself */
  FQLA_ARG_INT32 = 1,   /* an int64 narrowed to int32 */
  FQLA_ARG_UINT32 = 2,  /* an int64 narrowed to uint32 */
  FQLA_ARG_FLOAT32 = 3, /* a float64 narrowed to float32 */
  FQLA_ARG_BY_VALUE = 4 /* a __grid_constant__ CUtensorMap: the pointer to the host copy */
};

#define FQLA_MAX_ARGS 64
#define FQLA_MAX_LAUNCH 6
#define FQLA_MAX_DEVICES 64

typedef struct {
  const char* name;
  int num_args;
  unsigned char args[FQLA_MAX_ARGS]; /* enum fqla_arg */
  /* Launch values after the arguments, each setting one extent: grid x/y/z are 0-2, block x/y/z 3-5. */
  int num_launch;
  unsigned char launch[FQLA_MAX_LAUNCH];
  int dynamic_shared_memory; /* a last launch value gives its size in bytes */
  /* filled at run time, per device */
  CUfunction function[FQLA_MAX_DEVICES];
  size_t shared_bytes[FQLA_MAX_DEVICES];
} fqla_kernel;

extern fqla_kernel FQLA_KERNELS[];
extern const int FQLA_NUM_KERNELS;
extern const unsigned char fqla_cubin[];

#endif /* FQLA_PROGRAM_LAUNCHER_H_ */
