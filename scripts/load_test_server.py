"""Load test of the OpenAI-compatible server on loopback: ``--clients`` concurrent clients send
``--requests`` requests, well-formed ones (completions and chat, streamed or not, some streams
closed after their first event: cancellations) mixed with malformed ones, then the server is
checked: every well-formed request answered in full, every malformed one refused with a 400
naming the problem, no slot or cache byte held once idle (its Prometheus ``/metrics``), still
healthy (``/health``).

Well-formed requests go through the official ``openai`` client; malformed ones and
cancellations through ``httpx`` (raw bodies, a stream closed mid-way). Request ``i`` draws its
kind, prompt, token budget and sampler from ``--seed`` + i, so a run is reproducible.

By default the script serves the embedded reasoner itself (uvicorn in a thread, 127.0.0.1, a free
port; CPU is fine); ``--url`` drives a server already running instead (e.g. ``jaxlp serve`` on a
GPU). Results: a table, and JSON (``--out``).

    python scripts/load_test_server.py --requests 1000 --clients 64 --out docs/load_test_server.json
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import random
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxlp.evals import harness  # noqa: E402

QUESTIONS = ("Q: 12+34\n", "Q: 7*8+5\n", "Q: 99-3*4\n", "Q: 5\n", "Q: 123+456+789\n", "Q: 2*3*4\n")
# Request kinds and their shares of a run.
KINDS = {"completion": 3, "chat": 2, "stream": 2, "cancel": 1, "malformed": 2}
# Malformed requests: (what is wrong, the body as sent). Each must get a 400.
MALFORMED = (
    ("not JSON", b"{\"prompt\": "),
    ("top_p < 0", {"prompt": "Q: 1\n", "top_p": -1}),
    ("max_tokens 0", {"prompt": "Q: 1\n", "max_tokens": 0}),
    ("empty prompt", {"prompt": "", "max_tokens": 2}),
    ("n > 1", {"prompt": "Q: 1\n", "n": 2}),
    ("prompt past the context", {"prompt": "Q: " + "1+" * 70000 + "1\n", "max_tokens": 2}),
    ("max_tokens a string", {"prompt": "Q: 1\n", "max_tokens": "four"}),
)


def start_server(model, tokenizer, *, model_id: str = "reasoner", chat_template=None, **engine_kwargs):
    """Serve ``model`` on 127.0.0.1 (a free port) from a thread: ``(url, engine loop, stop)``;
    ``engine_kwargs`` go to :class:`jaxlp.serving.Engine` (warmed up on 16- and 32-token prompts)."""
    import uvicorn

    from jaxlp.serving.server import warm_app

    app, loop = warm_app(model, tokenizer, model_id=model_id, chat_template=chat_template, warmup_lengths=(16, 32),
                         **engine_kwargs)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            loop.stop()
            raise RuntimeError("the server did not start")
        time.sleep(0.02)

    def stop():
        server.should_exit = True
        thread.join(10)
        loop.stop()

    return f"http://127.0.0.1:{port}", loop, stop


def plan(n: int, seed: int) -> list[dict]:
    """Request ``i``'s kind, prompt, token budget, temperature and seed (from ``seed + i``)."""
    kinds = [k for k, share in KINDS.items() for _ in range(share)]
    out = []
    for i in range(n):
        rng = random.Random(seed + i)
        out.append(dict(i=i, kind=rng.choice(kinds), prompt=rng.choice(QUESTIONS), max_tokens=rng.randint(1, 12),
                        temperature=rng.choice([0.0, 0.0, 1.0]), seed=seed + i,
                        malformed=rng.randrange(len(MALFORMED))))
    return out


def one_request(url: str, model_id: str, req: dict) -> dict:
    """Send one planned request and check its answer: ``{ok, kind, seconds, detail}``."""
    import openai

    kind = req["kind"]
    start = time.perf_counter()
    body = dict(model=model_id, max_tokens=req["max_tokens"], temperature=req["temperature"], seed=req["seed"])
    detail = ""
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        if kind == "completion":
            r = client.completions.create(prompt=req["prompt"], **body)
            ok, detail = _complete(r.choices[0].finish_reason, r.usage.completion_tokens, req["max_tokens"])
        elif kind == "chat":
            r = client.chat.completions.create(messages=[{"role": "user", "content": req["prompt"].strip()}], **body)
            ok, detail = _complete(r.choices[0].finish_reason, r.usage.completion_tokens, req["max_tokens"])
        elif kind == "stream":
            reasons = [c.choices[0].finish_reason for c in client.completions.create(prompt=req["prompt"],
                                                                                     stream=True, **body)]
            ok = bool(reasons) and reasons[-1] in ("stop", "length") and all(x is None for x in reasons[:-1])
            detail = f"finish reasons {reasons[-3:]}"
        elif kind == "cancel":  # a stream closed after its first event
            with httpx.Client(base_url=url, timeout=300) as http:
                with http.stream("POST", "/v1/completions",
                                 json=dict(body, prompt=req["prompt"], stream=True, max_tokens=40)) as r:
                    first = next(line for line in r.iter_lines() if line.startswith("data: "))
                    ok, detail = r.status_code == 200 and first != "data: [DONE]", f"status {r.status_code}"
        else:
            what, bad = MALFORMED[req["malformed"]]
            with httpx.Client(base_url=url, timeout=300) as http:
                if isinstance(bad, bytes):
                    r = http.post("/v1/completions", content=bad, headers={"content-type": "application/json"})
                else:
                    r = http.post("/v1/completions", json=dict(bad, model=model_id))
            is_json = r.headers.get("content-type", "").startswith("application/json")
            error = r.json().get("error", {}) if is_json else {}
            ok = r.status_code == 400 and error.get("type") == "invalid_request_error" and bool(error.get("message"))
            detail = f"{what}: status {r.status_code}, {error.get('message', r.text[:80])!r}"
    except Exception as e:  # noqa: BLE001  (a failed request is a result, not the end of the run)
        ok, detail = False, f"{type(e).__name__}: {str(e)[:200]}"
    return dict(i=req["i"], kind=kind, ok=bool(ok), seconds=time.perf_counter() - start, detail=detail)


def _complete(reason, tokens: int, budget: int) -> tuple[bool, str]:
    ok = (reason == "length" and tokens == budget) or (reason == "stop" and 1 <= tokens <= budget)
    return ok, f"finish {reason}, {tokens} of {budget} tokens"


def scrape(url: str) -> dict[str, float]:
    """The server's Prometheus metrics, ``{name or name{labels}: value}`` (histogram series left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            if not s.name.endswith(("_bucket", "_created")):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return values


def wait_idle(url: str, timeout: float = 120.0) -> dict[str, float]:
    """Metrics once nothing runs or waits (cancelled streams finish at the engine's next step)."""
    deadline = time.time() + timeout
    while True:
        m = scrape(url)
        if (m.get("jaxlp_running_slots") == 0 and m.get("jaxlp_queue_length") == 0) or time.time() > deadline:
            return m
        time.sleep(0.1)


def run(url: str, model_id: str, requests: int, clients: int, seed: int = 0, progress: bool = True) -> dict:
    """The load test against ``url`` (module doc): per-request results and the server's state after."""
    from tqdm import tqdm

    before = scrape(url)
    reqs = plan(requests, seed)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(one_request, url, model_id, r) for r in reqs]
        results = [f.result() for f in tqdm(futures, desc="requests", disable=not progress, file=sys.stderr)]
    duration = time.perf_counter() - start
    after = wait_idle(url)
    health = httpx.get(url + "/health", timeout=30)
    by_kind = collections.defaultdict(list)
    for r in results:
        by_kind[r["kind"]].append(r)
    finished = {reason: after.get(f"jaxlp_requests_total{{finish_reason={reason}}}", 0)
                - before.get(f"jaxlp_requests_total{{finish_reason={reason}}}", 0)
                for reason in ("stop", "length", "cancelled", "error")}
    return dict(
        url=url, requests=requests, clients=clients, seed=seed, duration_s=duration,
        kinds={k: dict(count=len(v), failed=sum(not r["ok"] for r in v),
                       p50_s=float(np.median([r["seconds"] for r in v])),
                       p99_s=float(np.percentile([r["seconds"] for r in v], 99))) for k, v in sorted(by_kind.items())},
        failed=[r for r in results if not r["ok"]],
        finished_by_reason=finished,
        idle=dict(running=after.get("jaxlp_running_slots"), waiting=after.get("jaxlp_queue_length"),
                  cache_bytes_in_use=after.get("jaxlp_cache_bytes_in_use")),
        healthy=health.status_code == 200 and health.json() == {"status": "ok"},
    )


def passed(summary: dict) -> bool:
    """Every request as expected, nothing held once idle, still healthy."""
    idle = summary["idle"]
    return (not summary["failed"] and summary["healthy"] and idle["running"] == 0 and idle["waiting"] == 0
            and idle["cache_bytes_in_use"] == 0 and summary["finished_by_reason"]["error"] == 0)


def report(summary: dict) -> None:
    print(f"\n{summary['requests']} requests from {summary['clients']} clients in {summary['duration_s']:.1f} s "
          f"({summary['url']})")
    print(f"{'kind':12s} {'count':>6s} {'failed':>6s} {'p50 s':>7s} {'p99 s':>7s}")
    for kind, k in summary["kinds"].items():
        print(f"{kind:12s} {k['count']:6d} {k['failed']:6d} {k['p50_s']:7.2f} {k['p99_s']:7.2f}")
    print(f"engine finish reasons: {summary['finished_by_reason']}; after the run: {summary['idle']}; "
          f"healthy: {summary['healthy']}")
    for r in summary["failed"][:10]:
        print(f"FAILED request {r['i']} ({r['kind']}): {r['detail']}")
    print("PASSED" if passed(summary) else "FAILED")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: serve the embedded reasoner here)")
    ap.add_argument("--model-id", default="reasoner", help="the model name the server reports")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slots", type=int, default=8, help="slots of the engine this script serves")
    ap.add_argument("--out", default=None, help="JSON of the summary")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    stop = None
    url = args.url
    if url is None:
        from importlib.resources import files

        import jax.numpy as jnp

        import jaxlp
        from jaxlp.models.tokenizer import load_tokenizer
        from jaxlp.serving.chat import ChatTemplate

        reasoner = files("jaxlp") / "assets" / "reasoner"
        model = jaxlp.from_pretrained(reasoner, dtype=jnp.float32)
        url, _, stop = start_server(model, load_tokenizer(reasoner), model_id=args.model_id,
                                    chat_template=ChatTemplate.from_model_dir(reasoner), max_len=96,
                                    slots=args.slots, steps_per_call=2, max_waiting=max(64, args.clients))
    try:
        summary = run(url, args.model_id, args.requests, args.clients, args.seed, progress=not args.no_progress)
    finally:
        if stop is not None:
            stop()
    summary["passed"] = passed(summary)
    if args.out:
        harness.write_json(args.out, dict(harness.run_metadata(argv), **summary))
    report(summary)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
