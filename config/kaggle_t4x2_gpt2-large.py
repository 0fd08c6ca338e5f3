"""GPT-2 large (774M) on Kaggle's 2x T4, full fine-tuning with FSDP (weights, gradients and AdamW state split
across the two GPUs) and gradient checkpointing:
    torchrun --standalone --nproc_per_node=2 train.py config/kaggle_t4x2_gpt2-large.py
python -m bench --section=memory (the T4 ledger): at most 12.9 GiB per GPU (training, with reduce-once, 22 rows);
ckpt.pt and best.pt keep 12.4 GB of Kaggle's 20 GB output quota.
dtype and compile are auto: float16 with a GradScaler and torch.compile on a T4, bfloat16 from Ampere on."""
init_from = "gpt2-large"
out_dir = "out-gpt2-large"
backend = "fsdp"
batch_size = 256
micro_batch_size = "auto"  # the most the memory plan fits on the GPU (the start line says which)
gradient_checkpointing = True
device = "cuda"
nccl_p2p_disable = True
gen_batch_size = 16
