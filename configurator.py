"""
Settings from Python config files and --key=value, over a dict of defaults (nanoGPT's
configurator.py, as functions). train.py owns the settings and their checks; this file only
knows how to read them, so eval.py and sweep.py read a value as train.py does without importing
train.py (and check a command line's count flags alike: at_least). It imports nothing of the project.

    cfg = configure(DEFAULTS, ["config/a.py", "--lr=3e-3", "--weight_decay.matrix=0.3"], ALIASES)

Each config file runs in order over the settings so far (its _names are its own helpers, and
include("other.py") runs a config file beside it in place); then --key=value (a Python literal,
else a string) and --key.item=value (one entry of a dict setting) override. An unknown name or a
value of the wrong type is one line naming where it came from.
"""

import argparse
import ast
import builtins
import copy
import difflib
import math
import os
import traceback


def parse_value(text):
    """A --key=value's value: a Python literal, else the text itself (--out_dir=out/x needs no quotes)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def at_least(minimum, parse=int):
    """argparse type of a size or count flag: parse(text) >= minimum, refused when the command line
    is read (a batch size of 0 divides by zero later; a token budget of 0 reads a batch anyway).
    parse: int, or a parser of its own whose ValueError is the message (prepare_data's 2B counts)."""
    def check(text):
        try:
            value = parse(text)
        except ValueError as e:
            if parse is int:
                raise  # argparse's message: "invalid int value: 'x'"
            raise argparse.ArgumentTypeError(str(e)) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum} (got {text})")
        return value
    check.__name__ = parse.__name__
    return check


def check_type(key, value, default):
    want = type(default)
    if want is float and type(value) is int:
        return float(value)
    if type(value) is float and not math.isfinite(value):  # 1e999 parses as inf: no setting means that
        raise ValueError(f"config: {key}={value!r} is not a finite number")
    if type(value) is not want:
        raise ValueError(f"config: {key}={value!r} is a {type(value).__name__}, expected a "
                         f"{want.__name__} like the default {default!r}")
    return value


def unknown_key(key, valid, where, aliases=None):
    """The error for a name that is not a setting, naming the closest one, or for a name in
    aliases ({another tool's name: ours}) ours."""
    aliases = aliases or {}
    close = [aliases[key]] if key in aliases else difflib.get_close_matches(key, list(valid), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ValueError(f"config: unknown key {key!r} in {where}{hint}")


def set_key(cfg, defaults, key, value, where, aliases=None, merge_dicts=False):
    head, _, item = key.partition(".")
    if head not in defaults:
        raise unknown_key(head, defaults, where, aliases)
    default = defaults[head]
    if item:
        # `--weight_decay.matrix=0.3` sets one entry and keeps the others (replacing the
        # whole dict from the command line would silently drop them).
        if type(default) is not dict:
            raise ValueError(f"config: {head} is not a dict setting: write --{head}=...")
        value = {item: value}
    if type(default) is dict and default:  # fixed entries (weight_decay): each checked
        value = dict(check_type(head, value, default))
        for k, v in value.items():
            if k not in default:
                raise unknown_key(f"{head}.{k}", [f"{head}.{d}" for d in default], where)
            value[k] = check_type(f"{head}.{k}", v, default[k])
        cfg[head] = {**cfg[head], **value}
    elif item or (type(default) is dict and merge_dicts):
        # Free-form dicts (model, init_overrides) are checked by their users. From the command
        # line they merge: --model={'attn_gate': 'none'} must not silently drop the config
        # file's doc_mask or max_seq_len. A config file's `model = dict(...)` replaces, as the
        # Python says (use model.update(...) there to merge).
        cfg[head] = {**cfg[head], **check_type(head, value, default)}
    else:
        cfg[head] = check_type(head, value, default)


def configure(defaults, argv, aliases=None):
    """defaults <- config files (in order) <- --key=value overrides, each name and type checked
    against defaults (which are not changed)."""
    cfg = copy.deepcopy(defaults)
    for arg, after in zip(argv, [*argv[1:], None]):
        if arg.startswith("--"):
            key, eq, text = arg[2:].partition("=")
            if not eq and after is not None and not after.startswith("--") and not os.path.isfile(after):
                # argparse's habit, `--lr 3e-4`: read as a bare --lr (True) and a config file named 3e-4
                raise ValueError(f"config: --{key} {after}: settings take one argument, write --{key}={after}")
            if not eq:
                text = "True"  # a bare --flag
            set_key(cfg, defaults, key, parse_value(text), "the command line", aliases, merge_dicts=True)
        else:
            if not os.path.isfile(arg):
                raise FileNotFoundError(f"config: no such config file {arg!r} (arguments are config "
                                        f"files and --key=value)")
            ns = copy.deepcopy(cfg)
            ns["include"] = lambda name, _dir=os.path.dirname(arg): run_file(os.path.join(_dir, name), ns)
            run_file(arg, ns)
            for key, value in ns.items():
                # _names are the file's own helpers; imported modules are not settings.
                if key.startswith("_") or key == "include" or type(value).__name__ == "module":
                    continue
                set_key(cfg, defaults, key, value, arg, aliases)
    return cfg


def run_file(path, ns):
    """Execute a config file in ns. Config files share settings by include("other.py"),
    resolved beside the includer. (builtins.compile: a setting named `compile` shadows the name.)
    A broken file is one line naming the file and line, not the traceback of exec."""
    if not os.path.isfile(path):
        raise ValueError(f"config: no such config file {path!r} (include() resolves names beside the including file)")
    with open(path) as f:
        text = f.read()
    try:
        code = builtins.compile(text, path, "exec")
    except SyntaxError as e:
        raise ValueError(f"config: {path}:{e.lineno}: syntax error: {e.msg}") from None
    try:
        exec(code, ns)
    except Exception as e:
        if str(e).startswith("config: "):
            raise  # an include() of a missing or broken file: already one line naming it
        line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == path), "?")
        raise ValueError(f"config: {path}:{line}: {type(e).__name__}: {e}") from None


def settings_help(path, defaults):
    """--help's lines for the settings: each with its default and the comment beside it in path's
    block of defaults, which starts at a line "# ----...---- defaults" and ends at the next "# ---"
    (read from the file, so the help is the code's own documentation). A comment line of its own
    heads a group; an indented one continues the setting above."""
    with open(path) as f:
        block = f.read().split("# " + "-" * 77 + " defaults\n")[1].split("\n# ---")[0]
    lines = []
    for line in block.splitlines():
        name, eq, rest = line.partition(" = ")
        if line.startswith("# "):
            lines += ["", line[2:]]
        elif eq and name in defaults:
            lines.append(f"  {name}={defaults[name]!r}  {rest.partition('#')[2].strip()}".rstrip())
        elif line.lstrip().startswith("# "):
            lines[-1] += " " + line.strip()[2:]
    return lines
