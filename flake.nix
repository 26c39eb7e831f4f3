{
  description = "flash-qla: Gated DeltaNet kernels (TileLang) for the Hugging Face kernel hub";

  # kernel-builder only sees torch-ext/ (and build.toml), so the library must
  # be vendored into torch-ext/flash_qla/ first: build from the tree that
  # `python scripts/build_hub.py --source-tree DIR` writes (it copies this file).
  inputs = {
    kernel-builder.url = "github:huggingface/kernels";
  };

  outputs =
    {
      self,
      kernel-builder,
    }:
    kernel-builder.lib.genKernelFlakeOutputs {
      inherit self;
      path = ./.;
    };
}
