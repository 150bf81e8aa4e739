"""Bad input through the command line: one line on stderr, the right exit status, no traceback,
nothing written or changed; and the Python API refuses the same settings with the same message.

Each case runs the command line from a scratch working directory and checks: the exit status;
exactly one ``jaxlp: error:`` line on stderr, holding the expected words; every other stderr
line a ``jaxlp: `` status line; no "Traceback" anywhere; and the source model and any existing
output byte-identical afterwards (a hash of every file before and after). ``docs/errors.md`` is
the same table in words.

Most cases call ``jaxlp.cli.main(argv)`` in the test process (file-descriptor capture of stdout
and stderr; a warning Python would print or a log record of WARNING or above counts as a stderr
line); the cases marked ``process`` run ``python -m jaxlp.cli`` as a subprocess, one of each
kind of failure (usage, sampler setting, Hugging Face and Orbax checkpoint, output),
for what only a fresh process shows (noise at import, the program's own exit). Interrupts and the
shadowing package folder always run as subprocesses.

The fixtures are built once per module from the embedded reasoner (``jaxlp/assets/reasoner``):
variants share its unchanged files through symlinks, and one quantized copy (W4A16 NVFP4, no
calibration) serves every quantized-checkpoint case.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

REASONER = Path(__file__).resolve().parents[1] / "jaxlp" / "assets" / "reasoner"
SHARD1 = "model-00001-of-00002.safetensors"
EMBED = "model.embed_tokens.weight"  # in shard 1 (the index says which)


# ----------------------------------------------------------------------------- fixtures


def _cli(args, cwd, timeout=180, **kwargs):
    """``python -m jaxlp.cli args`` as a subprocess (a ``CompletedProcess``)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "jaxlp.cli", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env, **kwargs)


@dataclasses.dataclass
class Run:
    """What an in-process run of the command line left, named as in ``subprocess.CompletedProcess``."""
    returncode: int
    stdout: str
    stderr: str


# Warnings a fresh Python process does not print (its default filters).
SILENT_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


@pytest.fixture
def main_in_process(capfd, caplog, monkeypatch):
    """``main_in_process(args, cwd) -> Run``: ``jaxlp.cli.main(args)`` in this process from ``cwd``,
    stdout and stderr captured at the file descriptors. A warning a fresh process would print and a
    log record of WARNING or above become stderr lines (so they count as noise, as they would
    there)."""
    from jaxlp.cli import main

    def run(args, cwd):
        monkeypatch.chdir(cwd)
        capfd.readouterr()
        caplog.clear()
        with warnings.catch_warnings(record=True) as caught:
            status = main([str(a) for a in args])
        out, err = capfd.readouterr()
        noise = [f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}" for w in caught
                 if not issubclass(w.category, SILENT_WARNINGS)]
        noise += [f"{r.name}: {r.levelname}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]
        return Run(status, out, err + "".join(f"{line}\n" for line in noise))

    return run


def tree_hash(path: Path) -> str | None:
    """Hash of every file under ``path`` (names and bytes; symlinks followed); None if absent."""
    if not os.path.lexists(path):
        return None
    h = hashlib.sha256()
    if path.is_file():
        h.update(path.read_bytes())
        return h.hexdigest()
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for name in sorted(files):
            f = Path(root) / name
            h.update(str(f.relative_to(path)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _shard_of(name: str) -> str:
    return json.loads((REASONER / "model.safetensors.index.json").read_text())["weight_map"][name]


def _variant(root: Path, name: str, edit: Callable[[Path], None]) -> Path:
    """A copy of the reasoner whose files are symlinks to the original, then ``edit(dir)``
    (which must replace a file before changing it: see :func:`_own`)."""
    d = root / name
    d.mkdir()
    for f in REASONER.iterdir():
        (d / f.name).symlink_to(f)
    edit(d)
    return d


def _own(path: Path) -> Path:
    """Replace a symlink by a real copy of its target (so that editing leaves the original alone)."""
    if path.is_symlink():
        target = path.resolve()
        path.unlink()
        shutil.copyfile(target, path)
    return path


def _edit_tensor(d: Path, name: str, change: Callable[[np.ndarray], np.ndarray]) -> None:
    from safetensors.numpy import load_file, save_file

    shard = d / _shard_of(name)
    tensors = load_file(str(shard))
    tensors[name] = change(tensors[name])
    shard.unlink()
    save_file(tensors, str(shard))


def _edit_json(path: Path, change: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    new = change(data)
    _own(path).write_text(json.dumps(data if new is None else new))


def _truncate(path: Path, size: int) -> None:
    data = path.read_bytes()[:size]
    path.unlink()
    path.write_bytes(data)


def _set_nan(x):
    x = x.copy()
    x.reshape(-1)[:7] = np.nan
    return x


def _set_inf(x):
    x = x.copy()
    x.reshape(-1)[3] = np.inf
    return x


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """The workspace: model variants, the quantized copy and its damaged variants, scratch files."""
    root = tmp_path_factory.mktemp("errors")
    cwd = root / "cwd"
    cwd.mkdir()
    p = {"root": root, "cwd": cwd, "reasoner": _variant(root, "reasoner", lambda d: None)}
    p["nan"] = _variant(root, "nan", lambda d: _edit_tensor(d, EMBED, _set_nan))
    p["inf"] = _variant(root, "inf", lambda d: _edit_tensor(d, EMBED, _set_inf))
    p["shape"] = _variant(root, "shape", lambda d: _edit_tensor(d, EMBED, lambda x: x[:, :-1].copy()))
    p["int"] = _variant(root, "int", lambda d: _edit_tensor(d, EMBED, lambda x: np.zeros(x.shape, np.int32)))
    p["trunc_st"] = _variant(root, "trunc_st", lambda d: _truncate(d / SHARD1, 5000))
    p["cfg_list"] = _variant(root, "cfg_list", lambda d: _edit_json(d / "config.json",
                                                                      lambda c: c.update(num_hidden_layers=[8])))
    p["cfg_str"] = _variant(root, "cfg_str", lambda d: _edit_json(d / "config.json",
                                                                    lambda c: c.update(hidden_size="384")))
    p["cfg_array"] = _variant(root, "cfg_array", lambda d: _edit_json(d / "config.json", lambda c: [c]))
    p["cfg_json"] = _variant(root, "cfg_json", lambda d: _own(d / "config.json").write_text('{"model_type": '))
    p["cfg_moe"] = _variant(root, "cfg_moe", lambda d: _edit_json(d / "config.json",
                                                                    lambda c: c.update(model_type="mixtral")))
    p["notok"] = _variant(root, "notok", lambda d: (d / "tokenizer.json").unlink())
    p["file"] = root / "a_file.txt"
    p["file"].write_text("not a model\n")
    p["prompts"] = root / "prompts.txt"
    p["prompts"].write_text("".join(f"Q: {1000 + 7 * i}+{20 + i}\n\n" for i in range(24)))
    p["empty_prompts"] = root / "empty.txt"
    p["empty_prompts"].write_text("\n\n\n")
    p["existing_out"] = root / "existing.jsonl"
    p["existing_out"].write_text('{"old": true}\n')
    p["plain_dir"] = root / "plain_dir"
    p["plain_dir"].mkdir()
    (p["plain_dir"] / "keep.txt").write_text("precious\n")

    from jaxlp.cli import main

    q = root / "q"
    assert main(["quantize", "--model", str(p["reasoner"]), "--recipe", "w4a16-nvfp4", "--out", str(q), "--quiet"]) == 0
    p["q"] = q

    def q_variant(name, edit):
        d = root / name
        shutil.copytree(q, d)
        edit(d)
        return d

    def trunc_data(d):
        data = d / "params" / "arrays" / "ocdbt.process_0" / "d"
        biggest = max(data.iterdir(), key=lambda f: f.stat().st_size)
        _truncate(biggest, 1000)

    p["q_trunc"] = q_variant("q_trunc", trunc_data)
    p["q_meta"] = q_variant("q_meta", lambda d: _truncate(d / "params" / "arrays" / "_METADATA", 10))
    p["q_noarrays"] = q_variant("q_noarrays", lambda d: shutil.rmtree(d / "params" / "arrays"))
    p["q_marker_json"] = q_variant("q_marker_json", lambda d: _truncate(d / "jaxlp_model.json", 40))
    p["q_marker_types"] = q_variant("q_marker_types", lambda d: _edit_json(d / "jaxlp_model.json",
                                                                             lambda m: m.update(layers=[1, 2])))
    p["q_marker_shape"] = q_variant("q_marker_shape", lambda d: _edit_json(
        d / "jaxlp_model.json", lambda m: m["config"].update(vocab_size=m["config"]["vocab_size"] + 4)))
    p["q_existing"] = q_variant("q_existing", lambda d: None)
    p["models_parent"] = root / "models_parent"
    p["models_parent"].mkdir()
    p["nested_model"] = _variant(p["models_parent"], "inner", lambda d: None)
    return p


# ----------------------------------------------------------------------------- the table


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    argv: tuple  # "{name}" fields are filled from the workspace
    words: str  # expected in the error line
    status: int = 2
    keep: tuple = ("reasoner",)  # workspace entries that must be byte-identical afterwards
    absent: tuple = ()  # paths (relative to the workspace root) that must not exist afterwards
    api: Callable | None = None  # the same setting through the Python API: must raise ValueError(same message)
    process: bool = False  # run as ``python -m jaxlp.cli`` in a subprocess (else main(argv) in this process)


def _categorical(**kw):
    from jaxlp.sampling import Categorical

    return lambda: Categorical(**kw)


def _reset(**kw):
    from jaxlp.sampling import ReSETConfig

    return lambda: ReSETConfig(**kw)


GEN = ("generate", "--model", "{reasoner}", "--prompt", "Q: 12+34")
QUANT = ("quantize", "--model", "{reasoner}", "--recipe", "w4a16-nvfp4")

CASES = [
    # sampler settings: every range edge (checked before the weights load, by the sampler classes)
    Case("temperature-negative", GEN + ("--sampler", "temperature", "--temperature", "-1"),
         "temperature must be a finite number >= 0 (0 means greedy), got -1.0",
         api=_categorical(temperature=-1.0), process=True),
    Case("temperature-nan", GEN + ("--sampler", "temperature", "--temperature", "nan"), "temperature",
         api=_categorical(temperature=float("nan"))),
    Case("temperature-inf", GEN + ("--sampler", "temperature", "--temperature", "inf"), "got inf",
         api=_categorical(temperature=float("inf"))),
    Case("temperature-not-a-number", GEN + ("--temperature", "warm"), "invalid float value: 'warm'"),
    Case("top-p-zero", GEN + ("--sampler", "top-p", "--top-p", "0"), "top_p must be a finite number in (0, 1]",
         api=_categorical(top_p=0.0)),
    Case("top-p-above-one", GEN + ("--sampler", "top-p", "--top-p", "1.5"), "got 1.5", api=_categorical(top_p=1.5)),
    Case("top-p-negative", GEN + ("--sampler", "top-p", "--top-p", "-0.1"), "top_p", api=_categorical(top_p=-0.1)),
    Case("top-p-nan", GEN + ("--sampler", "top-p", "--top-p", "nan"), "top_p", api=_categorical(top_p=float("nan"))),
    Case("min-p-one", GEN + ("--sampler", "min-p", "--min-p", "1"), "min_p must be a finite number in [0, 1)",
         api=_categorical(min_p=1.0)),
    Case("min-p-two", GEN + ("--sampler", "min-p", "--min-p", "2"), "got 2.0", api=_categorical(min_p=2.0)),
    Case("min-p-negative", GEN + ("--sampler", "min-p", "--min-p", "-0.01"), "min_p", api=_categorical(min_p=-0.01)),
    Case("top-k-zero", GEN + ("--sampler", "top-k", "--top-k", "0"), "top_k must be an integer >= 1, got 0",
         api=_categorical(top_k=0)),
    Case("top-k-negative", GEN + ("--sampler", "top-k", "--top-k", "-3"), "top_k", api=_categorical(top_k=-3)),
    Case("top-k-fraction", GEN + ("--sampler", "top-k", "--top-k", "1.5"), "invalid int value: '1.5'"),
    Case("t-low-negative", GEN + ("--sampler", "reset", "--t-low", "-0.1", "--tau0", "0.5"), "t_low",
         api=_reset(t_low=-0.1, tau0=0.5)),
    Case("tau0-nan", GEN + ("--sampler", "reset", "--t-low", "0.1", "--tau0", "nan"), "tau0",
         api=_reset(t_low=0.1, tau0=float("nan"))),
    Case("t-high-inf", GEN + ("--sampler", "reset", "--t-low", "0.1", "--tau0", "0.5", "--t-high", "inf"), "t_high",
         api=_reset(t_low=0.1, tau0=0.5, t_high=float("inf"))),
    Case("reset-top-p", GEN + ("--sampler", "reset", "--t-low", "0.1", "--tau0", "0.5", "--top-p", "1.01"), "top_p",
         api=_reset(t_low=0.1, tau0=0.5, top_p=1.01)),
    Case("reset-without-tau0", GEN + ("--sampler", "reset"), "--t-low and --tau0"),
    Case("unknown-preset", GEN + ("--sampler", "reset", "--preset", "Llama-9B"), "no ReSET preset"),
    Case("unknown-sampler", GEN + ("--sampler", "nucleus"), "invalid choice: 'nucleus'"),
    Case("unknown-kv-cache", GEN + ("--kv-cache", "int3"), "invalid choice: 'int3'"),
    # lengths
    Case("max-new-tokens-zero", GEN + ("--max-new-tokens", "0"), "max_new_tokens must be an integer in [1, 1023]"),
    Case("max-new-tokens-beyond-context", GEN + ("--max-new-tokens", "5000"), "got 5000"),
    Case("prompt-beyond-context", ("generate", "--model", "{reasoner}", "--prompt", "1" * 1100),
         "exceeds the context length 1024"),
    Case("prompt-empty", ("generate", "--model", "{reasoner}", "--prompt", "  "), "the prompt is empty"),
    Case("batch-size-zero", GEN + ("--batch-size", "0"), "must be an integer >= 1, got 0"),
    Case("calibration-length-beyond-context", QUANT[:4] + ("w4a4-nvfp4", "--out", "{root}/out_cl",
                                                           "--calibration-length", "5000"),
         "--calibration-length must be an integer in [1, 1024]", absent=("out_cl",)),
    Case("calibration-length-negative", QUANT[:4] + ("w4a4-nvfp4", "--out", "{root}/out_cln",
                                                     "--calibration-length", "-5"),
         "got -5", absent=("out_cln",)),
    Case("calibration-sequences-zero", QUANT[:4] + ("w4a4-nvfp4", "--out", "{root}/out_cs",
                                                    "--calibration-sequences", "0"),
         "--calibration-sequences must be an integer >= 1", absent=("out_cs",)),
    Case("demo-zero-problems", ("demo", "--problems", "0"), "num_problems must be an integer >= 1", keep=()),
    Case("tau0-zero-prompts", ("calibrate-tau0", "--model", "{reasoner}", "--num-prompts", "0"),
         "--num-prompts must be an integer >= 1"),
    Case("tau0-zero-new-tokens", ("calibrate-tau0", "--model", "{reasoner}", "--max-new-tokens", "0"),
         "max_new_tokens must be an integer"),
    # files and folders
    Case("model-missing", ("generate", "--model", "{root}/nope", "--prompt", "x"), "does not exist", keep=()),
    Case("model-is-a-file", ("generate", "--model", "{file}", "--prompt", "x"), "is a file, not a model directory",
         keep=("file",)),
    Case("info-model-is-a-file", ("info", "--model", "{file}"), "is a file", keep=("file",)),
    Case("demo-model-is-a-file", ("demo", "--model", "{file}"), "is a file", keep=("file",)),
    Case("prompts-file-missing", ("generate", "--model", "{reasoner}", "--prompts-file", "{root}/nope.txt"),
         "does not exist"),
    Case("prompts-file-is-a-folder", ("generate", "--model", "{reasoner}", "--prompts-file", "{plain_dir}"),
         "is a directory, not a text file", keep=("reasoner", "plain_dir")),
    Case("prompts-file-empty", ("generate", "--model", "{reasoner}", "--prompts-file", "{empty_prompts}"),
         "holds no prompt"),
    Case("generate-out-is-a-folder", GEN + ("--out", "{plain_dir}"), "is a directory", keep=("reasoner", "plain_dir")),
    Case("generate-out-exists", GEN + ("--out", "{existing_out}"), "exists (pass --overwrite",
         keep=("reasoner", "existing_out")),
    Case("generate-out-under-a-file", GEN + ("--out", "{file}/out.jsonl"), "is a file, not a directory",
         keep=("reasoner", "file")),
    # damaged checkpoints: Hugging Face
    Case("nan-weights", ("generate", "--model", "{nan}", "--prompt", "Q: 1+2"),
         "tensor 'model.embed_tokens.weight' holds 7 NaN", keep=("nan",), process=True),
    Case("inf-weights", ("generate", "--model", "{inf}", "--prompt", "Q: 1+2"), "holds 0 NaN and 1 Inf", keep=("inf",)),
    Case("nan-weights-unchecked", ("generate", "--model", "{nan}", "--prompt", "Q: 1+2", "--no-check"),
         "NaN or Inf logits at decode step 0 of prompt 0", keep=("nan",)),
    Case("nan-weights-quantize", ("quantize", "--model", "{nan}", "--recipe", "w4a16-nvfp4", "--out", "{root}/out_nan"),
         "NaN", keep=("nan",), absent=("out_nan",)),
    Case("truncated-safetensors", ("generate", "--model", "{trunc_st}", "--prompt", "x"),
         "cannot read safetensors file, it is truncated", keep=("trunc_st",)),
    Case("truncated-safetensors-info", ("info", "--model", "{trunc_st}"), "truncated", keep=("trunc_st",)),
    Case("wrong-shape-tensor", ("generate", "--model", "{shape}", "--prompt", "x"),
         "has shape (100, 383), expected (100, 384)", keep=("shape",)),
    Case("wrong-dtype-tensor", ("generate", "--model", "{int}", "--prompt", "x"),
         "has dtype int32, expected a floating-point dtype", keep=("int",)),
    Case("config-list-value", ("info", "--model", "{cfg_list}"), "num_hidden_layers must be an integer >= 1, got [8]",
         keep=("cfg_list",)),
    Case("config-string-value", ("generate", "--model", "{cfg_str}", "--prompt", "x"),
         "hidden_size must be an integer >= 1, got '384'", keep=("cfg_str",)),
    Case("config-not-an-object", ("info", "--model", "{cfg_array}"), "expected a JSON object, got a list",
         keep=("cfg_array",)),
    Case("config-corrupt-json", ("info", "--model", "{cfg_json}"), "corrupt JSON", keep=("cfg_json",)),
    Case("config-unsupported", ("info", "--model", "{cfg_moe}"), "unsupported architecture", keep=("cfg_moe",)),
    Case("no-tokenizer", ("generate", "--model", "{notok}", "--prompt", "x"), "no tokenizer.json", keep=("notok",)),
    # damaged checkpoints: quantized (Orbax data and the jaxlp_model.json marker)
    Case("truncated-orbax-data", ("generate", "--model", "{q_trunc}", "--prompt", "x"),
         "under arrays/ is truncated", keep=("q_trunc",), process=True),
    Case("truncated-orbax-data-info", ("info", "--model", "{q_trunc}"), "is truncated", keep=("q_trunc",)),
    Case("truncated-orbax-metadata", ("info", "--model", "{q_meta}"), "array metadata", keep=("q_meta",)),
    Case("missing-orbax-data", ("generate", "--model", "{q_noarrays}", "--prompt", "x"),
         "array data directory arrays/ is missing", keep=("q_noarrays",)),
    Case("marker-corrupt-json", ("generate", "--model", "{q_marker_json}", "--prompt", "x"),
         "corrupt jaxlp_model.json", keep=("q_marker_json",)),
    Case("marker-wrong-types", ("info", "--model", "{q_marker_types}"), "corrupt jaxlp_model.json",
         keep=("q_marker_types",)),
    Case("marker-config-disagrees", ("generate", "--model", "{q_marker_shape}", "--prompt", "x"),
         "has shape (100, 384) but the config in jaxlp_model.json gives (104, 384)", keep=("q_marker_shape",)),
    # outputs that would clobber something
    Case("out-is-model", QUANT + ("--out", "{reasoner}"), "is the source checkpoint"),
    Case("out-is-model-overwrite", QUANT + ("--out", "{reasoner}", "--overwrite"), "is the source checkpoint"),
    Case("out-holds-model", ("quantize", "--model", "{nested_model}", "--recipe", "w4a16-nvfp4", "--out",
                             "{models_parent}", "--overwrite"), "or holds it", keep=("models_parent",)),
    Case("out-is-a-file", QUANT + ("--out", "{file}"), "is a file: the output is a directory",
         keep=("reasoner", "file")),
    Case("out-under-a-file", QUANT + ("--out", "{file}/q"), "is a file, so", keep=("reasoner", "file")),
    Case("out-not-a-checkpoint", QUANT + ("--out", "{plain_dir}", "--overwrite"), "refusing to overwrite",
         keep=("reasoner", "plain_dir")),
    Case("out-exists", QUANT + ("--out", "{q_existing}"), "exists and is not empty", keep=("reasoner", "q_existing"),
         process=True),
    Case("unknown-recipe", QUANT[:4] + ("w2a2", "--out", "{root}/out_r"), "invalid choice: 'w2a2'",
         absent=("out_r",)),
    # usage
    Case("no-command", (), "the following arguments are required: COMMAND", keep=()),
    Case("unknown-option", GEN + ("--temprature", "0.5"), "unrecognized arguments: --temprature", process=True),
    Case("missing-model", ("generate", "--prompt", "x"), "the following arguments are required: --model", keep=()),
]


def _fill(argv, ws):
    return [str(a).format(**{k: v for k, v in ws.items()}) for a in argv]


def check_clean_failure(proc, status: int, words: str) -> str:
    """The assertions every case shares; returns the error line."""
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert proc.returncode == status, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("jaxlp: error:")]
    assert len(errors) == 1, proc.stderr
    assert words in errors[0], errors[0]
    others = [line for line in lines if not line.startswith("jaxlp: ")]
    assert not others, proc.stderr  # status lines only, no library noise
    return errors[0]


def test_enough_cases():
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)
    assert 4 <= sum(c.process for c in CASES) <= 8  # a few through a real process, the rest in this one


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(ws, main_in_process, case):
    keep = {k: tree_hash(Path(ws[k])) for k in case.keep}
    proc = (_cli if case.process else main_in_process)(_fill(case.argv, ws), ws["cwd"])
    line = check_clean_failure(proc, case.status, case.words)
    for k, before in keep.items():
        assert tree_hash(Path(ws[k])) == before, f"{k} changed"
    for rel in case.absent:
        assert not (ws["root"] / rel).exists(), rel
    leftovers = [p.name for p in ws["root"].iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert not leftovers, leftovers
    if case.api is not None:  # the Python API: the same ValueError, the same message
        with pytest.raises(ValueError) as raised:
            case.api()
        assert line == f"jaxlp: error: {raised.value}"


# ----------------------------------------------------------------------------- the same through generate()


@pytest.fixture(scope="module")
def reasoner_model():
    import jax.numpy as jnp

    import jaxlp

    return jaxlp.from_pretrained(REASONER, dtype=jnp.float32)


@pytest.mark.parametrize("kwargs, cli", [
    (dict(max_new_tokens=0), ("--max-new-tokens", "0")),
    (dict(max_new_tokens=2000), ("--max-new-tokens", "2000")),
])
def test_generate_settings_same_message_as_cli(ws, main_in_process, reasoner_model, kwargs, cli):
    import jaxlp

    with pytest.raises(ValueError) as raised:
        jaxlp.generate(reasoner_model, [[1, 5, 6]], **kwargs)
    proc = main_in_process(_fill(GEN + cli, ws), ws["cwd"])
    assert check_clean_failure(proc, 2, "max_new_tokens") == f"jaxlp: error: {raised.value}"


def test_api_check_finite_escape(ws):
    """from_pretrained refuses the NaN checkpoint; check_finite=False loads it (as --no-check)."""
    import jaxlp
    from jaxlp.errors import CheckpointFormatError, NonFiniteLogitsError, NonFiniteWeightsError

    with pytest.raises(NonFiniteWeightsError, match="7 NaN") as raised:
        jaxlp.from_pretrained(ws["nan"])
    assert isinstance(raised.value, CheckpointFormatError)
    model = jaxlp.from_pretrained(ws["nan"], check_finite=False)
    with pytest.raises(NonFiniteLogitsError) as raised:
        jaxlp.generate(model, [[1, 5, 6]], max_new_tokens=4)
    assert (raised.value.step, raised.value.row) == (0, 0)


# ----------------------------------------------------------------------------- interrupts


def _interrupt(args, ws, wait_for: str, timeout: float = 120):
    """Start the CLI, send SIGINT once ``wait_for`` shows on stderr, return (status, stdout, stderr)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "jaxlp.cli", *_fill(args, ws)], cwd=ws["cwd"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    deadline = time.monotonic() + timeout
    for line in proc.stderr:
        seen.append(line)
        if wait_for in line:
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)
            break
        assert time.monotonic() < deadline, "".join(seen)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, "".join(seen) + err


INTERRUPTS = [
    ("quantize-new", ("quantize", "--model", "{reasoner}", "--recipe", "w4a4-nvfp4", "--out", "{root}/out_int",
                      "--calibration-sequences", "64", "--calibration-length", "512"),
     "calibrating activation scales", ("reasoner",), ("out_int",)),
    ("quantize-overwrite", ("quantize", "--model", "{reasoner}", "--recipe", "w4a4-nvfp4", "--out", "{q_existing}",
                            "--overwrite", "--calibration-sequences", "64", "--calibration-length", "512"),
     "calibrating activation scales", ("reasoner", "q_existing"), ()),
    ("generate", ("generate", "--model", "{reasoner}", "--prompts-file", "{prompts}", "--batch-size", "1",
                  "--max-new-tokens", "600", "--out", "{root}/gen_int.jsonl"),
     "generating up to", ("reasoner", "prompts"), ("gen_int.jsonl",)),
]


@pytest.mark.parametrize("args, wait_for, keep, absent", [i[1:] for i in INTERRUPTS], ids=[i[0] for i in INTERRUPTS])
def test_interrupt(ws, args, wait_for, keep, absent):
    before = {k: tree_hash(Path(ws[k])) for k in keep}
    status, out, err = _interrupt(args, ws, wait_for)
    assert "Traceback" not in out + err, err
    assert status == 130, err
    assert err.rstrip().splitlines()[-1] == "interrupted", err
    for k, h in before.items():
        assert tree_hash(Path(ws[k])) == h, f"{k} changed"
    for rel in absent:
        assert not (ws["root"] / rel).exists(), rel
    assert not [p.name for p in ws["root"].iterdir() if ".tmp-" in p.name or ".old-" in p.name]


# ----------------------------------------------------------------------------- good input, for contrast


def test_prompt_and_prompts_file_agree(ws, main_in_process, tmp_path):
    """The trailing-newline rule: --prompt with or without it and a --prompts-file line give one text
    (the first run as a subprocess: with --quiet, a fresh process prints nothing on stderr)."""
    one = tmp_path / "one.txt"
    one.write_text("Q: 4071+2289")
    runs = [
        (_cli, "--prompt", "Q: 4071+2289"),
        (main_in_process, "--prompt", "Q: 4071+2289\n"),
        (main_in_process, "--prompts-file", str(one)),
    ]
    outs = []
    for run, flag, value in runs:
        proc = run(["generate", "--model", ws["reasoner"], flag, value, "--max-new-tokens", "60", "--quiet"],
                   ws["cwd"])
        assert proc.returncode == 0 and not proc.stderr, proc.stderr
        outs.append(proc.stdout)
    assert outs[0] == outs[1] == outs[2] and "Answer: 6360" in outs[0], outs


def test_from_any_directory_and_version(ws, tmp_path):
    """A folder named jaxlp in the working directory (the clone's parent) does not shadow the package."""
    (tmp_path / "jaxlp").mkdir()
    proc = _cli(["info", "--model", ws["q"]], tmp_path)
    assert proc.returncode == 0, proc.stderr
    for words in ("context length", "1,024", "w4a16-nvfp4", "bytes per parameter", "KV cache formats", "kitty"):
        assert words in proc.stdout, proc.stdout
    proc = _cli(["--version"], tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("jaxlp ")


def test_help_shows_defaults_and_registry_choices(ws, main_in_process):
    from jaxlp import kvcache
    from jaxlp.quantization import RECIPES

    gen = " ".join(main_in_process(["generate", "--help"], ws["cwd"]).stdout.split())
    quant = " ".join(main_in_process(["quantize", "--help"], ws["cwd"]).stdout.split())
    assert all(name in gen for name in kvcache.formats())
    assert all(name in quant for name in RECIPES)
    assert "(default: 64)" in gen and "(default: 512)" in quant and "default: 0.95" in gen
