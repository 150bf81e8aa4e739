"""``jaxlp serve`` as a user runs it: a subprocess on 127.0.0.1, the openai client, Ctrl-C; and
its bad inputs (one line on stderr, exit status 2, no traceback)."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

REASONER = Path(__file__).resolve().parents[2] / "jaxlp" / "assets" / "reasoner"
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "jaxlp.cli", "serve", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=ENV, cwd=REASONER.parents[2])


def test_serve_answers_the_openai_client_then_stops_on_ctrl_c():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jaxlp.cli", "serve", "--model", REASONER, "--dtype", "float32",
                             "--max-len", "48", "--slots", "2", "--port", str(port), "--model-id", "reasoner"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "the server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        response = client.completions.create(model="reasoner", prompt="Q: 2+3\n", max_tokens=6, temperature=0)
        assert response.usage.completion_tokens >= 1 and response.choices[0].finish_reason in ("stop", "length")
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stdout + stderr
    assert stderr.strip().splitlines()[-1] == "interrupted"


def start(*args, env=ENV):
    """``jaxlp serve`` in a subprocess on a free port; (process, openai client) once /health answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jaxlp.cli", "serve", *map(str, args), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 240
    while True:
        if proc.poll() is not None:
            raise AssertionError(proc.communicate())
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise AssertionError(("the server did not come up", proc.communicate()))
        time.sleep(0.2)
    return proc, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)


def test_serve_over_two_devices_with_fused_projections_answers_as_one_device():
    """--tp 2 --fuse-projections on 2 simulated CPU devices: greedy completions equal jaxlp.generate
    on the one-device model."""
    import jax.numpy as jnp

    import jaxlp
    from jaxlp.models.tokenizer import load_tokenizer

    env = dict(ENV, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc, client = start("--model", REASONER, "--dtype", "float32", "--max-len", "48", "--slots", "2", "--tp", "2",
                         "--fuse-projections", "--kv-cache", "kitty-pro", "--model-id", "reasoner", env=env)
    try:
        model, tokenizer = jaxlp.from_pretrained(REASONER, dtype=jnp.float32), load_tokenizer(REASONER)
        for question in ("Q: 12+34\n", "Q: 7*8+5\n"):
            response = client.completions.create(model="reasoner", prompt=question, max_tokens=12, temperature=0)
            ids = jaxlp.generate(model, [tokenizer.encode(question).ids], max_new_tokens=12,
                                 kv_cache="kitty-pro").sequences()[0]
            want = tokenizer.decode(ids[:-1] if ids and ids[-1] == 2 else ids, skip_special_tokens=True)
            assert response.choices[0].text == want
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr


@pytest.mark.parametrize("args, message", [
    (["--port", "-1"], "--port"),
    (["--max-len", "100000"], "--max-len"),
    (["--max-len", "1"], "--max-len"),
    (["--cache-gib", "0"], "--cache-gib"),
    (["--recipe", "w4a4-nvfp4"], "quantize with jaxlp quantize first"),
    (["--host", "no-such-host.invalid"], "--host"),
    (["--slo-tpot-ms", "0"], "--slo-tpot-ms must be > 0"),
    (["--slo-tpot-ms", "20", "--precision", "auto"], "give one"),
    (["--precision", "fp8", "--port", "0", "--quiet"], "no NestedFP layers"),  # found after loading
], ids=["port", "max-len-past-context", "max-len-1", "cache-gib", "static-recipe", "host", "slo-zero", "two-policies",
        "precision-not-nestedfp"])
def test_serve_bad_input(args, message):
    result = cli("--model", REASONER, *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxlp: error: ") and message in lines[0], result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_serve_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result = cli("--model", REASONER, "--port", busy.getsockname()[1])
    assert result.returncode == 2
    assert "cannot listen on 127.0.0.1:" in result.stderr and "Traceback" not in result.stderr


def test_serve_cache_budget_too_small():
    result = cli("--model", REASONER, "--cache-gib", "1e-9", "--port", free_port(), "--max-len", "64")
    assert result.returncode == 2, result.stderr
    assert "cache_budget_bytes" in result.stderr and "Traceback" not in result.stderr
