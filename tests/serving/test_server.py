"""The OpenAI-compatible server on 127.0.0.1, driven by the official ``openai`` client.

One server (uvicorn in a thread) over the embedded reasoner on the CPU, float32, serves every
test of the module; completions are checked against ``jaxlp.generate`` for the same prompt,
sampler and seed.
"""

import concurrent.futures
import json
import time
from importlib.resources import files

import httpx
import jax.numpy as jnp
import pytest
from conftest import load_script

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

import jaxlp  # noqa: E402
from jaxlp.models.tokenizer import load_tokenizer  # noqa: E402
from jaxlp.sampling import Categorical, Greedy  # noqa: E402
from jaxlp.serving import Engine, EngineLoop  # noqa: E402
from jaxlp.serving.chat import ChatTemplate  # noqa: E402
from jaxlp.serving.server import create_app  # noqa: E402

load_test = load_script("load_test_server")

REASONER = files("jaxlp") / "assets" / "reasoner"
MAX_LEN = 96
QUESTIONS = ["Q: 12+34\n", "Q: 7*8+5\n", "Q: 99-3*4\n", "Q: 5\n", "Q: 123+456+789\n", "Q: 2*3*4\n"]


@pytest.fixture(scope="module")
def served():
    """(base url, model, tokenizer, engine loop): the server runs for the module."""
    model = jaxlp.from_pretrained(REASONER, dtype=jnp.float32)
    tokenizer = load_tokenizer(REASONER)
    url, loop, stop = load_test.start_server(model, tokenizer, model_id="reasoner",
                                             chat_template=ChatTemplate.from_model_dir(REASONER), max_len=MAX_LEN,
                                             slots=3, steps_per_call=2, max_waiting=64)
    yield url, model, tokenizer, loop
    stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def expected_text(served, prompt_ids, *, max_tokens, sampler=None, seed=0):
    """(text, finish_reason) that jaxlp.generate gives for the prompt alone."""
    _, model, tokenizer, _ = served
    result = jaxlp.generate(model, [prompt_ids], max_new_tokens=max_tokens, sampler=sampler or Greedy(), seed=seed)
    ids = result.sequences()[0]
    stopped = bool(result.finished[0])
    return tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=True), ("stop" if stopped else "length")


def test_models_health_and_metrics(served, client):
    url = served[0]
    assert [m.id for m in client.models.list().data] == ["reasoner"]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    client.completions.create(model="reasoner", prompt=QUESTIONS[0], max_tokens=3, temperature=0)
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("jaxlp_queue_length", "jaxlp_running_slots", "jaxlp_cache_bytes_in_use", "jaxlp_generated_tokens",
                 "jaxlp_time_to_first_token_seconds", "jaxlp_time_per_output_token_seconds", "jaxlp_requests"):
        assert name in families, name
    generated = [s.value for s in families["jaxlp_generated_tokens"].samples if s.name.endswith("_total")]
    assert generated and generated[0] >= 3
    ttft_count = [s.value for s in families["jaxlp_time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert ttft_count[0] >= 1


def test_completion_matches_generate(served, client):
    _, _, tokenizer, _ = served
    for i, question in enumerate(QUESTIONS[:3]):
        ids = tokenizer.encode(question).ids
        response = client.completions.create(model="reasoner", prompt=question, max_tokens=24, temperature=0)
        text, reason = expected_text(served, ids, max_tokens=24)
        assert response.choices[0].text == text
        assert response.choices[0].finish_reason == reason
        assert response.usage.prompt_tokens == len(ids)
    # Sampled, with a seed; a prompt given as token ids.
    ids = tokenizer.encode(QUESTIONS[3]).ids
    response = client.completions.create(model="reasoner", prompt=ids, max_tokens=20, temperature=0.9, top_p=0.95,
                                         seed=11)
    text, _ = expected_text(served, ids, max_tokens=20, sampler=Categorical(temperature=0.9, top_p=0.95), seed=11)
    assert response.choices[0].text == text


def test_streaming_equals_non_streaming(served, client):
    kwargs = dict(model="reasoner", prompt=QUESTIONS[4], max_tokens=30, temperature=0.7, seed=5)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # tokens came in several events


def test_chat_completion(served, client):
    _, _, tokenizer, _ = served
    messages = [{"role": "user", "content": "Q: 12+34"}]
    response = client.chat.completions.create(model="reasoner", messages=messages, max_tokens=24, temperature=0)
    text, reason = expected_text(served, tokenizer.encode("Q: 12+34\n").ids, max_tokens=24)
    assert response.choices[0].message.content == text and response.choices[0].message.role == "assistant"
    assert response.choices[0].finish_reason == reason
    stream = client.chat.completions.create(model="reasoner", messages=messages, max_tokens=24, temperature=0,
                                            stream=True)
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == text


def test_stop_strings(served, client):
    full = client.completions.create(model="reasoner", prompt=QUESTIONS[1], max_tokens=30, temperature=0)
    text = full.choices[0].text
    stop = text[5:7]
    assert stop and stop in text
    cut = client.completions.create(model="reasoner", prompt=QUESTIONS[1], max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="reasoner", prompt=QUESTIONS[1], max_tokens=30, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text[: text.index(stop)]


def test_concurrent_requests_give_generate_tokens(served, client):
    """More requests than slots, greedy and sampled, at once: each as generate gives it alone."""
    _, _, tokenizer, _ = served
    jobs = [(q, t, seed) for seed, (q, t) in enumerate((q, t) for q in QUESTIONS for t in (0.0, 0.8))]

    def ask(job):
        question, temperature, seed = job
        return client.completions.create(model="reasoner", prompt=question, max_tokens=16, temperature=temperature,
                                         seed=seed).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(ask, jobs))
    for (question, temperature, seed), text in zip(jobs, texts):
        sampler = Greedy() if temperature == 0 else Categorical(temperature=temperature)
        assert text == expected_text(served, tokenizer.encode(question).ids, max_tokens=16, sampler=sampler,
                                     seed=seed)[0]


BAD_REQUESTS = [
    # (endpoint, body, status, param)
    ("completions", b"{not json", 400, None),
    ("completions", b"[1, 2]", 400, None),
    ("completions", {"max_tokens": 4}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": 5}, 400, "prompt"),
    ("completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("completions", {"prompt": [1, 10**6]}, 400, "prompt"),
    ("completions", {"prompt": ["Q: 1\n", "Q: 2\n"]}, 400, "prompt"),
    ("completions", {"prompt": "Q: 1\n", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "Q: 1\n", "max_tokens": "8"}, 400, "max_tokens"),
    ("completions", {"prompt": "Q: 1\n", "max_tokens": 2.5}, 400, "max_tokens"),
    ("completions", {"prompt": "Q: 1\n", "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ("completions", {"prompt": "Q: 1+1" * 40 + "\n"}, 400, "prompt"),
    ("completions", {"prompt": "Q: 1\n", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "Q: 1\n", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "Q: 1\n", "temperature": 3}, 400, "temperature"),
    ("completions", {"prompt": "Q: 1\n", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "Q: 1\n", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "Q: 1\n", "min_p": 1}, 400, "min_p"),
    ("completions", {"prompt": "Q: 1\n", "seed": "x"}, 400, "seed"),
    ("completions", {"prompt": "Q: 1\n", "n": 2}, 400, "n"),
    ("completions", {"prompt": "Q: 1\n", "best_of": 3}, 400, "best_of"),
    ("completions", {"prompt": "Q: 1\n", "logprobs": 2}, 400, "logprobs"),
    ("completions", {"prompt": "Q: 1\n", "echo": True}, 400, "echo"),
    ("completions", {"prompt": "Q: 1\n", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("completions", {"prompt": "Q: 1\n", "logit_bias": {"5": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "Q: 1\n", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("completions", {"prompt": "Q: 1\n", "stop": [3]}, 400, "stop"),
    ("completions", {"prompt": "Q: 1\n", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "Q: 1\n", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ("completions", {"prompt": "Q: 1\n", "reset": {"t_low": 0.1}}, 400, "reset"),
    ("completions", {"prompt": "Q: 1\n", "reset": {"preset": "no-such-model"}}, 400, "reset"),
    ("completions", {"prompt": "Q: 1\n", "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Q: 1"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Q: 1"}], "tools": [{"type": "function"}]}, 400,
     "tools"),
]


@pytest.mark.parametrize("endpoint, body, status, param", BAD_REQUESTS,
                         ids=[f"{i}-{b if isinstance(b, bytes) else sorted(b)}" for i, (_, b, _, _) in
                              enumerate(BAD_REQUESTS)])
def test_bad_request(served, endpoint, body, status, param):
    url = f"{served[0]}/v1/{endpoint}"
    response = httpx.post(url, content=body if isinstance(body, bytes) else json.dumps(body),
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert error["type"] == "invalid_request_error"
    assert httpx.get(served[0] + "/health").status_code == 200


def test_unknown_fields_are_ignored_and_neutral_values_accepted(served, client):
    response = client.completions.create(model="reasoner", prompt=QUESTIONS[0], max_tokens=3, temperature=0, n=1,
                                         logprobs=None, presence_penalty=0, extra_body={"some_new_field": [1, 2]})
    assert response.usage.completion_tokens == 3


def test_reset_sampler_request(served, client):
    response = client.completions.create(model="reasoner", prompt=QUESTIONS[2], max_tokens=20, seed=4,
                                         extra_body={"reset": {"t_low": 0.3, "tau0": 0.5}})
    _, _, tokenizer, loop = served
    from jaxlp.sampling import ReSETConfig

    sampler = ReSETConfig.from_tokenizer(tokenizer, 0.3, 0.5, top_p=0.95)
    text, _ = expected_text(served, tokenizer.encode(QUESTIONS[2]).ids, max_tokens=20, sampler=sampler, seed=4)
    assert response.choices[0].text == text


def _wait_idle(loop, timeout=60):
    deadline = time.time() + timeout
    while loop.engine.num_running or loop.engine.num_waiting:
        assert time.time() < deadline, "slots were not freed"
        time.sleep(0.05)


def test_cancel_mid_stream_frees_the_slot(served, client):
    _, _, _, loop = served
    before = loop.engine.counters["requests_cancelled"]
    stream = client.completions.create(model="reasoner", prompt=QUESTIONS[0], max_tokens=MAX_LEN - 16, temperature=0,
                                       stream=True)
    next(iter(stream))
    stream.close()  # the client goes away mid-generation
    deadline = time.time() + 60
    while loop.engine.counters["requests_cancelled"] == before:
        assert time.time() < deadline, "the request was not cancelled"
        time.sleep(0.05)
    _wait_idle(loop)
    assert loop.engine.stats()["cache_bytes_in_use"] == 0


def test_full_queue_answers_503(served):
    url, model, tokenizer, _ = served
    engine = Engine(model, max_len=MAX_LEN, slots=1, tokenizer=tokenizer, max_waiting=0)
    loop = EngineLoop(engine)  # not started: the first request holds the only slot's place
    app = create_app(loop, tokenizer, model_id="reasoner")
    from fastapi.testclient import TestClient

    loop.submit([1, 5, 6], None)
    with TestClient(app) as test_client:
        response = test_client.post("/v1/completions", json={"prompt": "Q: 1\n", "max_tokens": 2})
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "server_error"


def test_load_with_cancellations_and_bad_requests(served):
    """scripts/load_test_server.py's run at 64 concurrent clients, 160 requests: well-formed ones
    (completions and chat, streamed or not, some streams closed early) mixed with malformed ones;
    every well-formed one answered, every malformed one a 400, nothing held after, still healthy."""
    url, _, _, loop = served
    summary = load_test.run(url, "reasoner", 160, 64, seed=0, progress=False)
    assert summary["failed"] == [], summary["failed"][:5]
    assert set(summary["kinds"]) == set(load_test.KINDS) and summary["finished_by_reason"]["cancelled"] > 0
    assert load_test.passed(summary), summary
    assert loop.errors == 0
