"""The README's code must run as written."""
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_section(title):
    text = open(os.path.join(ROOT, "README.md")).read()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def code_blocks(section, language):
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def test_init_example_runs_with_init_py_alone(tmp_path):
    (example,) = code_blocks(readme_section("Using init.py in another codebase"), "python")
    shutil.copy(os.path.join(ROOT, "init.py"), tmp_path)
    (tmp_path / "example.py").write_text(example)
    out = subprocess.run([sys.executable, "-E", "-s", "example.py"], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    # Conv1D declared with d_in on dim 0 (256); the Linear overridden to γ=0.5 (d_in 768).
    assert "256" in rows["1.weight"] and "3.906e-03" in rows["1.weight"]
    assert "768" in rows["3.weight"] and f"{768 ** -0.5:.3e}" in rows["3.weight"]
    assert "zeros" in rows["1.bias"] and "ones" in rows["2.weight"]
