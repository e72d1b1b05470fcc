# The CPU language-model experiments (README "Results"): a byte-level model on the bilingual
# English + Chinese mixture of the offline kit, the paper's recipe (γ=1, ε=1e-12, elementwise
# gate: the GPTConfig defaults). Include config/_baseline.py after it for the standard arm.
#   python prepare_data.py text --out data/bi_bytes --tokenizer bytes --max-tokens 16M \
#       --source 'en=../shared/data/corpus/en/**/*.txt,weight=0.5' \
#       --source 'zh=../shared/data/corpus/zh/four_classics/*.txt,weight=0.5'
# 2 layers, d_model 64: 131k non-embedding parameters; 320 steps x 8,192 tokens = 2.6M tokens,
# 20 tokens per non-embedding parameter, ~2 minutes on one core.
out_dir = "out/cpu_lm"
data_dir = "data/bi_bytes"
model_size = "tiny"             # 2 layers, d_model 64, 2 heads
model = dict(vocab_size=257, doc_mask=True, eot_id=256, max_seq_len=256)
seq_len = 256
global_batch = 32
batch_size = 32
max_steps = 320
warmup_steps = 32
lr = 3e-3
log_interval = 20
eval_interval = 80
eval_batches = 4
ckpt_interval = 80              # a killed sweep point loses at most 80 steps
keep_last = 1
