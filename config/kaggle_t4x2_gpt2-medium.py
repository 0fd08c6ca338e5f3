"""GPT-2 medium (355M) on Kaggle's 2x T4, full fine-tuning with DDP, one process per GPU:
    torchrun --standalone --nproc_per_node=2 train.py config/kaggle_t4x2_gpt2-medium.py
python -m bench --section=memory (the T4 ledger): at most 12.8 GiB per GPU with gradient checkpointing at 69 rows
(DDP's gradient buckets are the gradients).
dtype and compile are auto: float16 with a GradScaler and torch.compile on a T4, bfloat16 from Ampere on."""
init_from = "gpt2-medium"
out_dir = "out-gpt2-medium"
batch_size = 256
micro_batch_size = "auto"  # the most the memory plan fits on the GPU (the start line says which)
gradient_checkpointing = True
device = "cuda"
nccl_p2p_disable = True
gen_batch_size = 32
