"""The command line: generate, info, demo, and one-line errors for bad input."""

import shutil
import subprocess
import sys

import pytest

from jaxlp.cli import main


def char_tokenizer():
    """Character tokenizer for the random test models: <pad>, <eos>, <unk>, then printable ASCII."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.add_special_tokens(["<pad>", "<eos>", "<unk>"])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    tok.decoder = decoders.Fuse()
    return tok


@pytest.fixture(scope="module")
def model_dir(hf_checkpoint, tmp_path_factory):
    _, path = hf_checkpoint("llama")
    d = tmp_path_factory.mktemp("cli") / "model"
    shutil.copytree(path, d)
    char_tokenizer().save(str(d / "tokenizer.json"))
    return d


def test_generate_prints_text(model_dir, capsys):
    assert main(["generate", "--model", str(model_dir), "--prompt", "12 + 35 =", "--max-new-tokens", "8",
                 "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert len(out.strip()) > 0


def test_generate_sampler_and_seed_deterministic(model_dir, capsys):
    args = ["generate", "--model", str(model_dir), "--prompt", "hello", "--max-new-tokens", "8", "--sampler",
            "top-p", "--temperature", "1.5", "--seed", "4"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


def test_info(model_dir, capsys):
    assert main(["info", "--model", str(model_dir)]) == 0
    out = capsys.readouterr().out
    assert "llama" in out and "parameters" in out
    # parameters read from the safetensors headers agree with the config's count
    line = next(l for l in out.splitlines() if l.startswith("parameters"))
    n_file, n_config = (int(x.replace(",", "")) for x in line.replace("(config:", "").rstrip(")").split()[1:3])
    assert n_file == n_config


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--model", "/nonexistent", "--prompt", "x"], "does not exist"),
        (["generate", "--model", "{model}", "--prompt", "   "], "prompt is empty"),
        (["generate", "--model", "{model}", "--prompt", "x" * 600, "--max-new-tokens", "8"], "context length"),
        (["info", "--model", "{broken}"], "corrupt JSON"),
        (["info", "--model", "{moe}"], "unsupported architecture"),
        (["generate", "--model", "{notok}", "--prompt", "hi"], "no tokenizer.json"),
    ],
)
def test_user_errors_are_one_line(model_dir, tmp_path, capsys, argv, message):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "config.json").write_text("{")
    moe = tmp_path / "moe"
    shutil.copytree(model_dir, moe)
    (moe / "config.json").write_text((model_dir / "config.json").read_text().replace('"llama"', '"mixtral"'))
    notok = tmp_path / "notok"
    shutil.copytree(model_dir, notok)
    (notok / "tokenizer.json").unlink()
    argv = [a.format(model=model_dir, broken=broken, moe=moe, notok=notok) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxlp: error:") and message in err and "Traceback" not in err
    assert len(err.splitlines()) == 1


def test_console_script_demo_runs(tiny_reasoner_dir, monkeypatch, capsys):
    """The demo through the console entry point, on the tiny reasoner (1 layer: the embedded one's
    8-layer NVFP4 program takes most of a minute to compile); in process, the embedded reasoner is
    what it loads by default."""
    import jaxlp.models.tokenizer
    from jaxlp.demo import REASONER_DIR

    def stop(path):
        raise RuntimeError(f"would load {path}")

    monkeypatch.setattr(jaxlp.models.tokenizer, "load_tokenizer", stop)
    assert main(["demo", "--problems", "1"]) == 1
    assert f"would load {REASONER_DIR}" in capsys.readouterr().err
    proc = subprocess.run([sys.executable, "-m", "jaxlp.cli", "demo", "--problems", "2", "--model",
                           str(tiny_reasoner_dir)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "tok/s" in proc.stdout and "weight bytes" in proc.stdout
    rows = [l for l in lines if l.startswith(("BF16", "NVFP4"))]
    assert len(rows) == 3, proc.stdout
    bf16_bytes, w4a4_bytes = (int(r.split()[-1].replace(",", "")) for r in rows[:2])
    assert 0.25 * bf16_bytes < w4a4_bytes < 0.6 * bf16_bytes  # the embedding stays BF16


def test_quantize_then_generate_and_info(model_dir, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(model_dir), "--recipe", "w4a4-nvfp4", "--out", str(out),
                 "--calibration-sequences", "2", "--calibration-length", "64", "--dtype", "float32"]) == 0
    assert "14 layers quantized" in capsys.readouterr().out
    assert main(["generate", "--model", str(out), "--prompt", "1 + 2 =", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["info", "--model", str(out)]) == 0
    assert "w4a4-nvfp4" in capsys.readouterr().out
    assert main(["quantize", "--model", str(model_dir), "--recipe", "w4a4-nvfp4", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["quantize", "--model", str(model_dir), "--recipe", "w2a2", "--out", str(tmp_path / "x")]) == 2
    assert "invalid choice: 'w2a2'" in capsys.readouterr().err


def test_quantize_with_the_lm_head(model_dir, tmp_path, capsys):
    """--lm-head quantizes the output projection too (weight-only); a checkpoint that ties it to the
    embeddings (the shipped reasoner) is refused before anything is loaded."""
    from importlib.resources import files

    out = tmp_path / "q"
    assert main(["quantize", "--model", str(model_dir), "--recipe", "w4a16-nvfp4", "--out", str(out), "--lm-head",
                 "--dtype", "float32"]) == 0
    assert "15 layers quantized" in capsys.readouterr().out
    assert main(["generate", "--model", str(out), "--prompt", "1 + 2 =", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()
    reasoner = files("jaxlp") / "assets" / "reasoner"
    assert main(["quantize", "--model", str(reasoner), "--recipe", "w4a16-nvfp4", "--out", str(tmp_path / "r"),
                 "--lm-head"]) == 2
    assert "ties its output projection to the embeddings" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_fuse_projections_flags(model_dir, tmp_path, capsys):
    """Fused and unfused generation give the same greedy text; a fused quantized checkpoint loads fused."""
    args = ["generate", "--model", str(model_dir), "--prompt", "7 * 6 =", "--max-new-tokens", "8", "--dtype", "float32"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--fuse-projections"]) == 0
    assert capsys.readouterr().out == plain
    out = tmp_path / "qf"
    assert main(["quantize", "--model", str(model_dir), "--recipe", "w4a16-nvfp4", "--out", str(out),
                 "--fuse-projections"]) == 0
    assert "8 layers quantized" in capsys.readouterr().out  # 2 layers x (qkv, o, gate_up, down)
    assert main(["generate", "--model", str(out), "--prompt", "1 + 2 =", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()
    unfused = tmp_path / "q"
    assert main(["quantize", "--model", str(model_dir), "--recipe", "w4a16-nvfp4", "--out", str(unfused)]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(unfused), "--prompt", "1", "--fuse-projections"]) == 2
    assert "cannot fuse the projections" in capsys.readouterr().err


def test_entropy_samplers_and_tau0_calibration(model_dir, capsys):
    base = ["generate", "--model", str(model_dir), "--prompt", "a\n\nb", "--max-new-tokens", "6", "--dtype", "float32"]
    assert main(base + ["--sampler", "reset", "--t-low", "0.1", "--tau0", "0.5"]) == 0
    assert main(base + ["--sampler", "fixed-threshold", "--preset", "Qwen3-8B"]) == 0
    capsys.readouterr()
    assert main(base + ["--sampler", "reset"]) == 2
    assert "--t-low and --tau0" in capsys.readouterr().err
    assert main(["calibrate-tau0", "--model", str(model_dir), "--num-prompts", "2", "--prompt-length", "16",
                 "--max-new-tokens", "8", "--dtype", "float32"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("tau0 = ") and float(line.split()[2]) > 0


def test_unexpected_errors_are_one_line_with_a_debug_hint(model_dir, monkeypatch, capsys):
    import jaxlp.cli as cli

    def broken(args):
        raise RuntimeError("something inside\nbroke")

    monkeypatch.setattr(cli, "cmd_info", broken)
    assert main(["info", "--model", str(model_dir)]) == 1
    err = capsys.readouterr().err
    assert err == "jaxlp: error: unexpected RuntimeError: something inside broke (rerun with --debug for the traceback)\n"
    with pytest.raises(RuntimeError, match="broke"):
        main(["info", "--model", str(model_dir), "--debug"])

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_info", interrupted)
    assert main(["info", "--model", str(model_dir)]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_prompt_rule_and_unused_option_note(capsys):
    from jaxlp.cli import normalize_prompt

    assert normalize_prompt("Q: 1+2") == normalize_prompt("Q: 1+2\n") == normalize_prompt("Q: 1+2\n\n") == "Q: 1+2\n"
    assert normalize_prompt("Q: 1+2", newline=False) == "Q: 1+2"
    assert main(["generate", "--model", "/nonexistent", "--prompt", "x", "--top-p", "0.9"]) == 2
    err = capsys.readouterr().err
    assert "--top-p has no effect with --sampler greedy" in err and "does not exist" in err


def test_nestedfp_precision_flag(model_dir, tmp_path, capsys):
    """--precision fp16 is the checkpoint's own text, fp8 and auto run; a non-NestedFP model refuses it."""
    out = tmp_path / "nested"
    assert main(["quantize", "--model", str(model_dir), "--recipe", "nestedfp", "--out", str(out),
                 "--dtype", "float32"]) == 0
    capsys.readouterr()
    base = ["generate", "--model", str(out), "--prompts-file", str(tmp_path / "p.txt"), "--max-new-tokens", "6"]
    (tmp_path / "p.txt").write_text("Q: 1+2\n\nQ: 3+4\n\nQ: 5+6\n")
    texts = {}
    for precision in (None, "fp16", "fp8", "auto"):
        assert main(base + ([] if precision is None else ["--precision", precision])) == 0
        texts[precision] = capsys.readouterr().out
        assert texts[precision].count("--- prompt") == 3
    assert texts["fp16"] == texts[None]
    assert main(["generate", "--model", str(model_dir), "--prompt", "1", "--precision", "fp8"]) == 2
    assert "no NestedFP layers" in capsys.readouterr().err


def test_generate_tp_gives_the_single_device_text(model_dir, tiny_reasoner_dir, tmp_path, capsys):
    """--tp 2 over two of the four simulated CPU devices: the same greedy text for the dense test
    checkpoint and a W4A16-NVFP4 reasoner (the tiny one: its splits keep whole NVFP4 blocks too); a
    clear error where a split would cut NVFP4 blocks and for more devices than there are; fused
    projections split per device (rows grouped for the 2 devices) give the same text."""
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(tiny_reasoner_dir), "--recipe", "w4a16-nvfp4", "--out", str(out)]) == 0
    capsys.readouterr()
    for model in (model_dir, out):
        args = ["generate", "--model", str(model), "--prompt", "12 + 35 =", "--max-new-tokens", "6", "--kv-cache",
                "kitty-pro"]
        assert main(args) == 0
        single = capsys.readouterr().out
        assert main(args + ["--tp", "2"]) == 0
        assert capsys.readouterr().out == single
        if model == model_dir:  # dense: fused after loading, on the mesh
            assert main(args + ["--tp", "2", "--fuse-projections"]) == 0
            assert capsys.readouterr().out == single
    tiny = tmp_path / "tiny"  # intermediate size 112: 56 per device, not whole 16-element blocks
    assert main(["quantize", "--model", str(model_dir), "--recipe", "w4a16-nvfp4", "--out", str(tiny)]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(tiny), "--prompt", "1", "--tp", "2"]) == 2
    assert "down_proj.weight: nvfp4 weight with K = 112 cannot be split over 2 devices" in capsys.readouterr().err
    assert main(["generate", "--model", str(model_dir), "--prompt", "1", "--tp", "64"]) == 2
    assert "--tp 64: this machine has" in capsys.readouterr().err
