"""GPT-2 XL (1.56B) on Kaggle's 2x T4: LoRA adapters (rank 8 on every attention and MLP projection) with DDP and
gradient checkpointing; best.pt holds the merged weights, so evaluate.py/predict.py need no base model:
    torchrun --standalone --nproc_per_node=2 train.py config/kaggle_t4x2_gpt2-xl.py
python -m bench --section=memory (the T4 ledger): at most 12.6 GiB per GPU (training, 26 rows; the frozen base in
fp16, the ROUGE copy 6.2). Full fine-tuning fits only sharded, at micro-batch 4 (14.0 GiB by the plan before the
ledger):
    ... --lora_rank=0 --learning_rate=2e-4 --min_lr=2e-5 --backend=fsdp --micro_batch_size=4 \
        --rouge_samples=0 --best_metric=val_loss
(ROUGE during training needs a gathered copy of the weights that does not fit next to the shards; score
best.pt with evaluate.py afterwards).
dtype and compile are auto: float16 with a GradScaler and torch.compile on a T4, bfloat16 from Ampere on."""
init_from = "gpt2-xl"
out_dir = "out-gpt2-xl"
lora_rank = 8
lora_alpha = 16.0
learning_rate = 1e-3  # adapters start from zero: a common LoRA starting point, larger than full fine-tuning's
min_lr = 1e-4
batch_size = 256
micro_batch_size = "auto"  # the most the memory plan fits on the GPU (the start line says which)
gradient_checkpointing = True
device = "cuda"
nccl_p2p_disable = True
gen_batch_size = 8
