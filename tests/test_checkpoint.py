"""Orbax checkpoints with a JSON sidecar: bit-exact round trips and clear errors."""

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp import checkpoint
from jaxlp.checkpoint import CheckpointError
from jaxlp.formats import FP8Array, QuantizedArray, MXFP4Array, NVFP4Array, fp8, mxfp4, nvfp4


def bits(a):
    a = np.asarray(a)
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def make_tree(seed):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
    return {
        "layers": [
            {"w": nvfp4.quantize(w, scale_clamp="torchao"), "b": jnp.asarray(rng.standard_normal(8), jnp.bfloat16)},
            {"w": mxfp4.quantize(w, block_size=16), "norm": jnp.asarray(rng.standard_normal(64), jnp.float32)},
        ],
        "kv": (fp8.quantize(w, granularity="token"), fp8.quantize(w, scale=0.01), None),
        "embed": jnp.asarray(rng.integers(-100, 100, (4, 3)), jnp.int32),
        "int4": jnp.asarray(rng.integers(-8, 8, 10), jnp.int4),
        "host": rng.integers(0, 1000, 5).astype(np.int64),
        "empty_dict": {},
        "zd": jnp.zeros((0, 3), jnp.float32),
    }


def assert_same_tree(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a, is_leaf=lambda n: n is None), jax.tree.leaves(b, is_leaf=lambda n: n is None)):
        assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(bits(x), bits(y))
    def quantized(t):
        return [n for n in jax.tree.leaves(t, is_leaf=lambda n: isinstance(n, QuantizedArray)) if isinstance(n, QuantizedArray)]

    qa, qb = quantized(a), quantized(b)
    assert len(qa) == len(qb)
    for x, y in zip(qa, qb):
        assert type(x) is type(y) and x.static_fields() == y.static_fields()


def test_round_trip_bit_exact(tmp_path):
    tree = make_tree(501)
    path = tmp_path / "ckpt"
    checkpoint.save(path, tree)
    out = checkpoint.load(path)
    assert_same_tree(out, tree)
    assert isinstance(out["layers"][0]["w"], NVFP4Array) and out["layers"][0]["w"].scale_clamp == "torchao"
    assert isinstance(out["layers"][1]["w"], MXFP4Array) and out["layers"][1]["w"].block_size == 16
    assert isinstance(out["kv"], tuple) and isinstance(out["kv"][0], FP8Array) and out["kv"][2] is None
    assert out["kv"][0].granularity == "token"
    assert isinstance(out["layers"][0]["w"].shape, tuple)  # tuples in static fields come back as tuples
    assert isinstance(out["host"], np.ndarray) and out["host"].dtype == np.int64
    assert isinstance(out["embed"], jax.Array)
    np.testing.assert_array_equal(np.asarray(out["layers"][0]["w"].dequantize()), np.asarray(tree["layers"][0]["w"].dequantize()))
    sidecar = json.loads((path / checkpoint.SIDECAR).read_text())
    assert sidecar["jaxlp_checkpoint_version"] == checkpoint.VERSION


def test_single_quantized_array_and_empty_tree(tmp_path):
    q = nvfp4.quantize(jnp.asarray(np.random.default_rng(502).standard_normal((2, 3, 32)), jnp.bfloat16))
    checkpoint.save(tmp_path / "one", q)
    assert_same_tree(checkpoint.load(tmp_path / "one"), q)
    checkpoint.save(tmp_path / "empty", {"a": [], "b": None})
    assert checkpoint.load(tmp_path / "empty") == {"a": [], "b": None}


def test_abstract_is_the_tree_without_data(tmp_path):
    tree = make_tree(503)
    checkpoint.save(tmp_path / "ckpt", tree)
    shaped = checkpoint.abstract(tmp_path / "ckpt")
    assert jax.tree.structure(shaped) == jax.tree.structure(tree)
    for a, x in zip(jax.tree.leaves(shaped), jax.tree.leaves(tree)):
        assert isinstance(a, jax.ShapeDtypeStruct) and a.shape == x.shape and a.dtype == x.dtype
    assert isinstance(shaped["layers"][0]["w"], NVFP4Array) and shaped["layers"][0]["w"].scale_clamp == "torchao"


def test_load_places_every_array_on_its_own_sharding(tmp_path):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    tree = make_tree(504)
    checkpoint.save(tmp_path / "ckpt", tree)
    rows = NamedSharding(mesh, P("x"))  # the leading axis over two devices where it divides, else replicated

    def place(a):
        return rows if a.ndim and a.shape[0] % 2 == 0 else NamedSharding(mesh, P())

    shardings = jax.tree.map(place, checkpoint.abstract(tmp_path / "ckpt"))
    out = checkpoint.load(tmp_path / "ckpt", sharding=shardings)
    assert_same_tree(out, tree)
    for leaf, want in zip(jax.tree.leaves(out), jax.tree.leaves(shardings)):
        if isinstance(leaf, jax.Array):
            assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
    assert out["layers"][0]["w"].data.sharding.spec == P("x")  # 8 rows: 4 per device
    assert out["embed"].sharding.spec == P("x") and len(out["embed"].sharding.device_set) == 2
    assert out["zd"].sharding.spec == P("x")  # zero-size arrays (sidecar only) too


def test_default_placement_is_this_process_first_device(tmp_path, monkeypatch):
    """Without a sharding, arrays land on ``jax.local_devices()[0]``: in a multi-process run
    ``jax.devices()[0]`` is process 0's device, not addressable elsewhere (faked here by making
    the local list start at another of the 4 simulated devices)."""
    tree = make_tree(505)
    checkpoint.save(tmp_path / "ckpt", tree)
    local = jax.devices()[2:]
    monkeypatch.setattr(jax, "local_devices", lambda *args, **kwargs: local)
    out = checkpoint.load(tmp_path / "ckpt")
    assert_same_tree(out, tree)
    arrays = [leaf for leaf in jax.tree.leaves(out) if isinstance(leaf, jax.Array)]
    assert arrays and all(leaf.sharding.device_set == {local[0]} for leaf in arrays)


def test_a_sharding_tree_that_does_not_fit_is_refused(tmp_path):
    tree = make_tree(505)
    checkpoint.save(tmp_path / "ckpt", tree)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shaped = checkpoint.abstract(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="structure of the checkpoint"):
        checkpoint.load(tmp_path / "ckpt", sharding={"layers": one})
    with pytest.raises(ValueError, match="must be a jax.sharding.Sharding"):
        checkpoint.load(tmp_path / "ckpt", sharding=jax.tree.map(lambda a: "cpu:0", shaped))


def test_a_save_from_several_processes_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(CheckpointError, match="from 2 processes is not supported"):
        checkpoint.save(tmp_path / "ckpt", {"a": jnp.ones(3)})
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.iterdir())


def test_overwrite(tmp_path):
    path = tmp_path / "ckpt"
    checkpoint.save(path, {"x": jnp.ones(3)})
    with pytest.raises(CheckpointError, match="already exists"):
        checkpoint.save(path, {"x": jnp.zeros(3)})
    checkpoint.save(path, {"y": jnp.zeros(4)}, overwrite=True)
    out = checkpoint.load(path)
    assert list(out) == ["y"] and np.all(np.asarray(out["y"]) == 0)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("precious")
    with pytest.raises(CheckpointError, match="not a jaxlp checkpoint"):
        checkpoint.save(other, {"x": jnp.ones(3)}, overwrite=True)
    assert (other / "keep.txt").read_text() == "precious"
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "notes"]  # no temporary directories left behind


def test_unsupported_content(tmp_path):
    with pytest.raises(CheckpointError, match="unsupported leaf"):
        checkpoint.save(tmp_path / "a", {"x": 3.0})
    with pytest.raises(CheckpointError, match="keys must be strings"):
        checkpoint.save(tmp_path / "b", {1: jnp.ones(2)})
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory):
    tree = {
        "w": nvfp4.quantize(jnp.asarray(np.random.default_rng(503).standard_normal((4, 32)), jnp.float32)),
        "b": jnp.asarray(np.random.default_rng(504).standard_normal(600), jnp.float32),
    }
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    checkpoint.save(path, tree)
    return path, tree


@pytest.fixture
def saved(saved_once, tmp_path):
    """A fresh copy per test. A copy at a new path is never in TensorStore's in-process cache,
    so deleting its files really makes the data unreadable (as in a new process)."""
    src, tree = saved_once
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    return path, tree


def edit_sidecar(path, fn):
    p = path / checkpoint.SIDECAR
    sidecar = json.loads(p.read_text())
    fn(sidecar)
    p.write_text(json.dumps(sidecar))


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        checkpoint.load(tmp_path / "nope")


def test_missing_and_corrupt_sidecar(saved):
    path, _ = saved
    p = path / checkpoint.SIDECAR
    text = p.read_text()
    p.write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match="corrupt sidecar"):
        checkpoint.load(path)
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(CheckpointError, match="corrupt sidecar"):
        checkpoint.load(path)
    p.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="sidecar"):
        checkpoint.load(path)
    p.unlink()
    with pytest.raises(CheckpointError, match="no sidecar"):
        checkpoint.load(path)


def test_version_mismatch(saved):
    path, _ = saved
    edit_sidecar(path, lambda s: s.update(jaxlp_checkpoint_version=checkpoint.VERSION + 1))
    with pytest.raises(CheckpointError, match="version"):
        checkpoint.load(path)


def test_mismatched_format(saved):
    path, _ = saved
    edit_sidecar(path, lambda s: s["tree"]["items"]["w"].update(format="mxfp4"))
    with pytest.raises(CheckpointError, match="do not match format 'mxfp4'"):
        checkpoint.load(path)


def test_unknown_format(saved):
    path, _ = saved
    edit_sidecar(path, lambda s: s["tree"]["items"]["w"].update(format="nvfp9"))
    with pytest.raises(CheckpointError, match="unknown quantization format 'nvfp9'"):
        checkpoint.load(path)


def test_sidecar_inconsistent_static_shape(saved):
    path, _ = saved

    def grow(s):
        s["tree"]["items"]["w"]["static"]["shape"] = {"tuple": [4, 64]}

    edit_sidecar(path, grow)
    with pytest.raises(CheckpointError, match="inconsistent 'nvfp4'"):
        checkpoint.load(path)


def test_sidecar_and_data_shapes_disagree(saved):
    path, _ = saved

    def change(s):
        s["tree"]["items"]["b"]["shape"] = [7]

    edit_sidecar(path, change)
    with pytest.raises(CheckpointError, match="disagree"):
        checkpoint.load(path)


def test_sidecar_names_an_array_the_data_lacks(saved):
    path, _ = saved

    def add(s):
        s["tree"]["items"]["extra"] = dict(s["tree"]["items"]["b"], index=s["num_arrays"])
        s["num_arrays"] += 1

    edit_sidecar(path, add)
    with pytest.raises(CheckpointError, match=re.escape("1 arrays (tree['extra']) are not in the data")):
        checkpoint.load(path)


def test_sidecar_with_duplicate_leaf_index(saved):
    path, _ = saved
    edit_sidecar(path, lambda s: s["tree"]["items"]["b"].update(index=0))
    with pytest.raises(CheckpointError, match="indices"):
        checkpoint.load(path)


@pytest.mark.parametrize("which", ["chunks", "data", "manifest", "metadata", "every_file"])
def test_deleted_array_files(saved, which):
    path, _ = saved
    arrays = path / checkpoint.ARRAYS
    process_d = arrays / "ocdbt.process_0" / "d"
    targets = {
        "chunks": [process_d / f for f in os.listdir(process_d)],
        "data": [arrays / "d" / f for f in os.listdir(arrays / "d")],
        "manifest": [arrays / "manifest.ocdbt"],
        "metadata": [arrays / "_METADATA"],
        "every_file": [os.path.join(r, f) for r, _, fs in os.walk(arrays) for f in fs],
    }[which]
    assert targets
    for f in targets:
        os.remove(f)
    with pytest.raises(CheckpointError, match="array (data|metadata)"):
        checkpoint.load(path)


def test_flipped_bytes_in_array_data(saved):
    path, _ = saved
    process_d = path / checkpoint.ARRAYS / "ocdbt.process_0" / "d"
    biggest = max(process_d.iterdir(), key=lambda f: f.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0x5A
    biggest.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum|array data"):
        checkpoint.load(path)


def test_missing_arrays_dir(saved):
    path, _ = saved
    shutil.rmtree(path / checkpoint.ARRAYS)
    with pytest.raises(CheckpointError, match="missing"):
        checkpoint.load(path)


def test_checksum_mismatch(saved):
    path, tree = saved
    edit_sidecar(path, lambda s: s["tree"]["items"]["b"].update(crc32=s["tree"]["items"]["b"]["crc32"] ^ 1))
    with pytest.raises(CheckpointError, match="checksum"):
        checkpoint.load(path)
    out = checkpoint.load(path, verify=False)
    np.testing.assert_array_equal(np.asarray(out["b"]), np.asarray(tree["b"]))


def test_failed_read_leaves_nothing_behind(tmp_path):
    """A truncated data file: one-line CheckpointError naming the array, every time, and no asyncio
    "Event loop is closed" reports, warnings or threads afterwards, in a process that keeps running."""
    import subprocess
    import sys
    import textwrap

    rng = np.random.default_rng(0)
    tree = {f"w{i}": jnp.asarray(rng.standard_normal((64, 256)), jnp.float32) for i in range(24)}
    path = tmp_path / "ckpt"
    checkpoint.save(path, tree)
    data = path / checkpoint.ARRAYS / "ocdbt.process_0" / "d"
    biggest = max(data.iterdir(), key=lambda f: f.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[:1000])
    code = textwrap.dedent(f"""
        import gc, threading, time
        from jaxlp import checkpoint
        for _ in range(3):
            try:
                checkpoint.load({str(path)!r})
            except checkpoint.CheckpointError as e:
                print("ERROR", e)
        time.sleep(1.0)
        gc.collect()
        print("THREADS", len(threading.enumerate()))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr[-2000:]
    errors = [line for line in proc.stdout.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 3 and all("is truncated" in e and "tree['w" in e for e in errors), proc.stdout
    assert "THREADS 1" in proc.stdout


def test_check_finite_names_the_array(tmp_path):
    from jaxlp.errors import NonFiniteWeightsError

    import dataclasses

    q = nvfp4.quantize(jnp.ones((4, 32)))
    q = dataclasses.replace(q, tensor_scale=jnp.float32(jnp.inf))  # a damaged scale
    tree = {"a": jnp.ones((4, 32)), "q": q}
    checkpoint.save(tmp_path / "c", tree)
    assert checkpoint.load(tmp_path / "c")["a"].shape == (4, 32)  # off by default for generic trees
    with pytest.raises(NonFiniteWeightsError, match=r"tensor q\.tensor_scale holds 0 NaN and 1 Inf"):
        checkpoint.load(tmp_path / "c", check_finite=True)
