"""Save and load pytrees of arrays and QuantizedArrays with Orbax, bit-exactly.

A checkpoint is a directory::

    <path>/arrays/               Orbax StandardCheckpointer data (every array leaf)
    <path>/jaxlp_checkpoint.json the sidecar: version, tree structure, formats, static fields

Orbax does not save the static (metadata) fields of dataclass pytrees, and restoring needs an
abstract tree of the same structure. The sidecar records the tree (dicts with string keys,
lists, tuples, None), for each QuantizedArray its format name and static fields, and for each
array leaf its index, shape, dtype, whether it was a NumPy array, and a CRC-32 of its bytes.
Orbax stores the leaves as a flat dict ``{"a<index>": array}`` (zero-size arrays, which Orbax
cannot save, live in the sidecar only). ``load`` rebuilds the tree from the sidecar (checking
each QuantizedArray's fields against its static fields), checks Orbax's metadata against it,
restores, and verifies shapes, dtypes and checksums. Any inconsistency raises
:class:`CheckpointError` (a :class:`jaxlp.errors.CheckpointFormatError`) in one line naming
the file and what is wrong; Orbax's and TensorStore's exceptions and log lines do not leak out,
and no asyncio error report follows a failed read (see :func:`_quiet_closed_loop_reports`).
``load(..., check_finite=True)`` also refuses floating arrays holding NaN or Inf
(:func:`check_finite`).

Static field values may be None, bool, int, float, str, NumPy/JAX dtypes, and tuples, lists
and string-keyed dicts of those; containers are stored tagged (``{"tuple": [...]}``) so that
tuples come back as tuples.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp import formats as _formats  # noqa: F401  (registers every format)
from jaxlp.errors import CheckpointFormatError, NonFiniteWeightsError, one_line
from jaxlp.formats.base import QuantizedArray, array_class

VERSION = 1
SIDECAR = "jaxlp_checkpoint.json"
ARRAYS = "arrays"


class CheckpointError(CheckpointFormatError):
    """A checkpoint cannot be written or read back as it was written."""


# ----------------------------------------------------------------------------- finiteness


def _nonfinite_counts(x) -> tuple[int, int]:
    """(NaN count, Inf count) of a floating array."""
    x = jnp.asarray(x)
    return int(jnp.sum(jnp.isnan(x))), int(jnp.sum(jnp.isinf(x)))


def _is_floating(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(jnp.dtype(x.dtype), jnp.floating)


def check_finite(named: Iterable[tuple[str, Any]], where: str) -> None:
    """Raise :class:`~jaxlp.errors.NonFiniteWeightsError` if a floating array of ``named``
    (``(name, array)`` pairs; QuantizedArrays are checked field by field) holds NaN or Inf.

    One reduction per array (on the device the array lives on), once at load time.
    """
    for name, value in named:
        if isinstance(value, QuantizedArray):
            fields = [(f"{name}.{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)
                      if not f.metadata.get("static")]
            check_finite(fields, where)
            continue
        if not _is_floating(value) or not math.prod(value.shape):
            continue
        if bool(jnp.all(jnp.isfinite(jnp.asarray(value)))):
            continue
        nans, infs = _nonfinite_counts(value)
        raise NonFiniteWeightsError(
            f"{where}: tensor {name} holds {nans:,} NaN and {infs:,} Inf values (of {math.prod(value.shape):,}): "
            "the checkpoint is damaged (check_finite=False / --no-check loads it anyway)"
        )


def leaves_with_names(tree: Any) -> list[tuple[str, Any]]:
    """``(dotted path, leaf)`` of a pytree, QuantizedArrays kept whole."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, QuantizedArray))
    return [(".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path), leaf)
            for path, leaf in flat]


# ----------------------------------------------------------------------------- static values


def _encode_static(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, tuple):
        return {"tuple": [_encode_static(v, where) for v in value]}
    if isinstance(value, list):
        return {"list": [_encode_static(v, where) for v in value]}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise CheckpointError(f"{where}: dict keys of static fields must be strings")
        return {"dict": {k: _encode_static(v, where) for k, v in value.items()}}
    if isinstance(value, (np.dtype, type)) and _is_dtype(value):
        return {"dtype": jnp.dtype(value).name}
    raise CheckpointError(f"{where}: static value {value!r} of type {type(value).__name__} cannot be saved")


def _is_dtype(value: Any) -> bool:
    try:
        jnp.dtype(value)
        return True
    except TypeError:
        return False


def _decode_static(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict) and len(value) == 1:
        (tag, inner), = value.items()
        if tag == "tuple":
            return tuple(_decode_static(v) for v in _expect(inner, list, "tuple"))
        if tag == "list":
            return [_decode_static(v) for v in _expect(inner, list, "list")]
        if tag == "dict":
            return {k: _decode_static(v) for k, v in _expect(inner, dict, "dict").items()}
        if tag == "dtype":
            return jnp.dtype(_expect(inner, str, "dtype"))
    raise CheckpointError(f"malformed static value in sidecar: {value!r}")


def _expect(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        raise CheckpointError(f"malformed sidecar: {what} should be a {kind.__name__}, got {value!r}")
    return value


# ----------------------------------------------------------------------------- tree <-> sidecar


def _crc32(leaf: Any) -> int:
    a = np.ascontiguousarray(np.asarray(jax.device_get(leaf)))
    return zlib.crc32(a.reshape(-1).view(np.uint8)) if a.size else 0


def _describe_array(leaf: Any, where: str, leaves: list) -> dict:
    if not isinstance(leaf, (jax.Array, np.ndarray)):
        raise CheckpointError(f"{where}: unsupported leaf of type {type(leaf).__name__} (expected a jax or NumPy array)")
    leaves.append(leaf)
    return {
        "type": "array",
        "index": len(leaves) - 1,
        "shape": [int(d) for d in leaf.shape],
        "dtype": jnp.dtype(leaf.dtype).name,
        "numpy": isinstance(leaf, np.ndarray),
        "crc32": _crc32(leaf),
    }


def _describe(node: Any, where: str, leaves: list) -> dict:
    """Sidecar node of ``node``; appends its array leaves to ``leaves`` (``index`` = position)."""
    if node is None:
        return {"type": "none"}
    if isinstance(node, QuantizedArray):
        fmt = type(node).format
        try:
            cls = array_class(fmt)
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from None
        if cls is not type(node):
            raise CheckpointError(f"{where}: {type(node).__name__} is not the registered class of format {fmt!r}")
        fields, static = {}, {}
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if f.metadata.get("static"):
                static[f.name] = _encode_static(value, f"{where}.{f.name}")
            else:
                fields[f.name] = _describe_array(value, f"{where}.{f.name}", leaves)
        return {"type": "quantized", "format": fmt, "static": static, "fields": fields}
    if isinstance(node, dict):
        if not all(isinstance(k, str) for k in node):
            raise CheckpointError(f"{where}: dict keys must be strings, got {sorted(map(repr, node))}")
        return {"type": "dict", "items": {k: _describe(v, f"{where}[{k!r}]", leaves) for k, v in node.items()}}
    if type(node) in (list, tuple):
        return {
            "type": type(node).__name__,
            "items": [_describe(v, f"{where}[{i}]", leaves) for i, v in enumerate(node)],
        }
    return _describe_array(node, where, leaves)


@dataclasses.dataclass(frozen=True)
class _LeafSpec:
    where: str
    index: int
    shape: tuple[int, ...]
    dtype: Any
    numpy: bool
    crc32: int

    @property
    def key(self) -> str:
        return f"a{self.index}"


def _leaf_spec(desc: Any, where: str) -> _LeafSpec:
    _expect(desc, dict, where)
    if desc.get("type") != "array":
        raise CheckpointError(f"malformed sidecar at {where}: expected an array entry, got {desc.get('type')!r}")
    try:
        return _LeafSpec(
            where=where,
            index=int(desc["index"]),
            shape=tuple(int(d) for d in desc["shape"]),
            dtype=jnp.dtype(desc["dtype"]),
            numpy=bool(desc["numpy"]),
            crc32=int(desc["crc32"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"malformed sidecar at {where}: bad array entry ({type(e).__name__}: {e})") from None


def _build(desc: Any, where: str, leaf_fn: Callable[[_LeafSpec], Any]) -> Any:
    """The tree a sidecar node describes, with ``leaf_fn(spec)`` at each array leaf."""
    _expect(desc, dict, where)
    kind = desc.get("type")
    if kind == "none":
        return None
    if kind == "array":
        return leaf_fn(_leaf_spec(desc, where))
    if kind == "dict":
        items = _expect(desc.get("items"), dict, f"{where} items")
        return {k: _build(v, f"{where}[{k!r}]", leaf_fn) for k, v in items.items()}
    if kind in ("list", "tuple"):
        items = _expect(desc.get("items"), list, f"{where} items")
        seq = [_build(v, f"{where}[{i}]", leaf_fn) for i, v in enumerate(items)]
        return seq if kind == "list" else tuple(seq)
    if kind == "quantized":
        fmt = _expect(desc.get("format"), str, f"{where} format")
        try:
            cls = array_class(fmt)
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from None
        fields = _expect(desc.get("fields"), dict, f"{where} fields")
        static = _expect(desc.get("static"), dict, f"{where} static")
        want_fields = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("static")]
        want_static = [f.name for f in dataclasses.fields(cls) if f.metadata.get("static")]
        if sorted(fields) != sorted(want_fields) or sorted(static) != sorted(want_static):
            raise CheckpointError(
                f"{where}: sidecar fields {sorted(fields)} / static {sorted(static)} do not match format "
                f"{fmt!r} ({cls.__name__}: fields {sorted(want_fields)}, static {sorted(want_static)})"
            )
        kwargs = {name: leaf_fn(_leaf_spec(fields[name], f"{where}.{name}")) for name in want_fields}
        kwargs.update({name: _decode_static(static[name]) for name in want_static})
        try:
            obj = cls(**kwargs)
            obj.check()
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: sidecar describes an inconsistent {fmt!r} array: {e}") from None
        return obj
    raise CheckpointError(f"malformed sidecar at {where}: unknown node type {kind!r}")


# ----------------------------------------------------------------------------- public API


def save(path: str | os.PathLike, tree: Any, *, overwrite: bool = False) -> None:
    """Write ``tree`` (nested dicts/lists/tuples of arrays and QuantizedArrays) to directory ``path``.

    Refuses an existing ``path`` unless ``overwrite=True`` (and then only if it is a jaxlp
    checkpoint or an empty directory). The checkpoint is written to a temporary sibling
    directory and renamed into place, so a failed save leaves no partial checkpoint. One process
    only: a multi-process (multi-host) save is refused.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    if jax.process_count() > 1:
        raise CheckpointError(f"saving {path} from {jax.process_count()} processes is not supported yet: each would "
                              f"write its own temporary directory and rename it into place (loading works)")
    if os.path.lexists(path):
        if not overwrite:
            raise CheckpointError(f"{path} already exists; pass overwrite=True to replace it")
        is_ckpt = os.path.isdir(path) and (os.path.exists(os.path.join(path, SIDECAR)) or not os.listdir(path))
        if not is_ckpt:
            raise CheckpointError(f"refusing to overwrite {path}: it is not a jaxlp checkpoint or an empty directory")
    leaves: list = []
    sidecar = {"jaxlp_checkpoint_version": VERSION, "tree": _describe(tree, "tree", leaves), "num_arrays": len(leaves)}
    # Orbax gets a flat dict of the non-empty arrays (it cannot save zero-size arrays); the
    # sidecar holds the structure and the shapes of the empty ones.
    flat = {f"a{i}": leaf for i, leaf in enumerate(leaves) if leaf.size}

    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        if flat:
            with ocp.StandardCheckpointer() as ckptr:
                ckptr.save(os.path.join(tmp, ARRAYS), flat)
                ckptr.wait_until_finished()
        with open(os.path.join(tmp, SIDECAR), "w") as f:
            json.dump(sidecar, f, indent=1)
        set_default_mode(tmp)
        if os.path.lexists(path):
            shutil.rmtree(path)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def replacing_directory(path: str | os.PathLike):
    """Write a directory complete or not at all: yields a temporary sibling ``tmp`` (a Path) to
    fill; on success ``tmp`` gets a plain mkdir's permissions and replaces ``path`` (renamed into
    place, the old directory removed only after); on any error or interrupt ``tmp`` is removed,
    ``path`` is left as it was, and parent directories created for it are removed if empty."""
    path = Path(path)
    created = [p for p in reversed(path.parents) if not p.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    backup = None
    try:
        yield tmp
        set_default_mode(tmp)
        if path.exists():
            backup = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.rename(path, backup / "old")
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if backup is not None and (backup / "old").exists() and not path.exists():
            os.rename(backup / "old", path)
        if backup is not None:
            shutil.rmtree(backup, ignore_errors=True)
        for d in reversed(created):  # parents made for this write, if still empty
            try:
                d.rmdir()
            except OSError:
                pass
        raise
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)


def set_default_mode(path: str | os.PathLike) -> None:
    """Give a directory made by ``tempfile.mkdtemp`` (owner-only) the permissions a plain
    ``mkdir`` would give it, before it is renamed into place."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)


def _read_sidecar(path: str | os.PathLike) -> tuple[str, dict]:
    """``(absolute path, sidecar)`` of the checkpoint at ``path``; CheckpointError when there is none,
    it is corrupt, or of another version."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint directory at {path}")
    sidecar_path = os.path.join(path, SIDECAR)
    if not os.path.isfile(sidecar_path):
        raise CheckpointError(f"{path} has no sidecar {SIDECAR}: not a jaxlp checkpoint, or an incomplete one")
    try:
        with open(sidecar_path, encoding="utf-8") as f:
            sidecar = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"corrupt sidecar {sidecar_path}: {e}") from None
    if not isinstance(sidecar, dict) or not isinstance(sidecar.get("jaxlp_checkpoint_version"), int):
        raise CheckpointError(f"corrupt sidecar {sidecar_path}: no jaxlp_checkpoint_version")
    version = sidecar["jaxlp_checkpoint_version"]
    if version != VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {version}, this jaxlp reads version {VERSION}")
    return path, sidecar


def _abstract_tree(path: str, sidecar: dict) -> tuple[Any, dict[int, _LeafSpec]]:
    """The stored tree with ``jax.ShapeDtypeStruct`` leaves (QuantizedArrays checked against their
    static fields), and each leaf's spec by ``id`` of its ShapeDtypeStruct."""
    specs: dict[int, _LeafSpec] = {}

    def collect(spec: _LeafSpec) -> jax.ShapeDtypeStruct:
        leaf = jax.ShapeDtypeStruct(spec.shape, spec.dtype)
        specs[id(leaf)] = spec
        return leaf

    tree = _build(sidecar.get("tree"), "tree", collect)
    indices = sorted(s.index for s in specs.values())
    if indices != list(range(len(specs))) or sidecar.get("num_arrays") != len(specs):
        raise CheckpointError(f"corrupt sidecar {os.path.join(path, SIDECAR)}: array indices do not number the "
                              f"leaves 0..n-1")
    return tree, specs


def abstract(path: str | os.PathLike) -> Any:
    """The tree a checkpoint holds, with ``jax.ShapeDtypeStruct`` leaves (only the sidecar is
    read): what :func:`load` returns, shaped but without data. Map it to a tree of shardings for
    ``load(path, sharding=...)``."""
    path, sidecar = _read_sidecar(path)
    return _abstract_tree(path, sidecar)[0]


def _shardings_by_key(path: str, tree: Any, specs: dict[int, _LeafSpec], sharding: Any) -> dict[str, Any]:
    """Each array leaf's sharding (by its Orbax key) from ``sharding``: one Sharding for all, or a
    pytree of Shardings with the structure of :func:`abstract`."""
    if isinstance(sharding, jax.sharding.Sharding):
        return {spec.key: sharding for spec in specs.values()}
    is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)  # noqa: E731
    leaves, treedef = jax.tree.flatten(tree)
    placed, placed_def = jax.tree.flatten(sharding, is_leaf=is_sharding)
    if placed_def != treedef:
        raise ValueError(f"{path}: the sharding tree does not have the structure of the checkpoint's tree "
                         f"(checkpoint.abstract(path) gives it; {len(placed)} leaves for {len(leaves)} arrays)")
    bad = [type(x).__name__ for x in placed if not is_sharding(x)]
    if bad:
        raise ValueError(f"{path}: every leaf of the sharding tree must be a jax.sharding.Sharding, got {bad[0]}")
    return {specs[id(leaf)].key: s for leaf, s in zip(leaves, placed)}


def load(path: str | os.PathLike, *, sharding: Any = None, verify: bool = True, check_finite: bool = False) -> Any:
    """Read a checkpoint written by :func:`save`: the same tree, classes, static fields and bits.

    sharding: where to place the JAX arrays: one ``jax.sharding.Sharding`` for all (default: this
    process's first device, ``jax.local_devices()[0]``: under ``jax.distributed`` the first
    device of ``jax.devices()`` belongs to process 0), or a pytree of Shardings shaped like
    :func:`abstract` (``jax.tree.map`` over it), each array then restored directly onto its own sharding (every device reads only its
    shard). NumPy leaves come back as NumPy arrays. verify: check each array's CRC-32 against the
    sidecar. check_finite: refuse floating arrays holding NaN or Inf (NonFiniteWeightsError).
    Raises :class:`CheckpointError` for a missing, incomplete, corrupt or inconsistent checkpoint,
    ValueError for a sharding tree that does not fit it.
    """
    import orbax.checkpoint as ocp

    path, sidecar = _read_sidecar(path)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    # Pass 1: validate the sidecar and collect the leaves (abstract arrays stand in for data).
    tree, specs = _abstract_tree(path, sidecar)
    placement = _shardings_by_key(path, tree, specs, sharding)

    stored_specs = [s for s in specs.values() if math.prod(s.shape)]
    restored: dict[str, Any] = {}
    if stored_specs:
        restored = _restore_arrays(path, stored_specs, placement, ocp)

    def leaf(spec: _LeafSpec) -> Any:
        if not math.prod(spec.shape):
            value = np.zeros(spec.shape, spec.dtype)
            return value if spec.numpy else jax.device_put(value, placement[spec.key])
        value = restored[spec.key]
        value = np.asarray(value) if spec.numpy else value
        if not spec.numpy and not isinstance(value, jax.Array):
            value = jax.device_put(value, placement[spec.key])
        if tuple(value.shape) != spec.shape or jnp.dtype(value.dtype) != spec.dtype:
            raise CheckpointError(
                f"{path}: {spec.where} came back as {jnp.dtype(value.dtype).name}{list(value.shape)}, "
                f"expected {spec.dtype.name}{list(spec.shape)}"
            )
        if verify and _crc32(value) != spec.crc32:
            raise CheckpointError(f"{path}: checksum mismatch for {spec.where}: the array data is corrupt")
        return value

    # Pass 2: the real tree.
    tree = _build(sidecar["tree"], "tree", leaf)
    if check_finite:
        _check_finite_tree(tree, path)
    return tree


def _check_finite_tree(tree: Any, where: str) -> None:
    check_finite(leaves_with_names(tree), where)


@contextlib.contextmanager
def _quiet_orbax_logs():
    """Orbax logs a warning line before raising on unreadable metadata; the error says it all."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


_CLOSED_LOOP_FILTER_INSTALLED = False


def _quiet_closed_loop_reports() -> None:
    """Drop the "Event loop is closed" reports a failed Orbax restore leaves behind.

    Orbax runs each restore on a fresh asyncio loop and closes it as soon as one read fails;
    TensorStore then completes the reads still in flight, and each completion callback finds
    the loop closed and reports ``RuntimeError('Event loop is closed')`` through
    ``sys.unraisablehook`` (hundreds of tracebacks, arriving after the error was raised, also
    in an interpreter that keeps running). Those reports, and only those, are dropped; every
    other unraisable exception goes to the hook that was installed before. No thread or loop
    outlives the restore (the loop is closed; TensorStore's own pool is shared and idle).
    """
    global _CLOSED_LOOP_FILTER_INSTALLED
    if _CLOSED_LOOP_FILTER_INSTALLED:
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        if _is_orbax_coroutine(unraisable.object):  # a read task of the closed loop, collected
            return
        previous(unraisable)

    sys.unraisablehook = hook
    _CLOSED_LOOP_FILTER_INSTALLED = True


def _is_orbax_coroutine(obj: Any) -> bool:
    code = getattr(obj, "cr_code", None)
    return code is not None and "orbax" in code.co_filename


def _drain_failed_restore(timeout: float = 10.0) -> None:
    """Wait for the reads a failed restore left in flight and collect their tasks now, while
    :func:`_quiet_closed_loop_reports` is in place (not at some later garbage collection, or
    at interpreter exit, where the default hook would print each one)."""
    import gc
    import time
    import types
    import warnings

    asyncio_log = logging.getLogger("asyncio")  # "exception was never retrieved" of the gathering future
    level = asyncio_log.level
    asyncio_log.setLevel(logging.CRITICAL)
    deadline = time.monotonic() + timeout
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "coroutine ... was never awaited"; deprecated objects met by the scan
            while True:
                gc.collect()
                pending = any(isinstance(o, types.CoroutineType) and _is_orbax_coroutine(o) for o in gc.get_objects())
                if not pending or time.monotonic() > deadline:
                    gc.collect()
                    return
                time.sleep(0.02)
    finally:
        asyncio_log.setLevel(level)


def _root_cause(e: BaseException) -> BaseException:
    seen = set()
    while (e.__cause__ or e.__context__) is not None and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return e


def _read_error(path: str, e: BaseException, specs: dict[str, _LeafSpec]) -> CheckpointError:
    """One line for an Orbax / TensorStore read failure: the array, the file, what is wrong."""
    text = str(e) + " " + str(_root_cause(e))
    key = re.search(r"""["'/]?\b(a\d+)/""", text)
    array = f" of {specs[key.group(1)].where}" if key and key.group(1) in specs else ""
    cause = _root_cause(e)
    detail = str(cause).split("See full TensorStore details")[0].split("\n")[0]
    truncated = any(w in detail for w in ("OUT_OF_RANGE", "not valid for value of size", "Unexpected end", "truncated"))
    what = "truncated" if truncated else "corrupt or unreadable"
    return CheckpointError(
        f"{path}: the array data{array} under {ARRAYS}/ is {what} ({type(cause).__name__}: {one_line(detail, 240)})"
    )


def _restore_arrays(path: str, specs: list[_LeafSpec], placement: dict[str, Any], ocp) -> dict[str, Any]:
    arrays_path = os.path.join(path, ARRAYS)
    if not os.path.isdir(arrays_path):
        raise CheckpointError(f"{path}: array data directory {ARRAYS}/ is missing")
    expected = {s.key: s for s in specs}
    _quiet_closed_loop_reports()
    with ocp.StandardCheckpointer() as ckptr, _quiet_orbax_logs():
        try:
            item = getattr(ckptr.metadata(arrays_path), "item_metadata", None)
        except Exception as e:  # noqa: BLE001  (Orbax raises many types)
            raise CheckpointError(f"{path}: cannot read the array metadata under {ARRAYS}/ (incomplete or damaged "
                                  f"data: {type(e).__name__}: {one_line(e, 200)})") from None
        try:
            stored = {k: (tuple(v.shape), jnp.dtype(v.dtype)) for k, v in dict(item.tree).items()}
        except (AttributeError, TypeError, ValueError):
            raise CheckpointError(f"{path}: the array metadata under {ARRAYS}/ is missing or unreadable "
                                  "(incomplete or damaged data)") from None
        missing = sorted(set(expected) - set(stored))
        if missing:
            names = ", ".join(expected[k].where for k in missing[:5])
            raise CheckpointError(f"{path}: {len(missing)} arrays ({names}) are not in the data")
        extra = sorted(set(stored) - set(expected))
        if extra:
            raise CheckpointError(f"{path}: the data holds {len(extra)} arrays that the sidecar does not describe")
        for k, s in expected.items():
            if stored[k] != (s.shape, s.dtype):
                shape, dtype = stored[k]
                raise CheckpointError(
                    f"{path}: sidecar and array data disagree: {s.where} is {s.dtype.name}{list(s.shape)} in the "
                    f"sidecar but {dtype.name}{list(shape)} in the data"
                )
        abstract = {
            k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=None if s.numpy else placement[k])
            for k, s in expected.items()
        }
        try:
            return ckptr.restore(arrays_path, abstract)
        except Exception as e:  # noqa: BLE001
            error = _read_error(path, e, expected)
        _drain_failed_restore()
        raise error from None
