"""What every front end does before decoding: model folders, dtype, tokenizer, prompt encoding, the method.

Sits above ``decoding/`` and below its front ends: the ``dflash-jax`` command (``cli/``), the server
(``serve/``), the benchmarks and reports (``perf/``) and the drafter's evaluation (``train/``). They resolve the
default models, load and check the tokenizer, encode a prompt and turn a method string (``ar``, ``mtp:K``,
``dflash:B``, ``dflash2:B``, ``ddtree:N``) into a proposer the same way, through this module; prompt files are
read by ``decoding/workloads.py``. Errors are ``ValueError``s whose message names the flag, file or folder the
user gave. Importing it loads neither JAX nor transformers (``dflash-jax --help`` builds its parser from it).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path

import ml_dtypes
import numpy as np

# The shipped small models (``target``, ``drafter``, ``dflash2``); DFLASH_JAX_ASSETS points at another folder of
# that layout.
ASSETS = Path(os.environ.get("DFLASH_JAX_ASSETS", str(Path(__file__).resolve().parent / "assets")))
# --dtype's names -> the parameter dtype (numpy's, which every jnp function takes: no JAX import here)
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
# A folder with none of these holds no tokenizer (transformers would silently build an empty one).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tekken.json",
                   "tokenizer.tiktoken")


def default_dtype() -> str:
    """bfloat16 on accelerators (a 27B target and its drafter fit one H200 only in bf16), float32 on CPU."""
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def model_dirs(model: str | None, draft_model: str | None, dflash2: bool = False,
               draft_flag: str = "--draft-model") -> tuple[Path, Path | None]:
    """(target dir, drafter dir or None): the shipped pair by default (its DFlash2 drafter when ``dflash2``: every
    DFlash method asked for is ``dflash2:B``); no drafter with a user's --model. ``draft_flag``: where the user gave
    the drafter (``--speculative-config``'s "model", say), for errors."""
    draft = model_dir(draft_model, draft_flag) if draft_model else None
    if model is None:
        return ASSETS / "target", draft or ASSETS / ("dflash2" if dflash2 else "drafter")
    return model_dir(model, "--model"), draft


def wants_dflash2(methods) -> bool:
    """Whether the DFlash methods among ``methods`` (``Method``s) are all DFlash2 ones, and there is one."""
    dflash = [m for m in methods if isinstance(m, Method) and m.kind == "dflash"]
    return bool(dflash) and all(m.dflash2 for m in dflash)


def hub_cache() -> Path:
    """Where Hugging Face keeps downloads: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    return Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"


def model_dir(text: str, flag: str) -> Path:
    """The checkpoint directory a ``--model``-like flag names: a folder, or a hub id (``org/name``) found in the
    Hugging Face cache (its ``refs/main`` snapshot, else the newest). Hub ids are never downloaded; a clear error
    names the flag and says how to point at a local copy. A file is refused naming its folder."""
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        raise ValueError(f"{flag} {text}: is a file; give the checkpoint directory that holds config.json"
                         + (f" ({path.parent})" if path.name == "config.json" or path.suffix == ".safetensors" else ""))
    parts = text.split("/")
    if len(parts) == 2 and all(parts) and not text.startswith((".", "~")):
        repo = hub_cache() / f"models--{parts[0]}--{parts[1]}"
        snapshots = sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime) if repo.is_dir() else []
        ref = repo / "refs" / "main"
        pinned = repo / "snapshots" / ref.read_text().strip() if ref.is_file() else None
        found = pinned if pinned is not None and (pinned / "config.json").is_file() else next(
            (s for s in reversed(snapshots) if (s / "config.json").is_file()), None)
        if found is not None:
            return found
        raise ValueError(f"{flag} {text}: no such directory, and hub ids are not downloaded (this library reads "
                         f"local files only). Download it first, e.g. `huggingface-cli download {text}`, then pass "
                         f"the folder it prints (or keep it in the Hugging Face cache, {hub_cache()}, where "
                         f"{flag} {text} finds it)")
    raise ValueError(f"{flag} {text}: no such directory")


def resolve_dtype(flag: str | None, model_dir: Path) -> str:
    """``--dtype``'s value as a parameter dtype name: None is ``default_dtype()``, ``auto`` the checkpoint's own
    (config.json's ``torch_dtype`` / ``dtype``; float16 checkpoints run in bfloat16, float16's range being too
    small), float16 refused with the reason."""
    if flag == "float16":
        raise ValueError("--dtype float16 is not supported: Qwen3.5's activations exceed float16's range (max 65504) "
                         "and would turn to inf; use bfloat16 (the same size, float32's range) or float32")
    if flag != "auto":
        return flag or default_dtype()
    from dflash_jax.config import read_config_json

    raw, _ = read_config_json(model_dir)
    stored = raw.get("torch_dtype") or raw.get("dtype") or (raw.get("text_config") or {}).get("dtype")
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "bfloat16"}.get(stored, default_dtype())


def _no_torch_banner(record: logging.LogRecord) -> bool:
    """transformers announces at import that it found no PyTorch; tokenizers never need it, so say nothing."""
    return "PyTorch was not found" not in record.getMessage()


def load_tokenizer(path: str | Path, flag: str = "--tokenizer"):
    """The Hugging Face tokenizer in folder ``path``; a clear error naming ``flag`` and the folder otherwise."""
    logging.getLogger("transformers").addFilter(_no_torch_banner)  # before the import that prints it
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{flag} {path}: not a directory")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{flag} {path}: no tokenizer files in the folder (expected one of "
                         f"{', '.join(TOKENIZER_FILES)})")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception for a truncated tokenizer.json
        raise ValueError(f"{flag} {path}: no usable tokenizer ({type(e).__name__}: {e})") from None


def uses_chat_template(tokenizer, chat: str) -> bool:
    """``chat`` "auto" (when the tokenizer has a template), "on" (an error without one) or "off"."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat == "on" and not has_template:
        raise ValueError("--chat-template on: the tokenizer has no chat template")
    return chat != "off" and has_template


def encode(tokenizer, text: str, chat: str = "auto", thinking: bool = False) -> list[int]:
    """Token ids of one user turn: rendered by the chat template (as text, then encoded) or the raw text.

    The template is rendered to text rather than tokenized by ``apply_chat_template``, whose
    return type differs between transformers versions (a mapping in 5.x); the rendered text already
    holds every special token, so none are added again.
    """
    if uses_chat_template(tokenizer, chat):
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False, enable_thinking=thinking)
        except Exception as e:  # noqa: BLE001 -- a template is user code (Jinja): it may raise anything
            raise ValueError(f"the tokenizer's chat template failed ({type(e).__name__}: {e}); fix the template, "
                             "or use --chat-template off to encode the raw text") from None
        if not isinstance(text, str):
            raise ValueError(f"the tokenizer's chat template rendered a {type(text).__name__}, not text")
    return list(tokenizer.encode(text, add_special_tokens=False))


def encoding_name(tokenizer, chat: str, thinking: bool) -> str:
    """How ``encode`` makes ids with these settings: "chat template (thinking on/off)" or "raw text"."""
    if uses_chat_template(tokenizer, chat):
        return f"chat template (thinking {'on' if thinking else 'off'})"
    return "raw text"


@dataclasses.dataclass(frozen=True)
class Method:
    """``ar`` (plain decoding), ``mtp:K`` (K MTP steps, block K + 1) or ``dflash:B`` (block B; any DFlash
    drafter, whose checkpoint decides its generation). ``dflash2:B`` is kind "dflash" with ``dflash2`` set: the
    same loop and proposer, and the drafter must be a DFlash2 one (``check_blocks``). ``ddtree:N`` is kind
    "dflash" with ``tree`` N: a draft tree of the N best paths of depth <= block - 1 per step (block
    ``TREE_BLOCK``, z-lab's; ``ddtree:N:B`` another), grown from whichever drafter is given (a DFlash2 one's
    from its candidate selector)."""

    kind: str
    block: int
    dflash2: bool = False
    tree: int | None = None

    @property
    def name(self) -> str:
        if self.tree is not None:
            return f"ddtree:{self.tree}" + ("" if self.block == TREE_BLOCK else f":{self.block}")
        dflash = f"dflash2:{self.block}" if self.dflash2 else f"dflash:{self.block}"
        return {"ar": "ar", "mtp": f"mtp:{self.block - 1}", "dflash": dflash}[self.kind]


AR = Method("ar", 1)
TREE_BLOCK = 16  # a draft tree's block (depth + 1) unless ``ddtree:N:B`` says otherwise


def parse_method(item: str, flag: str = "--methods") -> Method:
    """'ar', 'mtp:K' (K in 1..15), 'dflash:B' or 'dflash2:B' (B >= 2), 'ddtree:N[:B]' -> Method, in any case;
    errors name ``flag``."""
    item = item.strip()
    name = item.lower()  # names in any case: DDTREE:16, DFlash:16
    if name == "ar":
        return AR
    if name.startswith("ddtree:"):
        return _parse_tree(name, flag)
    kind, _, arg = name.partition(":")
    if kind not in ("mtp", "dflash", "dflash2") or not arg.isdigit():
        raise ValueError(f"{flag}: cannot parse {item!r}; expected ar, mtp:K (K in 1..15), dflash:B or dflash2:B "
                         f"(B >= 2), or ddtree:N (a draft tree of N nodes; ddtree:N:B at block B)")
    n = int(arg)
    if kind == "mtp" and not 1 <= n <= 15:
        raise ValueError(f"{flag}: {item!r}: MTP steps K must be in 1..15")
    if kind in ("dflash", "dflash2") and n < 2:
        raise ValueError(f"{flag}: {item!r}: DFlash block B must be >= 2 (block 1 is ar)")
    if kind == "dflash2":
        return Method("dflash", n, dflash2=True)
    return Method(kind, n + 1 if kind == "mtp" else n)


def _parse_tree(item: str, flag: str) -> Method:
    """'ddtree:N' or 'ddtree:N:B' (N >= 1 nodes besides the root, block B >= 2) -> Method."""
    parts = item.split(":")[1:]
    if len(parts) not in (1, 2) or not all(p.isdigit() for p in parts):
        raise ValueError(f"{flag}: cannot parse {item!r}; expected ddtree:N (a draft tree of N nodes, block "
                         f"{TREE_BLOCK}) or ddtree:N:B (block B)")
    n, block = int(parts[0]), int(parts[1]) if len(parts) == 2 else TREE_BLOCK
    if n < 1 or block < 2:
        raise ValueError(f"{flag}: {item!r}: the tree budget N must be >= 1 and the block B >= 2")
    return Method("dflash", block, tree=n)


def tree_verify_bytes(cfg, nodes: int) -> int:
    """Bytes one row's verify of a draft tree of ``nodes`` nodes holds at once, at least: its node-by-node
    float32 matrices [T, T] (T = nodes + 1), one per attention head (the scores) and five per Gated DeltaNet
    value head (the closed-form tree solve: path decays, key products, the triangular inverse and two products),
    plus the ancestor mask. They grow as T squared, so a tree of 100,000 nodes needs about a terabyte: on the
    shipped target (4 + 5 x 4 heads: 100 bytes per node pair) XLA's memory analysis of the tree verify gives
    110 bytes per pair at N = 1023, and N = 100,000 failed allocating 1.01e12 bytes (101 per pair)."""
    per_pair = 4 * (cfg.num_attention_heads + 5 * cfg.linear_num_value_heads + 1)
    return per_pair * (nodes + 1) ** 2


def device_memory() -> tuple[int, str]:
    """(bytes, what they are) of the first local device: an accelerator's memory, or on a CPU the host's RAM."""
    import jax

    device = jax.local_devices()[0]
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit:
        return int(limit), f"the {device.device_kind}'s memory"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this host's RAM"


def check_tree_fits(methods, cfg, where: str = "", memory: tuple[int, str] | None = None) -> None:
    """A one-line error for a ``ddtree:N`` among ``methods`` whose verify cannot fit ``memory`` (bytes, what;
    default: ``device_memory()``) even at batch 1 (``tree_verify_bytes`` of target config ``cfg``), naming the
    largest N that could. ``where``: the flag the method came from. Called before any weight is loaded."""
    trees = [m for m in methods if getattr(m, "tree", None) is not None]
    if not trees:
        return
    limit, what = memory or device_memory()
    limit = int(limit)
    per_pair = tree_verify_bytes(cfg, 0)
    for m in trees:
        need = tree_verify_bytes(cfg, m.tree)
        if need > limit:
            largest = math.isqrt(limit // per_pair) - 1
            fits = f"at most ddtree:{largest} fits" if largest >= 1 else "no tree fits"
            raise ValueError(f"{where + ': ' if where else ''}{m.name}: a draft tree of {m.tree:,} nodes is verified "
                             f"as {m.tree + 1:,} tokens per row in one target pass, whose node-by-node matrices "
                             f"({per_pair} bytes per node pair on this target) need {need / 1e9:,.0f} GB, more than "
                             f"{what} ({limit / 1e9:,.0f} GB); {fits}")


def load_models(model_dir: Path, draft_dir: Path | None, methods, *, dtype, progress: bool = True, mesh=None,
                draft_window: int | None = None):
    """(target, drafter or None) for ``methods``, one drafter (``draft_dir``) for every DFlash method among them
    (``load_target_and_drafters``, which says the rest)."""
    target, drafters = load_target_and_drafters(
        model_dir, {m: draft_dir for m in methods if m.kind == "dflash"}, methods, dtype=dtype, progress=progress,
        mesh=mesh, draft_window=draft_window)
    return target, next(iter(drafters.values()), None)


def draft_dirs(methods, model: str | None, draft_model: str | None,
               draft_flag: str = "--draft-model") -> dict[Method, Path | None]:
    """{DFlash method: its drafter folder}: the user's ``draft_model`` for every one; with the shipped target (no
    ``model``), each method's own shipped drafter (``dflash2:B``: the DFlash2 one; ``dflash:B``, ``ddtree:N``:
    the DFlash one), so ``bench --methods dflash:16,dflash2:16`` runs both; with a user's ``model`` alone, None
    (``load_target_and_drafters`` then asks for --draft-model)."""
    given = model_dir(draft_model, draft_flag) if draft_model else None
    return {m: given or (None if model else ASSETS / ("dflash2" if m.dflash2 else "drafter"))
            for m in methods if m.kind == "dflash"}


def load_target_and_drafters(model_dir: Path, drafters: dict, methods, *, dtype, progress: bool = True, mesh=None,
                             draft_window: int | None = None):
    """(target, {DFlash method: drafter}) for ``methods``: the MTP head only when an MTP method is among them,
    each drafter folder of ``drafters`` ({DFlash method: folder or None}, ``draft_dirs``) loaded once and
    checked against its methods (``check_blocks``); a DFlash method without a folder is an error.
    ``draft_window`` (``--draft-window``): the drafters see at most that many context positions per block.

    Every check that needs no weights runs first (the window, a tree's memory). With a ``mesh``
    (``sharding.make_mesh``) the target's tensors load straight onto their shards; a drafter (small) loads on
    one device and the loop moves it onto the mesh.
    """
    from dflash_jax.models.drafter import load_drafter
    from dflash_jax.models.target import load_target

    kinds = {m.kind for m in methods}
    if draft_window is not None and "dflash" not in kinds:  # before the (long) load: the flag would do nothing
        raise ValueError(f"--draft-window {draft_window}: bounds a DFlash drafter's context, and none of "
                         f"{', '.join(m.name for m in methods)} drafts with one")
    if any(m.kind == "dflash" and drafters.get(m) is None for m in methods):
        raise ValueError(f"DFlash needs a drafter: give --draft-model DIR (the target {model_dir} is not the "
                         f"shipped one, so there is no default drafter)")
    if draft_window is not None:
        from dflash_jax.config import DrafterConfig

        for folder in dict.fromkeys(drafters.values()):
            block = DrafterConfig.from_pretrained(folder).block_size
            if draft_window < block:
                raise ValueError(f"--draft-window {draft_window}: must be >= the drafter's block size {block} "
                                 f"({folder})")
    if any(getattr(m, "tree", None) is not None for m in methods):
        from dflash_jax.config import read_target_config

        check_tree_fits(methods, read_target_config(model_dir)[0])
    target = load_target(model_dir, dtype=dtype, progress=progress, mtp=None if "mtp" in kinds else False, mesh=mesh)
    loaded = {}
    for folder in dict.fromkeys(drafters.values()):
        loaded[folder] = load_drafter(folder, target, window=draft_window, progress=progress)
        check_blocks([m for m, f in drafters.items() if f == folder], loaded[folder], folder)
    return target, {m: loaded[folder] for m, folder in drafters.items()}


def check_blocks(methods, drafter, where) -> None:
    """A clear error naming the DFlash ``methods`` with a block larger than ``drafter``'s (loaded from ``where``),
    or asking for a DFlash2 drafter (``dflash2:B``) where it is a DFlash one."""
    problems = []  # every method blamed at once
    too_big = [m.name for m in methods if m.kind == "dflash" and m.block > drafter.cfg.block_size]
    if too_big:
        problems.append(f"{', '.join(too_big)}: larger than the drafter's block size {drafter.cfg.block_size} "
                        f"({where})")
    try:
        check_generation(methods, drafter.cfg, where)
    except ValueError as e:
        problems.append(str(e))
    if problems:
        raise ValueError("; ".join(problems))


def check_generation(methods, drafter_cfg, where) -> None:
    """A clear error naming the ``methods`` the drafter (config ``drafter_cfg``, from ``where``) cannot run as asked:
    ``dflash2:B`` with a DFlash drafter (its config.json has no DFlash2 fields: conv_kernel_size, ...,
    selector_top_k). ``ddtree:N`` runs with either: a DFlash2 drafter's tree is grown from its candidate
    selector's conditionals (``DFlashProposer.tree``)."""
    wrong = [m.name for m in methods if getattr(m, "dflash2", False) and not drafter_cfg.dflash2]
    if wrong:
        raise ValueError(f"{', '.join(wrong)}: the drafter {where} is a DFlash drafter, not a DFlash2 one (its "
                         f"config.json has no conv_kernel_size / selector_top_k); use dflash:B")


def checkpoint_has_mtp(model_dir: Path) -> bool:
    """Whether the checkpoint at ``model_dir`` holds MTP head weights (``mtp.*``), from its headers alone."""
    from dflash_jax.io import checkpoint
    from dflash_jax.models.target import CONVERTED

    if (model_dir / CONVERTED).is_dir():
        return bool(checkpoint.read_meta(model_dir / CONVERTED).get("mtp"))
    return any(k.startswith("mtp.") for k in checkpoint.checkpoint_files(model_dir))


def has_mtp(target) -> bool:
    """Whether the loaded target carries the MTP head (``mtp.*`` weights)."""
    return "mtp" in target.params


def proposer_for(method: Method, target, drafter):
    """(proposer, proposer params) drafting for ``method`` (``load_models`` loaded what it needs)."""
    from dflash_jax.decoding.mtp import MTPProposer, mtp_params
    from dflash_jax.decoding.proposers import DFlashProposer, NoProposer

    if method.kind == "ar":
        return NoProposer(), ()
    if method.kind == "dflash":
        return DFlashProposer(drafter.cfg, drafter.graphdef), drafter.params

    return MTPProposer.of(target, method.block - 1), mtp_params(target)
