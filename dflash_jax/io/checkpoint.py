"""Hugging Face safetensors loading (no torch) and orbax save/restore of parameter trees.

This sits between ``config.py`` and the model code (``layers``/``target``/drafter): the model builds
``expected`` ({canonical key: ShapeDtypeStruct}) from its config, and ``load_state`` finds each key in
a checkpoint directory, checks its shape, casts it and places it on device. Canonical keys are the
text-only HF names in HF orientation (Linear weights [out, in]): a parameter's path, or for a parameter
holding a pytree (an MXFP4 weight's codes + scales) one key per array (``tensor_keys``, Quark's
``.weight`` + ``.weight_scale``). Otherwise this module knows nothing about the
model beyond two normalisations of file keys: ``model.language_model.`` -> ``model.`` and per-expert
MoE tensors stacked into the fused ``experts.gate_up_proj`` [E, 2I, D] / ``experts.down_proj`` [E, D, I].
Tensors are read one at a time with seek + readinto, so a 27B model never needs two host copies.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from dflash_jax.io import atomic


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or does not match the expected parameters."""


# safetensors dtype names -> little-endian numpy dtypes (the format is little-endian by spec).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype(np.bool_),
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 << 20  # the safetensors library's own limit; a larger length means a corrupt file
_PREFIX = ("model.language_model.", "model.")
# ``.weight_scale``: an MXFP4 expert's e8m0 scales (``tensor_keys``), stacked like its codes.
_PER_EXPERT = re.compile(
    r"^(?P<group>.+\.experts)\.(?P<e>\d+)\.(?P<proj>(gate|up|down)_proj)\.weight(?P<scale>_scale)?$")


@dataclass(frozen=True)
class _Entry:
    """One tensor in one file: where its bytes are, and what they are."""

    key: str  # the file key, as written
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_safetensors_header(file) -> tuple[dict, int]:
    """Parses the 8-byte little-endian length + JSON header; returns (header, data_start)."""
    file = Path(file)
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes, no header length)")
            n = int.from_bytes(head, "little")
            if n > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{file}: corrupt or truncated header (length {n}, file {size} bytes)")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: cannot read safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt header (JSON is not an object)")
    data_start, data_len = 8 + n, size - 8 - n
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
            ok = all(type(d) is int and d >= 0 for d in shape) and type(begin) is int and type(end) is int
            ok = ok and 0 <= begin <= end
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: corrupt header entry {key!r}: {info!r}") from None
        if not ok or end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"{file}: corrupt header entry {key!r}: {info!r}")
        if end > data_len:
            raise CheckpointError(f"{file}: truncated: {key!r} ends at byte {end}, data has {data_len} bytes")
        spans.append((begin, end, key))
    # As the safetensors library: the tensors tile the data exactly, in offset order, with no gap or overlap
    # (otherwise one tensor could silently read another's bytes).
    at = 0
    for begin, end, key in sorted(spans):
        if begin != at:
            what = "overlaps the previous tensor" if begin < at else f"leaves a gap at byte {at}"
            raise CheckpointError(f"{file}: corrupt header: {key!r} (data_offsets [{begin}, {end}]) {what}")
        at = end
    if at != data_len:
        raise CheckpointError(f"{file}: corrupt header: tensors cover {at} of the {data_len} data bytes")
    return header, data_start


def matrices_in(tensors, dtype) -> dict[str, np.ndarray]:
    """``tensors`` ((key, array) pairs or a dict) as numpy arrays, every matrix (ndim >= 2) cast to ``dtype`` (e.g.
    bfloat16: half the bytes; the loaders cast to the dtype they are asked for), the vectors (norms, GDN decays)
    as they are; ``dtype`` None: all as they are."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    return {k: np.asarray(v).astype(jax.numpy.dtype(dtype)) if dtype is not None and np.ndim(v) >= 2 else np.asarray(v)
            for k, v in items}


def write_safetensors(file, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Writes ``tensors`` in the standard safetensors format (atomically: ``atomic.file_writer``)."""
    file = Path(file)
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    arrays, offset = [], 0
    for key, a in tensors.items():
        a = np.asarray(a)
        name = _DTYPE_NAMES.get(a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype)
        if name is None:
            raise CheckpointError(f"{file}: cannot write {key!r}: unsupported dtype {a.dtype}")
        a = np.asarray(a, dtype=DTYPES[name], order="C")  # byte-swaps big-endian input; keeps 0-d shapes
        header[key] = {"dtype": name, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        arrays.append(a)
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # pad so the data starts 8-byte aligned, as the reference writer does
    with atomic.file_writer(file) as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for a in arrays:
            f.write(a.reshape(-1).view(np.uint8).data)  # uint8 view: the buffer protocol rejects bf16


def checkpoint_files(path) -> dict[str, Path]:
    """key -> file for a directory holding ``model.safetensors`` or a sharded index (or for one file)."""
    path = Path(path)
    if path.is_file():
        return dict.fromkeys(_keys(path), path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: cannot read weight_map: {e}") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
        root = path.resolve()
        for shard in sorted(set(weight_map.values())):
            # Lexically first (nothing outside is touched), then with symlinks resolved.
            if Path(shard).is_absolute() or ".." in Path(shard).parts or not (path / shard).resolve().is_relative_to(
                    root):
                raise CheckpointError(f"{index}: shard path {shard!r} points outside the checkpoint directory")
            if not (path / shard).is_file():
                raise CheckpointError(f"shard {shard} named by {index} is missing")
        return {key: path / shard for key, shard in weight_map.items()}
    single = path / "model.safetensors"
    if single.is_file():
        return dict.fromkeys(_keys(single), single)
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _keys(file: Path) -> list[str]:
    return [k for k in read_safetensors_header(file)[0] if k != "__metadata__"]


def _entries(files: dict[str, Path]) -> dict[str, _Entry]:
    """Reads each file's header once and resolves every key to its bytes."""
    headers = {f: read_safetensors_header(f) for f in sorted(set(files.values()))}
    out = {}
    for key, file in files.items():
        header, data_start = headers[file]
        if key not in header:
            raise CheckpointError(f"{file}: has no tensor {key!r}, though the index lists it there")
        info = header[key]
        begin, end = info["data_offsets"]
        dtype, shape = DTYPES[info["dtype"]], tuple(info["shape"])
        out[key] = _Entry(key, file, dtype, shape, data_start + begin, end - begin)
    return out


def _read(f, entry: _Entry) -> np.ndarray:
    """One tensor's bytes into a fresh host array of the file's dtype."""
    buf = np.empty(entry.nbytes, np.uint8)
    f.seek(entry.start)
    if f.readinto(buf) != entry.nbytes:
        raise CheckpointError(f"{entry.file}: truncated while reading {entry.key!r}")
    return buf.view(entry.dtype).reshape(entry.shape)


def to_device(key: str, host: np.ndarray) -> jax.Array:
    """``load_state``'s default placement: the whole tensor on the default device."""
    return jax.device_put(host)


def tensor_keys(key: str, value) -> list[str]:
    """The checkpoint keys of one parameter's arrays, in ``jax.tree.leaves`` order (``key``: its path joined by
    dots): an array is stored at ``key``; a pytree value (an MXFP4 weight, ``layers.MXFP4Weight``: codes + scales)
    stores its first leaf there and each other at ``<key>_<field>``, AMD Quark's layout (``q_proj.weight`` codes +
    ``q_proj.weight_scale``, ``experts.gate_up_proj`` + ``experts.gate_up_proj_scale``)."""
    paths = [path for path, _ in jax.tree_util.tree_leaves_with_path(value)]
    return [key if i == 0 else f"{key}_{path[-1].name}" for i, path in enumerate(paths)]


def param_tensors(params) -> Iterator[tuple[str, object, nnx.Variable]]:
    """(checkpoint key, array, its parameter) for every array of an ``nnx.State`` (keys: ``tensor_keys``)."""
    for path, v in nnx.to_flat_state(params):
        value = v.get_value()
        for key, leaf in zip(tensor_keys(".".join(map(str, path)), value), jax.tree.leaves(value), strict=True):
            yield key, leaf, v


def load_params(path, model, *, ignore: Sequence[str] = (), place: Callable[[str, np.ndarray], jax.Array] = to_device,
                progress: bool = True, aliases: Mapping[str, str] | None = None):
    """``(graphdef, params)`` of an abstract NNX model (built under ``nnx.eval_shape``) filled from the checkpoint
    at ``path``: every array's checkpoint key is its parameter's path joined by dots (``tensor_keys``), and
    ``load_state`` checks them all (``ignore``, ``place``, ``progress`` and ``aliases`` as there) before any data is
    read. The one load sequence of every model."""
    graphdef, abstract = nnx.split(model)
    arrays = load_state(path, {key: a for key, a, _ in param_tensors(abstract)}, ignore=ignore, place=place,
                        progress=progress, aliases=aliases)

    def filled(path_, v):
        value = v.get_value()
        leaves = [arrays[k] for k in tensor_keys(".".join(map(str, path_)), value)]
        return v.replace(jax.tree.unflatten(jax.tree.structure(value), leaves))

    return graphdef, nnx.from_flat_state([(p, filled(p, v)) for p, v in nnx.to_flat_state(abstract)])


def load_state(
    path,
    expected: Mapping[str, jax.ShapeDtypeStruct],
    *,
    ignore: Sequence[str] = (),
    place: Callable[[str, np.ndarray], jax.Array] = to_device,
    progress: bool = True,
    aliases: Mapping[str, str] | None = None,
) -> dict[str, jax.Array]:
    """Loads exactly the keys of ``expected`` from the checkpoint at ``path``.

    File keys matching any regex in ``ignore`` (``re.match``, tried on the file key and on its
    normalised form) are skipped. Every mismatch (missing, unexpected, duplicated, mis-shaped tensor)
    is found from the headers alone and raised as one CheckpointError before any data is read.
    ``place(canonical key, host array)`` puts each tensor on device(s) as it is read. ``aliases``: file keys
    (after the prefix normalisation) read as another canonical key (a drafter's codebooks stored without
    ``.weight``); a tensor present under both names is reported as appearing twice.
    """
    ignore_re = [re.compile(p) for p in ignore]
    entries = _entries(checkpoint_files(path))

    # canonical key -> a single entry, or {(expert, proj): entry} for per-expert tensors to stack.
    plan: dict[str, _Entry | dict[tuple[int, str], _Entry]] = {}
    group_prefix: dict[str, str] = {}  # canonical group -> the file's own group name, for error messages
    problems: list[str] = []
    for key, entry in entries.items():
        canon = _PREFIX[1] + key[len(_PREFIX[0]):] if key.startswith(_PREFIX[0]) else key
        canon = (aliases or {}).get(canon, canon)
        if any(r.match(key) or r.match(canon) for r in ignore_re):
            continue
        m = _PER_EXPERT.match(canon)
        if m and canon not in expected:
            group, e, proj = m["group"], int(m["e"]), m["proj"]
            canon = (f"{group}.down_proj" if proj == "down_proj" else f"{group}.gate_up_proj") + (m["scale"] or "")
            if canon not in expected or e >= expected[canon].shape[0]:
                problems.append(f"unexpected tensor {key!r} in {entry.file.name}")
                continue
            pieces = plan.setdefault(canon, {})
            if not isinstance(pieces, dict):
                problems.append(f"{canon!r} is in {entry.file.name} both fused and as per-expert {key!r}")
                continue
            pieces[e, proj] = entry
            group_prefix[canon] = key[: len(key) - len(m.group(0)) + len(group)]
        elif canon not in expected:
            problems.append(f"unexpected tensor {key!r} in {entry.file.name}")
        elif canon in plan:
            problems.append(f"{canon!r} appears twice: {key!r} in {entry.file.name} and an earlier tensor")
        else:
            plan[canon] = entry

    for canon, spec in expected.items():
        want = tuple(spec.shape)
        got = plan.get(canon)
        floating = jax.numpy.issubdtype(spec.dtype, jax.numpy.floating)
        for ent in [] if got is None else [got] if isinstance(got, _Entry) else got.values():
            # A float parameter reads any float storage (cast), an integer one any integer storage (range checked
            # as read); raw bytes (uint8: MXFP4 codes and scales) only their own dtype: a cast changes what they
            # encode.
            if floating and not jax.numpy.issubdtype(ent.dtype, jax.numpy.floating):
                problems.append(f"{ent.key!r} in {ent.file}: stored as {_DTYPE_NAMES[ent.dtype]}, but "
                                f"{canon!r} is a floating-point parameter")
            elif not floating and (ent.dtype != np.dtype(spec.dtype) if np.dtype(spec.dtype) == np.uint8
                                   else ent.dtype.kind not in "iu"):
                problems.append(f"{ent.key!r} in {ent.file}: stored as {_DTYPE_NAMES[ent.dtype]}, but {canon!r} "
                                f"must be {_DTYPE_NAMES.get(np.dtype(spec.dtype), np.dtype(spec.dtype).name)} "
                                "(its bytes are read as they are, never cast)")
        if got is None:
            problems.append(f"missing tensor {canon!r} with shape {want}")
        elif isinstance(got, _Entry):
            if got.shape != want:
                problems.append(f"shape mismatch for {canon!r}: expected {want}, found {got.shape} "
                                f"({got.key!r} in {got.file.name})")
        else:
            # Per-expert pieces: gate/up [I, D] fill halves of [E, 2I, D]; down [D, I] fills [E, D, I].
            scale = "_scale" if canon.endswith("_scale") else ""
            projs = ("down_proj",) if canon.removesuffix(scale).endswith(".down_proj") else ("gate_proj", "up_proj")
            piece = want[1:] if len(projs) == 1 else (want[1] // 2, *want[2:])
            for e in range(want[0]):
                for proj in projs:
                    if (e, proj) not in got:
                        problems.append(f"missing tensor '{group_prefix[canon]}.{e}.{proj}.weight{scale}' "
                                        f"with shape {piece} (for {canon!r} {want})")
                    elif got[e, proj].shape != piece:
                        ent = got[e, proj]
                        problems.append(f"shape mismatch for {ent.key!r} in {ent.file.name}: "
                                        f"expected {piece}, found {ent.shape}")
    if problems:
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointError(f"checkpoint {path} does not match the expected parameters:\n  "
                              + "\n  ".join(problems[:20]) + more)

    def first(spec) -> _Entry:
        return spec if isinstance(spec, _Entry) else min(spec.values(), key=lambda x: (x.file, x.start))

    # Read in file order, so a sharded checkpoint streams through each shard front to back.
    order = sorted(expected, key=lambda k: (first(plan[k]).file, first(plan[k]).start))
    out: dict[str, jax.Array] = {}
    with contextlib.ExitStack() as stack, tqdm(total=len(order), desc="loading", unit="tensor",
                                                disable=not progress) as bar:
        handles: dict[Path, object] = {}

        def handle(file: Path):
            if file not in handles:
                handles[file] = stack.enter_context(open(file, "rb"))
            return handles[file]

        stack.enter_context(np.errstate(over="ignore", invalid="ignore"))  # overflow in a cast is reported below
        for canon in order:
            spec, dtype = plan[canon], expected[canon].dtype
            if isinstance(spec, _Entry):
                stored = _read(handle(spec.file), spec)
                host = stored.astype(dtype, copy=False)
                if host.dtype.kind in "iu" and host is not stored and not np.array_equal(host, stored):
                    raise CheckpointError(f"{spec.file}: {spec.key!r} holds values outside {np.dtype(dtype).name}, "
                                          f"the dtype of {canon!r}")
            else:
                host = np.empty(expected[canon].shape, dtype)  # filled expert by expert
                half = host.shape[1] // 2  # gate rows first, then up rows
                rows = {"gate_proj": slice(0, half), "up_proj": slice(half, None), "down_proj": slice(None)}
                for (e, proj), ent in spec.items():
                    host[e, rows[proj]] = _read(handle(ent.file), ent)
            if not _all_finite(host):
                files = sorted({e.file.name for e in ([spec] if isinstance(spec, _Entry) else spec.values())})
                raise CheckpointError(f"{path}: tensor {canon!r} (in {', '.join(files)}) holds NaN or Inf values "
                                      f"(after the cast to {np.dtype(dtype).name})")
            out[canon] = place(canon, host)
            del host  # drop the host copy before the next tensor
            bar.update(1)
    return {k: out[k] for k in expected}


# Exponent masks: a float is NaN or Inf exactly when all its exponent bits are set (one integer pass).
_EXPONENT = {np.dtype("<f4"): (np.uint32, 0x7F800000), np.dtype(ml_dtypes.bfloat16): (np.uint16, 0x7F80),
             np.dtype("<f2"): (np.uint16, 0x7C00), np.dtype("<f8"): (np.uint64, 0x7FF0000000000000)}


def _all_finite(a: np.ndarray) -> bool:
    """No NaN/Inf in a host array (integer arrays trivially pass)."""
    if a.dtype in _EXPONENT:
        view, mask = _EXPONENT[a.dtype]
        m, bits = view(mask), a.reshape(-1).view(view)
        step = 1 << 24  # bounded temporaries for multi-GB tensors
        return not any(np.any((bits[i:i + step] & m) == m) for i in range(0, bits.size, step))
    if jax.numpy.issubdtype(a.dtype, jax.numpy.floating):
        return bool(np.isfinite(a.astype(np.float32)).all())
    return True


def _flat_shapes(tree, is_leaf=None) -> dict[str, tuple[int, ...]]:
    """'a/b/0' -> shape, with path parts as plain strings so dict/list/attr containers compare equal."""
    def part(k) -> str:
        return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return {"/".join(part(k) for k in path): tuple(leaf.shape) for path, leaf in leaves}


def save_orbax(path, params) -> None:
    """Writes a pytree of arrays as an orbax checkpoint at a new ``path`` (inside an ``atomic`` writer)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(Path(path).absolute(), params, force=True)
        ckptr.wait_until_finished()


META = "dflash_jax.json"  # what a saved tree records about itself (e.g. {"gdn_channels": ...})


def write_meta(directory: Path, meta: dict) -> None:
    """Records ``meta`` (JSON) in ``directory``, for ``read_meta``; inside an atomic write, before its manifest."""
    (directory / META).write_text(json.dumps(meta))


def read_meta(directory: Path) -> dict:
    """The record ``write_meta`` left in ``directory``; {} where none was written."""
    try:
        return json.loads((directory / META).read_text())
    except FileNotFoundError:
        return {}


def check_meta(path, stored: dict, needed: dict, remedy: str) -> None:
    """Raises ``CheckpointError`` naming ``path``, the stored and the needed value, and ``remedy`` (what to
    do) unless ``stored`` records every key of ``needed`` with its value."""
    for key, want in needed.items():
        if stored.get(key) != want:
            got = f"records {key} {stored[key]!r}" if key in stored else f"records no {key}"
            raise CheckpointError(f"{path} {got}, this dflash_jax needs {key} {want!r}; {remedy}")


def save_params(path, params, meta: dict | None = None) -> None:
    """Saves a pytree of arrays with orbax at ``path``, replacing what is there atomically (an interrupted
    save keeps the previous checkpoint) with a manifest that ``restore_params`` verifies, and with ``meta``
    (JSON) recorded beside the tree for ``restore_params`` to check."""
    with atomic.directory_writer(path) as tmp:
        save_orbax(tmp / "state", params)
        if meta is not None:
            write_meta(tmp, meta)
        atomic.write_manifest(tmp)


def verify(path, what: str, *, checksums: bool = False) -> None:
    """``atomic.verify_manifest`` as a ``CheckpointError``: every file there with its size (done before each
    load) and, with ``checksums``, its SHA-256 (a full read of the data)."""
    try:
        atomic.verify_manifest(path, what, checksums=checksums)
    except atomic.IntegrityError as e:
        raise CheckpointError(str(e)) from None


def restore_params(path, abstract_params, meta: dict | None = None):
    """Restores a tree saved by ``save_params``; ``abstract_params`` gives the structure, shapes and dtypes
    (ShapeDtypeStructs, with a sharding to place the leaves, or arrays). Every key of ``meta`` must be
    recorded with its value (``save_params(meta=...)``): a tree of the right shapes laid out otherwise (one
    saved before the record existed) is refused, not misread."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if not path.is_dir():
        raise CheckpointError(f"no orbax checkpoint at {path}")
    root = path
    if (root / atomic.MANIFEST).exists():  # written by save_params; older checkpoints have the tree here
        verify(root, "checkpoint")
        path = root / "state"
    check_meta(root, read_meta(root), meta or {},
               "it was saved for another layout (no record: saved before the layout was recorded) and cannot be "
               "resumed: delete it, or the run's checkpoint directory, and train again")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_params)
    with ocp.StandardCheckpointer() as ckptr:
        try:
            stored = _flat_shapes(ckptr.metadata(path).item_metadata.tree, lambda x: hasattr(x, "shape"))
        except Exception as e:  # orbax raises assorted types for a directory that is not a checkpoint
            raise CheckpointError(f"{path}: not a readable orbax checkpoint: {e}") from e
        wanted = _flat_shapes(abstract)
        if stored != wanted:
            diff = sorted(k for k in stored.keys() | wanted.keys() if stored.get(k) != wanted.get(k))
            lines = [f"{k}: stored {stored.get(k, 'absent')}, expected {wanted.get(k, 'absent')}"
                     for k in diff]
            raise CheckpointError(f"{path}: tree does not match:\n  " + "\n  ".join(lines[:20]))
        try:
            return ckptr.restore(path, abstract)
        except ValueError as e:
            raise CheckpointError(f"{path}: cannot restore: {e}") from e
