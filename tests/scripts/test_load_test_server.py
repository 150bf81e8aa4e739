"""scripts/load_test_server.py without a server: the request plan and the verdict (its run against a
live server is tests/serving/test_server.py::test_load_with_cancellations_and_bad_requests)."""

import pytest
from conftest import load_script


@pytest.fixture(scope="module")
def lt():
    return load_script("load_test_server")


def test_plan_is_reproducible_and_mixes_every_kind(lt):
    a, b = lt.plan(400, seed=3), lt.plan(400, seed=3)
    assert a == b and a != lt.plan(400, seed=4)
    kinds = [r["kind"] for r in a]
    assert set(kinds) == set(lt.KINDS)
    assert kinds.count("completion") > kinds.count("cancel")  # shares 3 : 1
    assert all(1 <= r["max_tokens"] <= 12 and 0 <= r["malformed"] < len(lt.MALFORMED) for r in a)
    assert [r["i"] for r in a] == list(range(400)) and lt.plan(5, seed=3) == a[:5]


def test_verdict_needs_every_answer_nothing_held_and_health(lt, capsys):
    good = dict(url="u", requests=2, clients=1, duration_s=1.0, failed=[], healthy=True,
                kinds={"chat": dict(count=2, failed=0, p50_s=0.1, p99_s=0.2)},
                finished_by_reason=dict(stop=1, length=1, cancelled=0, error=0),
                idle=dict(running=0, waiting=0, cache_bytes_in_use=0))
    assert lt.passed(good)
    lt.report(good)
    assert capsys.readouterr().out.strip().endswith("PASSED")
    for bad in (dict(failed=[dict(i=0, kind="chat", detail="x")]), dict(healthy=False),
                dict(idle=dict(running=0, waiting=0, cache_bytes_in_use=4096)),
                dict(finished_by_reason=dict(stop=1, length=0, cancelled=0, error=1))):
        assert not lt.passed(dict(good, **bad)), bad
