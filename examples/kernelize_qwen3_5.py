"""Kernelize a Qwen3.5 model with flash-qla: prefill and generate, compared with the unpatched model.

A tiny Qwen3.5 configuration with random weights (nothing is downloaded but
the kernel).  Load the kernel as in get_kernel_example.py, e.g. on a CPU-only torch:

    python scripts/build_hub.py
    LOCAL_KERNELS=qwen/flash-qla=$PWD/build/torch-cuda HF_HUB_OFFLINE=1 python examples/kernelize_qwen3_5.py

Qwen3.6 and the MoE models (Qwen3_5MoeForCausalLM) kernelize the same way.
"""

import torch
from kernels import get_kernel
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

flash_qla = get_kernel("qwen/flash-qla", version=1)

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
config = Qwen3_5TextConfig(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,  # 3 GatedDeltaNet + 1 attention
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128,
    pad_token_id=0,
)
torch.manual_seed(0)
model = Qwen3_5ForCausalLM(config).to(device=device, dtype=dtype).eval()
prompt = torch.randint(1, config.vocab_size, (2, 200), device=device)


def prefill_and_generate():
    with torch.no_grad():
        logits = model(prompt).logits
        tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    return logits.float(), tokens[:, prompt.shape[1]:]


reference_logits, reference_tokens = prefill_and_generate()

flash_qla.kernelize_qwen3_5(model)  # mode: Mode.INFERENCE, since the model is in eval mode
layers = [layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")]
swapped = sum(layer.forward.__func__ is flash_qla.layers.Qwen3_5GatedDeltaNet.forward for layer in layers)
print(f"device {device}, {dtype}: {swapped}/{len(layers)} GatedDeltaNet layers run flash-qla")

logits, tokens = prefill_and_generate()
print(f"prefill logits {tuple(logits.shape)}: largest |difference| vs the unpatched model "
      f"{(logits - reference_logits).abs().max().item():.2e} (largest |logit| {reference_logits.abs().max().item():.2f})")
print(f"generate: {(tokens == reference_tokens).sum().item()}/{tokens.numel()} greedy tokens identical")
