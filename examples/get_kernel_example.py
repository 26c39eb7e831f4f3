"""Load flash-qla with `kernels.get_kernel`, prefill a sequence and decode from its state.

    python scripts/build_hub.py
    # with a CUDA build of torch, a local build stands in for the Hub repository:
    LOCAL_KERNELS=qwen/flash-qla=$PWD HF_HUB_OFFLINE=1 python examples/get_kernel_example.py
    # with a CPU-only torch, name the variant directory itself:
    LOCAL_KERNELS=qwen/flash-qla=$PWD/build/torch-cuda HF_HUB_OFFLINE=1 python examples/get_kernel_example.py

Without LOCAL_KERNELS, `get_kernel` downloads qwen/flash-qla (version 1) from the Hub.
"""

import torch
import torch.nn.functional as F
from kernels import get_kernel

flash_qla = get_kernel("qwen/flash-qla", version=1)

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
# One Qwen3.5-9B GatedDeltaNet layer: 16 q/k heads shared by 32 value heads, head dims 128.
batch, prompt_len, new_tokens, qk_heads, v_heads, head_dim = 1, 4096 if device == "cuda" else 256, 4, 16, 32, 128
length = prompt_len + new_tokens

torch.manual_seed(0)
q = torch.randn(batch, length, qk_heads, head_dim, device=device, dtype=dtype)
k = torch.randn(batch, length, qk_heads, head_dim, device=device, dtype=dtype)
v = torch.randn(batch, length, v_heads, head_dim, device=device, dtype=dtype)
g = F.logsigmoid(torch.randn(batch, length, v_heads, device=device))  # log decay, <= 0
beta = torch.rand(batch, length, v_heads, device=device)
inputs = (q, k, v, g, beta)

# Prefill: the chunked operator returns the outputs and the state after the prompt.
prompt = [x[:, :prompt_len] for x in inputs]
o_prompt, state = flash_qla.chunk_gated_delta_rule(*prompt, output_final_state=True, use_qk_l2norm_in_kernel=True)

# Decoding: one token at a time from the state, with the recurrent operator.
decoded = []
for t in range(prompt_len, length):
    step = [x[:, t:t + 1] for x in inputs]
    o_t, state = flash_qla.fused_recurrent_gated_delta_rule(
        *step, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    decoded.append(o_t)

# The same tokens in one chunked pass agree with prefill + decoding.
o_all, _ = flash_qla.chunk_gated_delta_rule(*inputs, use_qk_l2norm_in_kernel=True)
o_steps = torch.cat([o_prompt] + decoded, dim=1)
print(f"device {device}, {dtype}, o {tuple(o_all.shape)}, final state {tuple(state.shape)} {state.dtype}")
print(f"largest |difference|, prefill + {new_tokens} decoded tokens vs one pass: "
      f"{(o_steps.float() - o_all.float()).abs().max().item():.2e}")
