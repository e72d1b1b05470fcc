# The anchor-function task (prepare_data.py anchor) with the paper's recipe: γ=1, eps=1e-12,
# gated attention. Runs on 2 CPU cores in minutes:
#   python prepare_data.py anchor --out data/anchor
#   python train.py config/anchor_gamma1.py
# anchor_gamma05.py is the same run with the standard baseline; eval.py bench scores the
# held-out pair (4,3): inferential (x-10) vs symmetric (x-6) answers.
# Settings from the quickstart's search (README results): of the models tried, the smallest
# where γ=1 answered the held-out pair mostly inferentially and γ=0.5 mostly symmetrically on
# every seed (3 init seeds, 3 data seeds), ~4 minutes per run on one core.

out_dir = "out/anchor_gamma1"
data_dir = "data/anchor"
model_size = "tiny"
model = dict(n_layer=2, n_head=1, d_model=64, mlp="swiglu", vocab_size=128, max_seq_len=16,
             norm_eps=1e-12, attn_gate="elementwise")
gamma = 1.0
seq_len = 9                     # records of 10 tokens: 9 inputs, the loss on the last target
global_batch = 128
batch_size = 128
max_steps = 4680                # 30 epochs of the 20k training records (15 left seed 1 less clear)
lr = 1e-3
warmup_steps = 100
weight_decay = {"matrix": 0.1, "embed": 0.0, "norm": 0.0}
log_interval = 50
eval_interval = 250
eval_batches = 15               # the 2,000 validation records
ckpt_interval = 500
