"""``sglang calibrate-cache``: without ``--model-path`` it needs ``--output`` (the embedded demo
model's directory is part of the installed package), refused before any model is read."""

from __future__ import annotations

from sglang.cli.main import main as sglang_main


def test_the_demo_model_needs_output_before_loading(tmp_path, capsys, monkeypatch):
    import sglang.multimodal_gen.runtime as runtime

    def no_engine(*a, **k):
        raise AssertionError("the engine was built")

    monkeypatch.setattr(runtime, "DiffusionEngine", no_engine)
    assert sglang_main(["calibrate-cache", "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "sglang calibrate-cache: error: --output is required without --model-path: the embedded "
        "demo model's directory is part of the installed package (which ships its "
        "magcache_ratios.json)"
    ]
    # with --output (or --model-path) the command goes on to build the engine
    for flags in (["--output", str(tmp_path / "r.json")], ["--model-path", str(tmp_path)]):
        assert sglang_main(["calibrate-cache", *flags]) == 1
        assert "the engine was built" in capsys.readouterr().err
