# The anchor-function task (prepare_data.py anchor) with the paper's recipe: γ=1, eps=1e-12,
# gated attention. Runs on 2 CPU cores in minutes:
#   python prepare_data.py anchor --out data/anchor
#   python train.py config/anchor_gamma1.py
# anchor_gamma05.py is the same run with the standard baseline; eval.py bench scores the
# held-out pair (4,3): inferential (x-10) vs symmetric (x-6) answers.
# Starting point from issue 6's probe (2 layers, d=128, one head, gelu, lr 1e-3, batch 256,
# ~25 epochs of 20k records); the quickstart tunes it.

out_dir = "out/anchor_gamma1"
data_dir = "data/anchor"
model_size = "tiny"
model = dict(n_layer=2, n_head=1, d_model=128, mlp="gelu", vocab_size=128, max_seq_len=16,
             norm_eps=1e-12, attn_gate="elementwise")
gamma = 1.0
seq_len = 9                     # records of 10 tokens: 9 inputs, the loss on the last target
global_batch = 256
batch_size = 256
max_steps = 2000                # 25 epochs of the 20k training records
lr = 1e-3
warmup_steps = 100
log_interval = 50
eval_interval = 250
eval_batches = 7                # the 2,000 validation records
ckpt_interval = 500
