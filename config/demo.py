"""Tiny from-scratch model on CPU, end to end in minutes: python train.py config/demo.py
(data/demo/ is written by data/make_demo.py)."""
init_from = "scratch"
n_layer = 2
n_head = 2
n_embd = 64
block_size = 128
dropout = 0.0
train_csv = "data/demo/train.csv"
validation_csv = "data/demo/validation.csv"
test_csv = "data/demo/test.csv"
sample_submission_csv = "data/demo/sample_submission.csv"
out_dir = "out-demo"
batch_size = 32
micro_batch_size = 32
max_iters = 200
eval_interval = 100
log_interval = 10
learning_rate = 1e-2
min_lr = 1e-3
warmup_iters = 10
weight_decay = 0.0
rouge_samples = 32
max_new_tokens = 32
gen_batch_size = 50
device = "cpu"
evaluate_after = True
predict_after = True
