"""Files and model directories appear whole or not at all (common/files.py): the run's
`final`, `omrl export`'s and `omrl sft`'s models, the books and the demo's stages. A write
that fails half-way leaves the earlier one as it was and nothing beside it."""

from __future__ import annotations

import pytest

from common.models import save_policy


def _files(directory):
    return {path.name: path.read_bytes() for path in directory.iterdir()}


def test_a_model_directory_is_replaced_whole_and_a_failed_write_leaves_the_old_one(tmp_path, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    out = tmp_path / "final"
    save_policy(model, tiny_model, out, files={"note.json": "{}\n"})
    first = _files(out)
    assert {"config.json", "model.safetensors", "tokenizer.json", "note.json"} <= set(first)

    class DiesWhileWriting:  # writes the weights, then fails before the tokenizer is written
        def save_pretrained(self, path, **kwargs):
            model.save_pretrained(path, **kwargs)
            raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space left"):
        save_policy(DiesWhileWriting(), tiny_model, out)
    assert _files(out) == first
    assert [p.name for p in tmp_path.iterdir()] == ["final"]  # no temporary directory left

    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    save_policy(model, tiny_model, out)
    assert "note.json" not in _files(out)  # replaced whole, not written over
    # `omrl sft` writes its metrics (a file, a folder) where its model goes: they are kept.
    (out / "sft_metrics.jsonl").write_text('{"step": 1}\n')
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events").write_bytes(b"e")
    save_policy(model, tiny_model, out, keep_others=True)
    assert (out / "sft_metrics.jsonl").read_text() == '{"step": 1}\n' and (out / "tensorboard" / "events").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["final"]


def test_a_file_is_replaced_whole_and_a_failed_write_leaves_the_old_one(tmp_path, monkeypatch):
    import os

    from common.files import write_atomic

    path = tmp_path / "runs" / "accounting.json"  # its folder is made
    write_atomic(path, '{"trained": 1}\n')
    assert path.read_text() == '{"trained": 1}\n'

    def disk_full(fd):
        raise OSError("No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, '{"trained": 2}\n')
    assert path.read_text() == '{"trained": 1}\n'
    assert [p.name for p in path.parent.iterdir()] == ["accounting.json"]  # the temporary file is gone

    monkeypatch.undo()
    write_atomic(path, b'{"trained": 3}\n')
    assert path.read_bytes() == b'{"trained": 3}\n'
