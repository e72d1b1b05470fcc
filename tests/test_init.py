"""init.py: the γ rule on modules it knows, on modules it has never seen, and under FSDP2."""
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

from conftest import failure_text, launch_env
from init import gamma_init_, format_report
from init import init_model_
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_init_py_imports_only_torch_and_stdlib():
    tree = ast.parse(open(os.path.join(ROOT, "init.py")).read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported - {"torch"} <= set(sys.stdlib_module_names), imported


# A model init.py has never seen, run from a folder that holds nothing but a copy of init.py:
# a GPT-2-style transposed Conv1D (weight is (in, out)) declared by class name, a layer with a
# parameter nobody can classify, and ordinary torch layers.
FOREIGN_SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    import torch
    from torch import nn
    import init
    assert init.__file__.startswith(sys.argv[1]), init.__file__

    class Conv1D(nn.Module):
        def __init__(self, n_in, n_out):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(n_in, n_out))
            self.bias = nn.Parameter(torch.full((n_out,), 7.0))

    class Mystery(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.full((300, 3), 5.0))

    net = nn.ModuleDict({
        "emb": nn.Embedding(1000, 256),
        "c_attn": Conv1D(384, 1152),
        "fc": nn.Linear(512, 2048),
        "conv": nn.Conv1d(32, 64, kernel_size=5),
        "ln": nn.LayerNorm(256),
        "mystery": Mystery(),
    })
    nn.init.constant_(net["ln"].weight, 3.0)
    nn.init.constant_(net["ln"].bias, 3.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = init.gamma_init_(net, gamma=float(sys.argv[2]), seed=0, fan_in_dims={"Conv1D": {"weight": 0}})
    params = dict(net.named_parameters())
    print(json.dumps({
        "report": [{k: r[k] for k in ("name", "d_in", "std", "action")} for r in report],
        "empirical_std": {n: p.detach().std().item() for n, p in params.items()},
        "values": {n: [p.detach().min().item(), p.detach().max().item()] for n, p in params.items()},
        "warnings": [str(w.message) for w in caught],
    }))
""")


@pytest.mark.parametrize("gamma", [0.5, 1.0])
def test_copied_init_py_on_a_foreign_model(tmp_path, gamma):
    shutil.copy(os.path.join(ROOT, "init.py"), tmp_path / "init.py")
    (tmp_path / "foreign.py").write_text(FOREIGN_SCRIPT)
    # -E -s: ignore PYTHONPATH and user site, so only the copy beside the script is importable.
    out = subprocess.run([sys.executable, "-E", "-s", "foreign.py", str(tmp_path), str(gamma)],
                         cwd=tmp_path, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    rows = {r["name"]: r for r in result["report"]}
    expected_d_in = {"emb.weight": 256, "c_attn.weight": 384, "fc.weight": 512, "conv.weight": 32 * 5}
    for name, d_in in expected_d_in.items():
        assert rows[name]["action"] == "normal" and rows[name]["d_in"] == d_in, rows[name]
        want = d_in ** -gamma
        assert abs(result["empirical_std"][name] / want - 1) < 0.03, (name, result["empirical_std"][name], want)
    for name in ("c_attn.bias", "fc.bias", "conv.bias", "ln.bias"):
        assert result["values"][name] == [0.0, 0.0]
    assert result["values"]["ln.weight"] == [1.0, 1.0]
    # The unclassifiable parameter is reported, warned about and left exactly as it was.
    assert rows["mystery.scale"]["action"] == "skipped"
    assert result["values"]["mystery.scale"] == [5.0, 5.0]
    assert any("mystery.scale" in w for w in result["warnings"])


def moe_config(**kw):
    return GPTConfig(vocab_size=300, n_layer=2, n_head=2, d_model=128, n_experts=8, top_k=2, d_expert=96, **kw)


def test_experts_use_per_expert_fan_in():
    model = GPT(moe_config())
    report = {r["name"]: r for r in init_model_(model, gamma=1.0)}
    mlp = model.layers[0].mlp
    # Stacked (E, d_in, d_out): fan-in is d_model for gate/up and d_expert for down, never E=8.
    for name, tensor, d_in in (("w_gate", mlp.w_gate, 128), ("w_up", mlp.w_up, 128), ("w_down", mlp.w_down, 96)):
        assert report[f"layers.0.mlp.{name}"]["d_in"] == d_in
        assert abs(tensor.std().item() * d_in - 1) < 0.03
    assert abs(mlp.router.weight.std().item() * 128 - 1) < 0.03


def test_every_gpt_matrix_has_std_d_in_to_minus_gamma():
    model = GPT(GPTConfig(vocab_size=1000, n_layer=2, n_head=4, d_model=256, mlp="gelu"))
    for gamma in (0.5, 1.0, 1.5):
        for r in init_model_(model, gamma=gamma, seed=3):
            p = model.get_parameter(r["name"])
            if r["action"] == "normal":
                # Linear weights are (out, in) and the embedding (vocab, d_model): d_in is dim 1.
                want = p.shape[1] ** -gamma
                assert r["d_in"] == p.shape[1] and r["std"] == pytest.approx(want)
                assert abs(p.std().item() / want - 1) < 0.03, r
            else:
                assert r["action"] == "ones" and torch.all(p == 1), r
    assert model.tok_emb.weight.std().item() == pytest.approx(256 ** -1.5, rel=0.03)


def test_embedding_fan_in_option_and_format_report():
    emb = nn.Embedding(400, 2048)
    report = gamma_init_(emb, gamma=1.0, embedding_fan_in="num_embeddings")
    assert report[0]["d_in"] == 400
    assert emb.weight.std().item() == pytest.approx(1 / 400, rel=0.03)
    header, row = format_report(report).splitlines()
    assert header.split() == ["parameter", "shape", "d_in", "gamma", "std", "action"]
    assert row.split()[-4:] == ["400", "1", f"{1 / 400:.3e}", "normal"]
    padded = nn.Embedding(50, 64, padding_idx=3)
    gamma_init_(padded)
    assert torch.all(padded.weight[3] == 0) and padded.weight[4].abs().sum() > 0
    with pytest.raises(ValueError, match="embedding_fan_in"):
        gamma_init_(emb, embedding_fan_in="rows")


def test_overrides_by_name_pattern():
    model = GPT(GPTConfig(vocab_size=500, n_layer=1, n_head=2, d_model=256))
    report = {r["name"]: r for r in init_model_(model, gamma=1.0, overrides={r"^lm_head\.": 0.5})}
    assert report["lm_head.weight"]["gamma"] == 0.5 and report["layers.0.attn.wq.weight"]["gamma"] == 1.0
    assert model.lm_head.weight.std().item() == pytest.approx(256 ** -0.5, rel=0.03)
    assert model.layers[0].attn.wq.weight.std().item() == pytest.approx(256 ** -1.0, rel=0.03)


def test_override_that_matches_only_a_tied_alias_raises_naming_the_tensor():
    model = GPT(GPTConfig(vocab_size=100, n_layer=1, n_head=2, d_model=64, tie_embeddings=True))
    with pytest.raises(ValueError, match=r"lm_head\.weight, which is tied to tok_emb\.weight"):
        init_model_(model, overrides={r"^lm_head\.": 0.5})
    # Matching the name the tensor is drawn under works, and scales the (shared) head with it.
    report = {r["name"]: r for r in init_model_(model, overrides={r"^tok_emb\.": 0.5})}
    assert report["tok_emb.weight"]["gamma"] == 0.5
    assert model.lm_head.weight.std().item() == pytest.approx(64 ** -0.5, rel=0.05)


def test_override_mistakes_raise_one_line_before_anything_is_drawn():
    """A pattern that matched nothing was ignored (every tensor kept the global γ) and a bad
    regex raised re's own error deep in the init; both now raise before any tensor is drawn."""
    model = GPT(GPTConfig(vocab_size=100, n_layer=1, n_head=2, d_model=64))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for overrides, message in (
            ({r"^lm_haed\.": 0.5}, r"pattern '^lm_haed\\.' matches no parameter (names are like lm_head.weight, "),
            ({r"attn\.wq": 0.7, r"^tok_emb\.[": 0.5}, r"pattern '^tok_emb\\.[' is not a valid regex (unterminated"),
            ({r"^lm_head\.": None}, r"pattern '^lm_head\\.' maps to None: the value must be a number")):
        with pytest.raises(ValueError, match=re.escape(message)) as e:
            init_model_(model, overrides=overrides)
        assert "\n" not in str(e.value)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    # A pattern that matches something is fine, whatever else it misses
    report = {r["name"]: r for r in init_model_(model, overrides={r"attn\.wq": 0.7})}
    assert report["layers.0.attn.wq.weight"]["gamma"] == 0.7


# Norms init.py has never seen: it runs each once to tell x̂·w from x̂·(1+w).
class ScaleNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.full((d,), 5.0))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * self.weight


class OffsetNorm(ScaleNorm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * (1 + self.weight)


class ExpNorm(ScaleNorm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * self.weight.exp()


class GatedNorm(ScaleNorm):
    def forward(self, x, gate):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * self.weight * gate


def test_norms_get_gain_one_whichever_way_they_apply_their_weight():
    net = nn.ModuleDict({"scale": ScaleNorm(32), "offset": OffsetNorm(32), "exp": ExpNorm(32), "gated": GatedNorm(32)})
    with pytest.warns(UserWarning, match="exp.weight, gated.weight"):
        report = {r["name"]: r for r in gamma_init_(net)}
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(0))
    for name in ("scale", "offset"):
        rms = net[name](x).pow(2).mean(-1).sqrt()
        assert torch.allclose(rms, torch.ones(6), atol=1e-5), (name, rms)
    assert torch.all(net["offset"].weight == 0) and torch.all(net["scale"].weight == 1)
    # Neither form (or not runnable on one input): reported, warned about and left as it was.
    for name in ("exp", "gated"):
        assert report[f"{name}.weight"]["action"] == "skipped" and torch.all(net[name].weight == 5)


def _init_recording_warnings(model, init=gamma_init_, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = init(model, **kw)
    return {r["name"]: r for r in report if r["action"] == "eps"}, [str(w.message) for w in caught]


def _output_rms_at_init_scale(norm, d, gamma):
    # Rows of mean 0 and mean square exactly d^-2γ (the stream at init); zero mean so that a
    # LayerNorm's variance is that mean square too.
    x = torch.randn(4, d, generator=torch.Generator().manual_seed(0))
    x = x - x.mean(-1, keepdim=True)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt() * d ** -gamma
    return norm(x).pow(2).mean(-1).sqrt()


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_eps_audit_on_model_py(norm):
    # The default eps 1e-12 at d=2048, γ=1: r = 1e-12 * 2048^2 = 4e-6, silent.
    big = GPT(GPTConfig(vocab_size=16, n_layer=1, n_head=32, d_model=2048, d_ff=16, norm=norm))
    flagged, caught = _init_recording_warnings(big, init=init_model_, gamma=1.0)
    assert flagged == {} and caught == []
    # eps 1e-5 at d=128: r = 1e-5 * 128^2 = 0.164, so the norm outputs RMS 0.93, not 1.
    model = GPT(GPTConfig(vocab_size=16, n_layer=1, n_head=2, d_model=128, d_ff=16, norm=norm, norm_eps=1e-5))
    flagged, (message,) = _init_recording_warnings(model, init=init_model_, gamma=1.0)
    r = 1e-5 * 128 ** 2
    assert set(flagged) == {"layers.0.attn_norm", "layers.0.mlp_norm", "norm"}
    assert f"3 norms (layers.*.attn_norm, layers.*.mlp_norm, norm) eps 1e-05, d 128: r = {r:.3g}" in message
    rms = _output_rms_at_init_scale(model.norm, 128, 1.0)
    assert torch.allclose(rms, torch.full_like(rms, (1 + r) ** -0.5), rtol=1e-4)


class NormReadingConfig(nn.Module):  # holds no eps: it uses its model's config.rms_norm_eps
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self._hidden = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self._hidden) * self.weight


def test_eps_audit_on_torch_norms_and_a_config_eps():
    d = 2048
    net = nn.ModuleDict({
        "ln": nn.LayerNorm(d),                                    # eps 1e-5: r = 42
        "ln_plain": nn.LayerNorm(d, elementwise_affine=False),    # no weight: d from normalized_shape
        "rms_default": nn.RMSNorm(d),                             # eps None: finfo(float32).eps, r = 0.5
        "rms_tiny": nn.RMSNorm(d, eps=1e-12),                     # r = 4e-6
        "bn": nn.BatchNorm1d(d),                                  # follows convs: not audited
        "custom": NormReadingConfig(d, 1e-6),                     # eps from config: r = 4.2
    })
    net.config = type("Config", (), {"rms_norm_eps": 1e-6})()
    flagged, (message,) = _init_recording_warnings(net, gamma=1.0)
    assert set(flagged) == {"ln", "ln_plain", "rms_default", "custom"}
    # Each reported r is the one torch's own forward obeys: output RMS 1/sqrt(1+r).
    for name, row in flagged.items():
        r = float(re.search(r"r = ([0-9.e+-]+)", row["reason"]).group(1))
        rms = _output_rms_at_init_scale(net[name], d, 1.0)
        assert torch.allclose(rms, torch.full_like(rms, (1 + r) ** -0.5), rtol=2e-3), (name, rms, r)
    assert "finfo" in flagged["rms_default"]["reason"] and "config.rms_norm_eps" in flagged["custom"]["reason"]
    assert f"2 norms (ln, ln_plain) eps 1e-05, d 2048: r = {1e-5 * d ** 2:.3g}" in message
    rms = _output_rms_at_init_scale(net["rms_tiny"], d, 1.0)
    assert torch.allclose(rms, torch.ones_like(rms), rtol=1e-4)


def test_fan_in_dims_keys_may_be_class_name_regexes_and_values_functions():
    class StackedExperts(nn.Module):  # (E, out, in) like transformers, or (E, in, out) when flagged
        def __init__(self, transposed):
            super().__init__()
            self.transposed = transposed
            self.w = nn.Parameter(torch.empty(4, 96, 200) if transposed else torch.empty(4, 200, 96))

    def by_flag(module):
        return {"w": 1 if module.transposed else 2}

    net = nn.ModuleDict({"a": StackedExperts(False), "b": StackedExperts(True)})
    report = {r["name"]: r for r in gamma_init_(net, fan_in_dims={r"Stacked\w+": by_flag})}
    for name in ("a.w", "b.w"):
        assert report[name]["d_in"] == 96
        assert net[name[0]].w.std().item() == pytest.approx(1 / 96, rel=0.03)
    # A regex must match the class name whole: "Stacked" alone declares nothing.
    with pytest.warns(UserWarning, match="a.w"):
        assert gamma_init_(net, fan_in_dims={"Stacked": by_flag})[0]["action"] == "skipped"


def test_same_seed_same_weights_whatever_the_order_or_wrapper():
    cfg = GPTConfig(vocab_size=100, n_layer=2, n_head=2, d_model=64)
    a, b, c = GPT(cfg), GPT(cfg), GPT(cfg)
    init_model_(a, seed=7)
    # A compiled wrapper (adds "_orig_mod." to names) and an unrelated draw in between change nothing.
    torch.randn(1000)
    init_model_(torch.compile(b), seed=7)
    init_model_(c, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.attn.wq.weight"], sc["layers.0.attn.wq.weight"])
    # Different parameters of the same shape get different draws.
    assert not torch.equal(a.layers[0].attn.wq.weight, a.layers[0].attn.wk.weight)


def test_meta_build_then_to_empty_matches_direct_build():
    cfg = moe_config()
    direct = GPT(cfg)
    init_model_(direct, seed=5)
    with torch.device("meta"):
        meta = GPT(cfg)
    with pytest.raises(ValueError, match="to_empty"):
        init_model_(meta)
    meta.to_empty(device="cpu")
    init_model_(meta, seed=5)
    sd, sm = direct.state_dict(), meta.state_dict()
    assert all(torch.equal(sd[k], sm[k]) for k in sd)


def test_tied_embeddings_are_drawn_once_and_stay_tied_after_a_meta_build():
    cfg = GPTConfig(vocab_size=100, n_layer=1, n_head=2, d_model=64, tie_embeddings=True)
    model = GPT(cfg)
    report = {r["name"]: r for r in init_model_(model)}
    assert report["lm_head.weight"]["action"] == "tied"
    assert model.lm_head.weight is model.tok_emb.weight
    with torch.device("meta"):
        meta = GPT(cfg)
    meta.to_empty(device="cpu")
    assert meta.lm_head.weight is meta.tok_emb.weight
    assert meta.num_params() == model.num_params()


def torchrun_init_command(nproc, out_path):
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
            "--rdzv-endpoint=localhost:0", os.path.join(ROOT, "tests", "dist_init_worker.py"), str(out_path)]


def _torchrun_init(nproc, out_path):
    run = subprocess.run(torchrun_init_command(nproc, out_path), env=launch_env(),
                         capture_output=True, text=True)
    assert run.returncode == 0, failure_text(run)
    return torch.load(out_path)


@pytest.mark.slow
def test_fsdp2_one_rank_and_two_ranks_give_identical_full_weights(tmp_path):
    one = _torchrun_init(1, tmp_path / "one.pt")
    two = _torchrun_init(2, tmp_path / "two.pt")
    assert one.keys() == two.keys() and len(one) > 20
    for k in one:
        assert torch.equal(one[k], two[k]), k
    # ...and both equal the plain, unsharded model built on the CPU.
    plain = GPT(GPTConfig(vocab_size=257, n_layer=2, n_head=2, d_model=64))
    init_model_(plain, gamma=1.0, seed=1234)
    for k, v in plain.state_dict().items():
        assert torch.equal(one[f"dense.{k}"], v), k
