"""Every flag of every top-level tool has help text (eval.py's and sweep.py's are checked in
their own tests): the parser each tool builds is captured when it parses its arguments."""
import argparse

import pytest

import bench
import gpu_check
import prepare_data
import quickstart
import train


class Captured(Exception):
    pass


def parsers_of(main, argv, monkeypatch):
    """Every parser `main(argv)` builds, subcommands' included, captured at parse time."""
    def capture(self, args=None, namespace=None):
        raise Captured(self)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(Captured) as e:
        main(argv)
    todo, out = [e.value.args[0]], []
    while todo:
        parser = todo.pop()
        out.append(parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += action.choices.values()
    return out


@pytest.mark.parametrize("tool", ["prepare_data", "quickstart", "gpu_check", "bench", "train export"])
def test_every_flag_has_help(tool, monkeypatch):
    main, argv = {"prepare_data": (prepare_data.main, []), "quickstart": (quickstart.main, []),
                  "gpu_check": (gpu_check.main, []), "bench": (bench.main, []),
                  "train export": (train.main, ["export", "a", "b"])}[tool]
    missing = [f"{parser.prog}: {'/'.join(action.option_strings) or action.dest}"
               for parser in parsers_of(main, argv, monkeypatch) for action in parser._actions
               if not action.help and not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))]
    assert not missing, missing
