# A real byte-level language model on CPU (~1M parameters, ~8 min on one core):
#   python prepare_data.py text --out data/bytes --source en=<folder of .txt files> --tokenizer bytes
#   python train.py config/tiny_bytes.py
# The paper's recipe (γ=1, eps=1e-12, gated attention: the GPTConfig defaults).

out_dir = "out/tiny_bytes"
data_dir = "data/bytes"
model_size = "small"            # 4 layers, d_model 128, 4 heads, vocab 257 (bytes + end-of-text)
model = dict(doc_mask=True, eot_id=256, max_seq_len=256)
gamma = 1.0
seq_len = 256
global_batch = 32               # 8k tokens per step
batch_size = 32
max_steps = 500                 # 4M tokens: ~7.5 min at ~9.5k tokens/s on one core; tinyshakespeare val loss 1.50
lr = 3e-3                       # small models tolerate (and need) a larger lr
warmup_steps = 100
log_interval = 20
eval_interval = 250
eval_batches = 4
ckpt_interval = 500
