"""A few Trainer steps on a kernelized Qwen3.5 model (tiny configuration, random weights, synthetic data).

Needs `accelerate` (Transformers' Trainer does).  Load the kernel as in
get_kernel_example.py, e.g. on a CPU-only torch:

    python scripts/build_hub.py
    LOCAL_KERNELS=qwen/flash-qla=$PWD/build/torch-cuda HF_HUB_OFFLINE=1 python examples/finetune_trainer.py
"""

import tempfile

import torch
from kernels import get_kernel
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Trainer, TrainingArguments

flash_qla = get_kernel("qwen/flash-qla", version=1)

cuda = torch.cuda.is_available()
config = Qwen3_5TextConfig(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,  # 3 GatedDeltaNet + 1 attention
    num_attention_heads=2, num_key_value_heads=1, head_dim=64,
    linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
    pad_token_id=0,
)
torch.manual_seed(0)
model = Qwen3_5ForCausalLM(config).train()
flash_qla.kernelize_qwen3_5(model)  # mode: Mode.TRAINING, since the model is in training mode


def counting_sequence(seed, length=64):
    """Learnable data: runs of consecutive token ids from a random start."""
    start = torch.randint(1, config.vocab_size, (1,), generator=torch.Generator().manual_seed(seed))
    ids = (start + torch.arange(length)) % (config.vocab_size - 1) + 1
    return {"input_ids": ids, "labels": ids}


dataset = [counting_sequence(seed) for seed in range(64)]
with tempfile.TemporaryDirectory() as output_dir:
    args = TrainingArguments(
        output_dir=output_dir, max_steps=20, per_device_train_batch_size=8, learning_rate=3e-3, warmup_steps=2,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=not cuda, bf16=cuda,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()

losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
print(f"{len(losses)} steps on {'cuda' if cuda else 'cpu'}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
