"""Ctrl-C during the swap of an HF export into place (hf_export.put_in_place): the earlier export is moved
aside, then the new one renamed in. A SIGINT between those two renames must not leave OUT missing: it is held
back until the new export is in place and the old one deleted, then delivered as usual. The references are the
folders' files, before and after; the signal is a real SIGINT to this process, sent from inside os.rename."""
import os
import signal

import pytest

pytest.importorskip("transformers", reason="the HF export needs transformers (Makefile test install)")
pytest.importorskip("safetensors", reason="the HF export needs safetensors (Makefile test install)")

import hf_export  # noqa: E402
from test_faults_export_sweep import fill  # noqa: E402

OLD = {"config.json": "old", "model.safetensors": "old weights"}
NEW = {"config.json": "new", "model.safetensors": "new weights"}
NEW_EXPORT = {**NEW, hf_export.MARKER: hf_export.MARKER_BYTES.decode()}


def texts(folder):
    """{file name: text} of a flat folder."""
    out = {}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            out[name] = f.read()
    return out


def ctrl_c_at(monkeypatch, when):
    """os.rename sending this process one SIGINT: right after it moves when["after"] away, or right before it
    moves when["before"]; returns the list that records that it was sent."""
    rename, sent = os.rename, []

    def rename_and_interrupt(src, dst):
        if src == when.get("before") and not sent:
            sent.append(src)
            os.kill(os.getpid(), signal.SIGINT)
        rename(src, dst)
        if src == when.get("after") and not sent:
            sent.append(src)
            os.kill(os.getpid(), signal.SIGINT)  # Python's handler runs at the next bytecode
    monkeypatch.setattr(os, "rename", rename_and_interrupt)
    return sent


@pytest.mark.parametrize("at", ["after moving the old export aside", "before renaming the new one in"])
def test_ctrl_c_between_the_two_renames_leaves_one_whole_export(at, tmp_path, monkeypatch):
    out, new = str(tmp_path / "hf"), str(tmp_path / "new")
    hf_export.write_folder(out, lambda folder: fill(folder, OLD))
    fill(new, NEW_EXPORT)
    sent = ctrl_c_at(monkeypatch, {"after": out} if at.startswith("after") else {"before": new})
    with pytest.raises(KeyboardInterrupt):
        hf_export.put_in_place(new, out)
    monkeypatch.undo()
    assert sent  # the interrupt came where the test says
    assert texts(out) == NEW_EXPORT  # the new export, whole: the swap finished before Ctrl-C was raised
    assert os.listdir(tmp_path) == ["hf"]  # the old export deleted, no aside folder left
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the process's handler is back


def test_a_ctrl_c_held_back_reaches_the_callers_own_handler_once(tmp_path, monkeypatch):
    out = str(tmp_path / "hf")
    hf_export.write_folder(out, lambda folder: fill(folder, OLD))
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        sent = ctrl_c_at(monkeypatch, {"after": out})
        hf_export.write_folder(out, lambda folder: fill(folder, NEW))  # this handler records, it does not raise
        monkeypatch.undo()
        handler = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert sent and caught == [signal.SIGINT]  # delivered once, after the swap
    assert handler is not previous and handler is not signal.default_int_handler  # the caller's, put back
    assert texts(out) == NEW_EXPORT and os.listdir(tmp_path) == ["hf"]
