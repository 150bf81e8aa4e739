"""jaxlp.evals.reasoner (and its plan, report and row groups): the call layout, the settings,
the row-group sampler and cache against separate runs, the tables, and a tiny end-to-end run."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlp
from jaxlp import kvcache, sampling, testbed
from jaxlp.evals.reasoner import Context, config_report, run_evaluation, score_texts
from jaxlp.evals.reasoner_plan import (
    BASE_SAMPLER,
    Config,
    describe_plan,
    plan_calls,
    plan_jobs,
    resolve_eval_settings,
    settings_rows,
    table_rows,
)
from jaxlp.evals.reasoner_report import (
    decode_correct,
    fmt_acc,
    markdown_table,
    table1,
    table2,
    term_buckets,
)
from jaxlp.evals.rowgroups import RowGroupCache, RowGroupSampler
from jaxlp.evals.stats import t_interval
from jaxlp.models import ModelConfig, Transformer


def tiny_config(**overrides) -> ModelConfig:
    kwargs = dict(model_type="qwen3", vocab_size=testbed.VOCAB_SIZE, qk_norm=True, tie_word_embeddings=True,
                  rms_norm_eps=1e-6, max_position_embeddings=512, bos_token_id=testbed.BOS_ID,
                  eos_token_ids=(testbed.EOS_ID,), pad_token_id=testbed.PAD_ID, hidden_size=32,
                  intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


# ------------------------------------------------------------------ layout and planning


@pytest.mark.parametrize("problems,seeds,groups,max_rows", [
    (256, 8, 1, 4096), (256, 8, 16, 4096), (256, 8, 10, 4096), (5, 6, 3, 40), (7, 3, 4, 10), (9, 2, 1, 4),
    (1, 1, 1, 1), (1024, 8, 16, 4096), (13, 2, 3, 9),
])
def test_plan_calls_covers_every_unit_once(problems, seeds, groups, max_rows):
    lengths = np.random.default_rng(problems).integers(10, 50, problems).tolist()
    plan = plan_calls(problems, seeds, groups, max_rows, lengths)
    units = [u for call in plan.calls for u in call if u is not None]
    assert sorted(units) == [(s, i) for s in range(seeds) for i in range(problems)]
    assert all(len(call) == plan.rows_per_group for call in plan.calls)
    assert plan.rows_per_group * groups <= max_rows
    if groups * problems <= max_rows:  # call s = seed s, problem i in row i: the same layout in every program
        assert plan.calls == tuple(tuple((s, i) for i in range(problems)) for s in range(seeds))
    else:  # every slice holds one of the longest prompts (so all calls share one prompt bucket)
        longest = sorted(range(problems), key=lambda i: -lengths[i])[: len(plan.calls) // seeds]
        for call in plan.calls:
            assert any(u is not None and u[1] in longest for u in call)
    with pytest.raises(ValueError):
        plan_calls(problems, seeds, groups, groups - 1)


def test_plan_jobs_runs_each_config_once():
    args = resolve_eval_settings()
    rows = table_rows(args.tables, args.formats, args.samplers, args.caches, args.sampler_weights,
                      args.cache_weights)
    assert settings_rows(args) == rows
    jobs = plan_jobs(rows, max_cache_groups=4)
    planned = [c for j in jobs for c in j.configs]
    assert len(planned) == len(set(planned)) == len({c for cfgs in rows.values() for c in cfgs})
    by_name = {j.name: j for j in jobs}
    kv = {f"kv/{w}/{k}" for w in ("bf16", "w4a4-nvfp4") for k in (1, 2, 3)}  # 9 quantized caches in 3 programs
    assert set(by_name) == {"samplers/bf16", "samplers/w4a4-nvfp4"} | kv | {
        f"base/{w}" for w in args.formats if w not in ("bf16", "w4a4-nvfp4")}
    assert all(len(by_name[k].configs) == 3 for k in kv)
    assert by_name["samplers/w4a4-nvfp4"].calibrate_tau0 and not by_name["kv/bf16/1"].calibrate_tau0
    # Table 1's BF16 row and Table 5's BF16-cache rows come from the sampler programs.
    assert Config("bf16", BASE_SAMPLER, "bf16") in by_name["samplers/bf16"].configs
    assert all(c.cache != "bf16" for k in kv for c in by_name[k].configs)
    assert jobs[0].name == "samplers/w4a4-nvfp4"
    assert len(plan_jobs(rows, max_cache_groups=9)) == 4 + 7 and len(plan_jobs(rows, 1)) == 2 + 18 + 7
    with pytest.raises(ValueError):
        plan_jobs(rows, 0)


def test_settings_reject_unknown_names():
    for bad, name in ((dict(formats="fp3"), "weight format 'fp3'"), (dict(samplers="top_k=5"), "sampler 'top_k=5'"),
                      (dict(caches="int1"), "KV cache 'int1'"), (dict(tables="3"), "table '3'"),
                      (dict(sampler_weights="bf16,fp3"), "weight format 'fp3'"), (dict(workers=0), "--workers")):
        with pytest.raises(ValueError, match=name):
            resolve_eval_settings(**bad)
    args = resolve_eval_settings(samplers="reset", caches="kitty")
    assert args.samplers == (BASE_SAMPLER, "reset") and args.caches == ("bf16", "kitty")
    assert resolve_eval_settings().samplers[:2] == (BASE_SAMPLER, "top_p=0.8")
    assert resolve_eval_settings(samplers=["reset", "reset"], caches=("kitty",)).samplers == (BASE_SAMPLER, "reset")
    quick = resolve_eval_settings(quick=True)
    assert (quick.problems, quick.seeds, quick.formats, quick.cache_weights) == (4, 2, ("bf16", "w4a4-nvfp4"),
                                                                                  ("bf16",))


def test_list_mode():
    out = "\n".join(describe_plan(resolve_eval_settings()))
    assert "samplers/w4a4-nvfp4" in out and "kv/w4a4-nvfp4/3" in out and "15 compiled programs, 57 configs" in out


# ------------------------------------------------------------------ row groups


def _entropy_sampler(cls, tau0=0.3):
    return cls(t_low=0.1, tau0=tau0, double_newline_ids=(), newline_ids=(testbed.NEWLINE_ID,))


def test_row_group_sampler_equals_separate_samplers():
    samplers = (sampling.Categorical(temperature=0.6, top_p=0.9), _entropy_sampler(sampling.ReSETConfig),
                sampling.Categorical(temperature=1.0, top_p=None, min_p=0.05))
    sizes = (5, 3, 2)
    group = RowGroupSampler(samplers, sizes)
    rng = np.random.default_rng(21)
    state, states = jax.jit(group.init, static_argnums=0)(10), [s.init(n) for s, n in zip(samplers, sizes)]
    step = jax.jit(lambda smp, st, x, k: smp.sample(st, x, k))
    for t in range(4):
        logits = jnp.asarray(rng.normal(size=(10, 100)) * 3, jnp.float32)
        key = jax.random.key(t)
        out = step(group, state, logits, key)
        start = 0
        for g, (s, n) in enumerate(zip(samplers, sizes)):
            ref = step(s, states[g], logits[start:start + n], key)
            np.testing.assert_array_equal(out.tokens[start:start + n], ref.tokens)
            np.testing.assert_array_equal(out.temperature[start:start + n], ref.temperature)
            want = ref.entropy if ref.entropy is not None else sampling.token_entropy(logits[start:start + n])
            np.testing.assert_allclose(out.entropy[start:start + n], want, rtol=1e-6)
            states[g] = ref.state
            start += n
        state = out.state
    with pytest.raises(ValueError):
        group.init(9)
    with pytest.raises(ValueError):
        RowGroupSampler(samplers, (5, 3))
    with pytest.raises(ValueError):
        RowGroupSampler(list(samplers), sizes)


def test_row_group_cache_equals_separate_caches():
    config = tiny_config()
    formats = ("bf16", "kivi-k2v2", "fireq-int4")
    sizes = (2, 3, 1)
    fmt = RowGroupCache(formats, sizes)
    b, max_len = sum(sizes), 24
    cache = fmt.init(config, b, max_len)
    parts = [kvcache.get(f).init(config, n, max_len) for f, n in zip(formats, sizes)]
    rng = np.random.default_rng(5)
    attend = jax.jit(lambda layer, *a: layer.attend(*a, scale=config.head_dim ** -0.5, window=None, softcap=None))
    lengths = np.array([5, 9, 3, 7, 9, 4])
    for s, pos0 in ((9, None), (1, lengths)):  # prefill (padding at out-of-cache positions), then a decode step
        q = jnp.asarray(rng.normal(size=(b, s, config.num_heads, config.head_dim)), jnp.bfloat16)
        k, v = (jnp.asarray(rng.normal(size=(b, s, config.num_kv_heads, config.head_dim)), jnp.bfloat16)
                for _ in range(2))
        if pos0 is None:
            positions = np.tile(np.arange(s), (b, 1))
            positions = np.where(positions < lengths[:, None], positions, max_len + 1)
        else:
            positions = pos0[:, None]
        positions = jnp.asarray(positions, jnp.int32)
        out, new_layer = attend(cache.layers[0], q, k, v, positions)
        start = 0
        for g, n in enumerate(sizes):
            rows = slice(start, start + n)
            ref, parts_layer = attend(parts[g].layers[0], q[rows], k[rows], v[rows], positions[rows])
            np.testing.assert_array_equal(np.asarray(out[rows], np.float32), np.asarray(ref, np.float32))
            parts[g] = kvcache.KVCache((parts_layer,) + parts[g].layers[1:])
            start += n
        cache = kvcache.KVCache((new_layer,) + cache.layers[1:])
    per_row = [kvcache.get(f).bytes_per_token(config) for f in formats]
    assert fmt.bytes_per_token(config) == pytest.approx(np.dot(per_row, sizes) / b)
    with pytest.raises(ValueError):
        fmt.init(config, b + 1, max_len)
    with pytest.raises(ValueError):
        RowGroupCache(formats, (2, 3))


def test_generate_with_row_groups_equals_separate_calls():
    config = tiny_config()
    model = Transformer(config, dtype=jnp.float32, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(9)
    prompts = [rng.integers(5, 100, n).tolist() for n in (7, 12, 5)]
    samplers = (sampling.Categorical(temperature=1.0), sampling.Categorical(temperature=0.8, top_p=0.9))
    caches = ("bf16", "kivi-k2v2")
    kw = dict(max_new_tokens=12, stop_tokens=(), seed=4, return_stats=True)
    both = jaxlp.generate(model, prompts * 2, sampler=RowGroupSampler(samplers, (3, 3)),
                          kv_cache=RowGroupCache(caches, (3, 3)), **kw)
    for g in range(2):
        alone = jaxlp.generate(model, prompts, sampler=samplers[g], kv_cache=caches[g], **kw)
        np.testing.assert_array_equal(both.tokens[3 * g:3 * g + 3], alone.tokens)
        np.testing.assert_allclose(both.entropy[3 * g:3 * g + 3], alone.entropy, rtol=1e-5, atol=1e-6)
    assert not np.array_equal(both.tokens[:3], both.tokens[3:])  # the groups differ (other sampler and cache)


# ------------------------------------------------------------------ scoring, tables


def test_score_texts_and_config_report():
    problems = testbed.eval_problems(0, 3)
    texts = [p.solution for p in problems]
    bad = texts[1].replace("Answer: ", "Answer: 1")  # wrong answer after right steps
    scored = score_texts(problems, [texts[0], bad, "garbage"])
    assert scored[0] == (True, None) and scored[1] == (False, "answer") and scored[2] == (False, "format")
    ctx = Context(problems, [], None, testbed.ProblemSpec(), 2, 64, 10, 0, 1)
    correct = np.array([[True, False, False], [True, True, False]])
    kinds = np.array([[None, "answer", "format"], [None, None, "format"]], object)
    rep = config_report(Config("bf16", BASE_SAMPLER, "bf16"), ctx, correct, kinds, {"x": 1}, 200)
    assert rep["accuracy"] == pytest.approx(0.5) and rep["per_seed"] == pytest.approx([1 / 3, 2 / 3])
    assert rep["error_kinds"] == {"format": 2, "answer": 1} and rep["correct_answer_step_error"] == 0
    assert rep["correct"] == ["100", "110"] and rep["x"] == 1
    np.testing.assert_array_equal(decode_correct(rep), correct)
    for k, v in rep["by_terms"].items():
        cols = [i for i, p in enumerate(problems) if len(p.terms) == k]
        assert v == {"accuracy": pytest.approx(correct[:, cols].mean()), "problems": len(cols)}


def test_markdown_tables():
    assert markdown_table(["a", "b|c"], [["1", "x|y"]]) == "| a | b\\|c |\n|---|---|\n| 1 | x\\|y |"
    with pytest.raises(ValueError):
        markdown_table(["a", "b"], [["1"]])
    assert fmt_acc(None) == "-"
    assert fmt_acc({"accuracy": 0.9734, "half_width": 0.0081}) == "97.3 ± 0.8"
    assert fmt_acc({"accuracy": 0.5, "half_width": float("nan")}) == "50.0"
    spec = testbed.ProblemSpec()
    assert term_buckets(spec) == [(1, 2), (3, 4), (5, 6), (7, 8)]
    assert term_buckets(testbed.ProblemSpec(min_terms=1, max_terms=3)) == [(1, 2), (3, 3)]

    def rep(bits, by_terms):
        per_seed = [np.mean([c == "1" for c in row]) for row in bits]
        mean, half = t_interval(per_seed)
        return dict(accuracy=mean, half_width=half, correct=bits, by_terms=by_terms)

    reports = {
        "bf16/top_p=0.95/bf16": rep(["1111", "1110"], {1: dict(accuracy=1.0, problems=2),
                                                        7: dict(accuracy=0.75, problems=2)}),
        "w4a4-nvfp4/top_p=0.95/bf16": rep(["1100", "1010"], {1: dict(accuracy=0.5, problems=2),
                                                              7: dict(accuracy=0.5, problems=2)}),
    }
    rows = [Config(w, BASE_SAMPLER, "bf16") for w in ("bf16", "w4a4-nvfp4", "w8a8-fp8")]
    lines = table1(reports, spec, rows).split("\n")
    assert lines[0] == "| Weights | 1-2 terms | 3-4 terms | 5-6 terms | 7-8 terms | All (± 95% CI) | Δ vs BF16 |"
    assert lines[2] == "| BF16 | 100.0 | - | - | 75.0 | 87.5 ± 158.8 |  |"
    # W4A4: per seed 0.5 / 0.5 vs 1.0 / 0.75 -> differences -0.5 / -0.25, mean -37.5, t_{1} half-width 158.8
    assert lines[3] == "| NVFP4 W4A4 | 50.0 | - | - | 50.0 | 50.0 ± 0.0 | -37.5 ± 158.8 |"
    assert len(lines) == 4  # the format that did not run has no row
    reports["bf16/top_p=0.8/bf16"] = rep(["1111", "1111"], {})
    reports["bf16/top_p=0.85/bf16"] = rep(["1111", "0111"], {})
    reports["w4a4-nvfp4/reset/bf16"] = rep(["1110", "1110"], {})
    t2 = table2(reports, [BASE_SAMPLER, "top_p=0.8", "top_p=0.85", "top_p=0.9", "reset"],
                   ["bf16", "w4a4-nvfp4"], 0.1, 1.0).split("\n")
    assert t2[2] == "| Base | 0.6 | 0.95 | 0.0 | 87.5 ± 158.8 |  | 50.0 ± 0.0 |  |"
    assert t2[3] == "| Top-p sweep | 0.6 | 0.8 | 0.0 | 100.0 ± 0.0 | +12.5 ± 158.8 | - |  |"
    assert t2[4] == "|  | 0.6 | 0.85 | 0.0 | 87.5 ± 158.8 | +0.0 ± 0.0 | - |  |"
    assert t2[5] == "| ReSET | 0.1 / 1 | 0.95 | 0.0 | - |  | 75.0 ± 0.0 | +25.0 ± 0.0 |"
    assert len(t2) == 6  # top-p 0.9 has no result: no row


# ------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A random tiny Qwen3 with the testbed tokenizer and a tiny problem spec in its training log."""
    from jaxlp.models.saving import save_pretrained

    path = tmp_path_factory.mktemp("tiny_reasoner")
    model = Transformer(tiny_config(), dtype=jnp.float32, rngs=nnx.Rngs(0))
    save_pretrained(model, path, testbed.make_tokenizer(), dtype=jnp.bfloat16)
    spec = dict(min_terms=1, max_terms=2, max_digits=2, multiply_prob=0.3, start_digits=2, order_window=2)
    (path / "training_log.json").write_text(json.dumps({"spec": spec}))
    return path


def test_end_to_end_tiny_model(tiny_checkpoint, tmp_path):
    out = tmp_path / "res"
    settings = resolve_eval_settings(model=tiny_checkpoint, out=out, problems=4, seeds=2, formats="bf16",
                                     samplers="reset", sampler_weights="bf16", caches="kivi-k2v2",
                                     cache_weights="bf16", bootstrap=100, workers=2)  # both programs at once
    evaluation = run_evaluation(settings, command="eval of the tiny model")
    assert evaluation.skipped == []
    data = json.loads(out.with_suffix(".json").read_text())
    assert list(evaluation.reports) == [c["key"] for c in data["configs"]] and data["meta"] == evaluation.meta
    keys = [c["key"] for c in data["configs"]]
    assert sorted(keys) == ["bf16/reset/bf16", "bf16/top_p=0.95/bf16", "bf16/top_p=0.95/kivi-k2v2"]
    assert data["skipped"] == [] and data["meta"]["spec"]["max_terms"] == 2
    assert set(data["meta"]["jobs"]) == {"samplers/bf16", "kv/bf16"}
    tau0 = data["meta"]["tau0"]["bf16"]
    assert tau0["tau0"] > 0 and tau0["problems"] == 4  # training problems = rows of one call
    problems = testbed.eval_problems(0, 4, testbed.ProblemSpec(**data["meta"]["spec"]))
    for c in data["configs"]:
        correct = decode_correct(c)
        assert correct.shape == (2, 4) and c["samples"] == 8
        assert c["accuracy"] == pytest.approx(correct.mean()) and c["per_seed"] == pytest.approx(correct.mean(1))
        assert sum(c["error_kinds"].values()) == int((~correct).sum())
        assert sum(v["problems"] for v in c["by_terms"].values()) == len(problems)
        assert 0 < c["mean_tokens"] <= data["meta"]["max_new_tokens"]
    reset = next(c for c in data["configs"] if c["sampler"] == "reset")
    assert reset["tau0"] == data["meta"]["tau0"]["bf16"]["tau0"] and 0.0 <= reset["share_t_low"] <= 1.0
    assert next(c for c in data["configs"] if c["key"] == "bf16/top_p=0.95/bf16")["tables"] == ["1", "2", "5"]
    md = out.with_suffix(".md").read_text()
    for heading in ("Command: `eval of the tiny model`", "## Table 1", "## Table 2", "## Table 5",
                    "| ReSET | 0.1 / 1 | 0.95 | 0.0 |", "| kivi-k2v2 |"):
        assert heading in md
    assert out.with_suffix(".png").stat().st_size > 1000


def test_time_limit_skips_and_still_writes(tiny_checkpoint, tmp_path):
    out = tmp_path / "late"
    settings = resolve_eval_settings(model=tiny_checkpoint, out=out, problems=2, seeds=1, tables="5", caches="kitty",
                                     cache_weights="bf16", time_limit=0)
    evaluation = run_evaluation(settings)
    assert evaluation.skipped and not evaluation.reports
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["configs"] == [] and "TimeoutError" in data["skipped"][0]
    assert "## Not run" in out.with_suffix(".md").read_text()
