"""bench.py: the variant table and its selection, the round-robin order, the plain GPT's size
against hand-counted parameters, the JSON rows of a tiny run, and the CUDA suite's plan on CPU.
Nothing here asserts a speed: the targets are in the benchmark's output."""
import json
import re
import statistics
import warnings
from dataclasses import replace

import pytest
import torch

import bench
from model import GPT, SIZES, GPTConfig
from report import cpu_name

ROW_FIELDS = {"variant", "about", "params", "active_params", "flops_per_token", "batch", "seq_len", "dtype",
              "compile", "first_step_s", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "ms_per_step",
              "mfu", "of_matmul_rate", "ratio_to", "ratio", "paired_ratio", "samples_tokens_per_s", "fsdp"}


def by_name(variants):
    return {v.full_name: v for v in variants}


# --- the variant table ------------------------------------------------------------------------

@pytest.mark.parametrize("suite", sorted(bench.SUITES))
def test_each_group_starts_with_the_plain_gpt_and_names_are_unique(suite):
    variants = bench.SUITES[suite].variants()
    names = [v.full_name for v in variants]
    assert len(names) == len(set(names))
    for group, members in bench.groups_of(variants):
        assert members[0].reference and members[0].name == "reference", group.name


@pytest.mark.parametrize("suite, default_backend, other_backend",
                         [("cpu", "sdpa", "eager"), ("cuda", "flex", "sdpa")])
def test_variants_change_what_their_names_say(suite, default_backend, other_backend):
    variants = bench.SUITES[suite].variants()
    group = variants[0].group.name
    v = by_name(variants)
    cfg = {name: v[f"{group}/{name}"].gpt_config() for name in
           ("default", "gate-headwise", "gate-none", "gelu", f"attn-{other_backend}", "moe-grouped", "moe-reference")}
    assert (cfg["default"].attn_gate, cfg["default"].mlp, cfg["default"].attn_backend) == \
        ("elementwise", "swiglu", default_backend)
    assert cfg["gate-headwise"].attn_gate == "headwise" and cfg["gate-none"].attn_gate == "none"
    assert cfg["gelu"].mlp == "gelu" and cfg[f"attn-{other_backend}"].attn_backend == other_backend
    assert (cfg["moe-grouped"].moe_impl, cfg["moe-reference"].moe_impl) == ("grouped", "reference")
    # Equal active size: top-2 of experts half the dense MLP's width.
    assert cfg["moe-grouped"].top_k * cfg["moe-grouped"].d_expert == cfg["default"].d_ff
    assert v[f"{group}/gamma-0.5"].gamma == 0.5 and v[f"{group}/default"].gamma == 1.0
    assert v[f"{group}/gamma-0.5"].gpt_config() == cfg["default"]
    compiled = {(x.name, x.compile) for x in variants if x.group.name == group and not x.reference}
    assert ("default", True) in compiled or ("default-compiled", True) in compiled
    assert any(not c for _, c in compiled)  # and an eager one to compare with


def test_cuda_suite_is_the_two_sizes_in_bf16_on_flex():
    variants = bench.cuda_variants()
    groups = {g.name: g for g, _ in bench.groups_of(variants)}
    assert sorted(groups) == ["0.1b", "1.5b"]
    for name, g in groups.items():
        assert g.dtype == "bfloat16" and g.seq_len == 2048
        cfg = GPTConfig(**g.config)
        assert (cfg.n_layer, cfg.d_model) == (SIZES[name]["n_layer"], SIZES[name]["d_model"])
    assert by_name(variants)["1.5b/default"].compile and by_name(variants)["0.1b/moe-grouped"].compile


def test_selection_by_name_pattern_and_group():
    variants = bench.cuda_variants()
    assert [v.full_name for v in bench.select(variants, "default")] == ["0.1b/default", "1.5b/default"]
    assert [v.full_name for v in bench.select(variants, "1.5b/*")] == ["1.5b/reference", "1.5b/default"]
    # The patterns' order (the first selected is the yardstick), each pattern's matches in suite order; a name
    # matched twice is kept once.
    assert [v.full_name for v in bench.select(variants, "gate-none,0.1b/reference,gate-*")] == \
        ["0.1b/gate-none", "0.1b/reference", "0.1b/gate-headwise"]
    assert bench.select(variants, "") == variants
    with pytest.raises(ValueError, match="'gate-typo' matches no variant"):
        bench.select(variants, "default,gate-typo")


# --- the order of the timings -----------------------------------------------------------------

def test_schedule_is_round_robin_within_each_group():
    variants = bench.cuda_variants()
    small = [v for v in variants if v.group.name == "0.1b"]
    large = [v for v in variants if v.group.name == "1.5b"]
    order = bench.schedule(variants, repeats=3)
    # Written out by hand: the whole 0.1b group once per repeat, in table order, then 1.5b.
    expected = [(r, v) for r in range(3) for v in small] + [(r, v) for r in range(3) for v in large]
    assert [(r, v.full_name) for r, v in order] == [(r, v.full_name) for r, v in expected]
    # Never the same variant twice in a row (two or more variants in a group).
    names = [v.full_name for _, v in order]
    assert all(a != b for a, b in zip(names, names[1:]))


# --- the yardstick ----------------------------------------------------------------------------

def hand_count_default(cfg):
    """model.GPT's parameters at the default settings (MHA, elementwise gate, SwiGLU, untied)."""
    d, L, V, f = cfg.d_model, cfg.n_layer, cfg.vocab_size, cfg.d_ff
    attention = 4 * d * d + d * d          # q, k, v, o + the elementwise gate
    mlp = 3 * d * f                        # SwiGLU: gate, up, down
    return 2 * V * d + L * (attention + mlp + 2 * d) + d  # embeddings, blocks with two RMSNorms, final norm


def hand_count_plain(cfg, d_ff, T):
    d, L, V = cfg.d_model, cfg.n_layer, cfg.vocab_size
    block = 3 * d * d + d * d + 2 * d * d_ff + 2 * 2 * d   # qkv, proj, up/down, two LayerNorms (w+b)
    return V * d + T * d + L * block + 2 * d + V * d


@pytest.mark.parametrize("suite", sorted(bench.SUITES))
def test_plain_gpt_has_the_size_of_the_default_model(suite):
    for group, members in bench.groups_of(bench.SUITES[suite].variants()):
        ref = members[0]
        cfg = ref.gpt_config()
        d_ff = bench.plain_d_ff(cfg, group.seq_len)
        with torch.device("meta"):
            plain = bench.make_model(ref)
            default = GPT(cfg)
        assert plain.num_params()["total"] == hand_count_plain(cfg, d_ff, group.seq_len)
        assert default.num_params()["total"] == hand_count_default(cfg)
        # Within 1%: d_ff is rounded to a multiple of 64, a step of 2 * 64 * d per block.
        assert abs(hand_count_plain(cfg, d_ff, group.seq_len) / hand_count_default(cfg) - 1) < 0.01, group.name
        assert d_ff % 64 == 0
        # FLOPs by GPT.flops_per_token's convention, by hand: every Linear (qkv, proj, up, down,
        # lm_head) at 6 FLOPs per weight, plus 12 * L * d * T.
        d, L = cfg.d_model, cfg.n_layer
        linear = L * (4 * d * d + 2 * d * d_ff) + d * cfg.vocab_size
        assert plain.flops_per_token(group.seq_len) == 6 * linear + 12 * L * d * group.seq_len


def test_plain_gpt_is_a_causal_language_model():
    v = bench.cpu_variants()[0]
    v = replace(v, group=replace(v.group, config=dict(vocab_size=50, n_layer=2, n_head=2, d_model=32), seq_len=12))
    model = bench.build(v, torch.device("cpu")).eval()
    idx = torch.randint(50, (2, 12), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[:, 7] = (idx[:, 7] + 1) % 50
    (logits, _), (_, loss) = model(idx), model(idx, idx)
    logits2, _ = model(changed)
    assert torch.equal(logits[:, :7], logits2[:, :7])            # the past does not see the future
    assert not torch.allclose(logits[:, 7:], logits2[:, 7:])     # the token and later ones do
    by_hand = -torch.log_softmax(logits.double(), -1).gather(-1, idx[..., None]).mean()
    assert torch.allclose(loss.double(), by_hand, rtol=1e-5)


# --- running ----------------------------------------------------------------------------------

TINY = ["--batch", "2", "--seq-len", "16", "--steps", "2", "--repeats", "2", "--warmup", "1"]


def test_the_plain_gpt_starts_at_its_usual_scale_without_an_eps_warning():
    # Every plain-GPT variant is initialised at γ=0.5: under γ=1 its LayerNorms' ε=1e-5 would
    # dominate the stream (r = ε·d^2γ: 0.66 at d 256, 42 at d 2048; at γ=0.5, 0.0026 and 0.02),
    # and init.py's ε audit would warn. 5m/reference-compiled and 1.5b/reference were at γ=1.
    plain = [v for v in bench.cpu_variants() + bench.cuda_variants() if v.reference]
    assert {v.full_name for v in plain} >= {"5m/reference", "5m/reference-compiled", "0.1b/reference", "1.5b/reference"}
    assert all(v.gamma == 0.5 for v in plain), [v.full_name for v in plain if v.gamma != 0.5]
    for v in plain:
        if v.group.name == "5m":  # the CUDA sizes are too large to build here; their γ is the same
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="gamma_init_")  # init.py's warnings, not torch's own
                bench.build(v, torch.device("cpu"))


def check_rows(path, names, extra=frozenset()):
    out = json.loads(path.read_text())
    assert (out["suite"], out["device"], out["cpu"]) == ("cpu", "cpu", cpu_name()) and out["steps"] == 2 and out["repeats"] == 2 and out["matmul_rate_n"] == 1024
    assert out["datasheet_peak_flops"] is None  # a CPU has none: no MFU (mfu.py)
    rows = out["rows"]
    assert [r["variant"] for r in rows] == names
    first = rows[0]["tokens_per_s"]
    for r in rows:
        assert set(r) == ROW_FIELDS | extra
        assert len(r["samples_tokens_per_s"]) == 2 and (r["batch"], r["seq_len"]) == (2, 16)
        samples = sorted(r["samples_tokens_per_s"])
        assert r["tokens_per_s"] == pytest.approx(statistics.median(samples))
        assert (r["tokens_per_s_min"], r["tokens_per_s_max"]) == (samples[0], samples[-1])
        assert r["ms_per_step"] == pytest.approx(1e3 * 32 / r["tokens_per_s"])
        assert r["ratio"] == pytest.approx(r["tokens_per_s"] / first)
        # tok/s of repeat i over the first variant's in the same repeat, the median of the two
        pair = [a / b for a, b in zip(r["samples_tokens_per_s"], rows[0]["samples_tokens_per_s"])]
        assert r["paired_ratio"] == pytest.approx((pair[0] + pair[1]) / 2)
        assert r["mfu"] is None and r["ratio_to"] == names[0]
        assert r["of_matmul_rate"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / out["matmul_rate_flops"])
        v = bench.select(bench.cpu_variants(), r["variant"])[0]
        v = replace(v, group=replace(v.group, batch=2, seq_len=16))
        if v.reference:
            cfg = v.gpt_config()
            n = hand_count_plain(cfg, bench.plain_d_ff(cfg, 16), 16)
            assert (r["params"], r["active_params"]) == (n, n)
        else:
            with torch.device("meta"):
                counts = GPT(v.gpt_config()).num_params()
            assert (r["params"], r["active_params"]) == (counts["total"], counts["active"])
    return rows


def test_tiny_cpu_run_writes_json_rows(tmp_path, capsys):
    names = ["5m/reference", "5m/default", "5m/gate-none", "5m/gamma-0.5", "5m/moe-grouped", "5m/moe-reference"]
    bench.main(["--variants", "reference,default,gate-none,gamma-0.5,moe-*", *TINY, "--json-out", str(tmp_path / "b.json")])
    rows = check_rows(tmp_path / "b.json", names)
    by = {r["variant"]: r for r in rows}
    # MoE: four times the dense MLP's weights, the dense model's active parameters and FLOPs.
    assert by["5m/moe-grouped"]["active_params"] < by["5m/moe-grouped"]["params"]
    assert by["5m/gate-none"]["params"] < by["5m/default"]["params"]
    printed = capsys.readouterr().out
    assert all(re.search(rf"^{re.escape(n)}\s", printed, flags=re.M) for n in names)


def test_a_failing_variant_is_a_row_and_every_finished_row_is_kept(tmp_path, monkeypatch, capsys):
    # A variant that cannot run here (varlen's flash kernels are CUDA only: a real failure, in its
    # first step) between two that can, and a group after it: the others are measured and written.
    v = by_name(bench.cpu_variants())
    later = replace(v["5m/gate-none"], group=replace(v["5m/gate-none"].group, name="later"))
    variants = [v["5m/reference"], replace(v["5m/default"], name="varlen", model={"attn_backend": "varlen"}),
                v["5m/default"], later]
    monkeypatch.setitem(bench.SUITES, "cpu", replace(bench.SUITES["cpu"], variants=lambda: variants))
    path = tmp_path / "b.json"
    assert bench.main([*TINY, "--json-out", str(path)]) == 1
    rows = json.loads(path.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["5m/reference", "5m/varlen", "5m/default", "later/gate-none"]
    assert rows[1] == {"variant": "5m/varlen", "about": variants[1].about,
                       "error": rows[1]["error"]} and rows[1]["error"].startswith("ValueError: attn_backend='varlen'")
    assert all(r["tokens_per_s"] > 0 for r in rows if r is not rows[1])
    assert rows[2]["ratio_to"] == "5m/reference" and rows[3]["ratio_to"] == "later/gate-none"
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("bench.py: 1 variant(s) failed: 5m/varlen")
    # Cut short in the second group (a Ctrl-C while its model is built): the first group's rows are on disk.
    path.unlink()
    build = bench.build
    monkeypatch.setattr(bench, "build", lambda x, device: (_ for _ in ()).throw(KeyboardInterrupt) if x.group.name == "later"
                        else build(x, device))
    with pytest.raises(KeyboardInterrupt):
        bench.main([*TINY, "--json-out", str(path)])
    assert [r["variant"] for r in json.loads(path.read_text())["rows"]] == ["5m/reference", "5m/varlen", "5m/default"]


def test_profile_lists_each_variants_costliest_operations(tmp_path, capsys):
    bench.main(["--variants", "reference,default", *TINY, "--profile", "3", "--json-out", str(tmp_path / "b.json")])
    rows = check_rows(tmp_path / "b.json", ["5m/reference", "5m/default"], {"profile"})
    for r in rows:
        ms = [op["ms"] for op in r["profile"]]
        assert len(ms) == 3 and ms == sorted(ms, reverse=True) and ms[0] > 0
        assert "aten::mm" in [op["name"] for op in r["profile"]]  # eager: the GEMMs are the largest cost
        # the profiled step's self times fit inside a timed step's wall time
        assert sum(ms) < r["ms_per_step"] * 1.5
    printed = capsys.readouterr().out
    assert re.search(r"^  5m/default\s+[\d.]+ ms\s+\d+x  aten::mm", printed, flags=re.M), printed


@pytest.mark.slow
def test_compiled_variants_run(tmp_path):
    bench.main(["--variants", "reference-compiled,default-compiled", *TINY, "--json-out", str(tmp_path / "b.json")])
    rows = check_rows(tmp_path / "b.json", ["5m/reference-compiled", "5m/default-compiled"])
    assert all(r["compile"] for r in rows)


def test_cuda_suite_in_bf16_steps_on_cpu_when_shrunk():
    # The CUDA suite's variants on a tiny config, eager and on sdpa (Flex has no CPU backward):
    # the bf16 weights, MoE on bf16 grouped GEMMs and the AdamW step all run and train.
    for v in bench.select(bench.cuda_variants(), "0.1b/reference,0.1b/default,0.1b/moe-*"):
        g = replace(v.group, config=dict(vocab_size=64, n_layer=1, n_head=2, d_model=64, attn_backend="sdpa"),
                    batch=2, seq_len=16)
        runner = bench.Runner(replace(v, group=g, compile=False), torch.device("cpu"))
        before = [p.detach().clone() for p in runner.model.parameters()]
        runner.step()
        assert all(p.dtype == torch.bfloat16 for p in runner.model.parameters())
        assert any(not torch.equal(a, p) for a, p in zip(before, runner.model.parameters())), v.full_name


def test_cuda_dry_run_on_cpu_prints_the_plan_within_eight_minutes(capsys):
    bench.main(["--suite", "cuda", "--dry-run"])
    out = capsys.readouterr().out
    for v in bench.cuda_variants():
        assert re.search(rf"^\s+{re.escape(v.full_name)}\s", out, flags=re.M), v.full_name
    assert "group 0.1b: batch 16 x seq_len 2048 = 32,768 tokens/step, bfloat16" in out
    assert "group 1.5b: batch 8 x seq_len 2048 = 16,384 tokens/step, bfloat16" in out
    assert "3 warm-up, then 5 repeats x 10 timed steps" in out
    minutes = float(re.search(r"estimated time: ([\d.]+) min", out).group(1))
    assert minutes <= 8


def test_plan_counts_one_compilation_per_structure():
    suite = bench.SUITES["cuda"]
    v = by_name(bench.cuda_variants())
    one = bench.plan([v["0.1b/default"]], suite, 1, 1, 1, 1e15)[1]
    both = bench.plan([v["0.1b/default"], v["0.1b/gamma-0.5"]], suite, 1, 1, 1, 1e15)[1]
    other = bench.plan([v["0.1b/default"], v["0.1b/gate-none"]], suite, 1, 1, 1, 1e15)[1]
    # γ=0.5 is the same graph: only its init and steps are added, no second compilation.
    assert both - one == pytest.approx(one - suite.compile_s)
    assert other - one > suite.compile_s


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_suite_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="needs a CUDA GPU.*--dry-run"):
        bench.main(["--suite", "cuda"])


def test_the_train_step_variant_is_train_pys_model_and_step():
    # train.build_model's model (FSDP2 per block and at the root, fp32 parameters on CPU), with the
    # same γ-init as the default variant: the same loss on the same batch, and after one AdamW
    # step the same weights within fp32 rounding. The one-rank group is gone afterwards.
    v = {x.name: x for x in bench.cpu_variants()}
    g = bench.Group("t", dict(vocab_size=64, n_layer=2, n_head=2, d_model=64), batch=2, seq_len=16, dtype="float32")
    with bench.one_rank(torch.device("cpu"), True):
        default, step = (bench.Runner(replace(v[name], group=g, compile=False), torch.device("cpu"))
                         for name in ("default-compiled", "train-step-compiled"))
        assert not hasattr(default.model.layers[0].attn.wq.weight, "full_tensor")
        sharded = [p for p in step.model.parameters()]
        assert all(hasattr(p, "full_tensor") and p.dtype == torch.float32 for p in sharded)
        assert type(step.model.layers[0]).__name__.startswith("FSDP")
        losses = [r.model(r.idx, r.targets)[1] for r in (default, step)]
        assert torch.allclose(losses[0], losses[1], rtol=1e-6, atol=0)
        for r in (default, step):
            r.step()
        for (name, a), b in zip(default.model.named_parameters(), step.model.parameters(), strict=True):
            assert torch.allclose(a, b.full_tensor(), rtol=0, atol=1e-6 * a.abs().max().item()), name
    assert not torch.distributed.is_initialized()
