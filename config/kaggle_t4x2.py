"""GPT-2 (124M) on Kaggle's 2x T4 (16 GB each, no bfloat16), one process per GPU:
    torchrun --standalone --nproc_per_node=2 train.py config/kaggle_t4x2.py
or from the notebook with Accelerate's notebook_launcher (see train.py).
dtype and compile are auto: float16 with a GradScaler and torch.compile on a T4, bfloat16 from Ampere on."""
init_from = "gpt2"
batch_size = 256
micro_batch_size = "auto"  # the most the memory plan fits on the GPU (the start line says which)
device = "cuda"
nccl_p2p_disable = True
gen_batch_size = 64
