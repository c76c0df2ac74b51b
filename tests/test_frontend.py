"""``frontend.py``: tokenizer checks, prompt encoding against transformers' own chat rendering, methods."""

from __future__ import annotations

import pytest

from dflash_jax import frontend

# The essence of Qwen3/Qwen3.5's template: ChatML turns, the assistant header, the empty think block
# when thinking is off.
QWEN_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer with ChatML special tokens and a Qwen-style chat template, saved as HF does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["def fibonacci(n):\n    return n", "import os\nprint(os.getcwd())", "user assistant system"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 chat_template=QWEN_TEMPLATE)
    path = tmp_path_factory.mktemp("chat_tok")
    hf.save_pretrained(path)
    return path


def test_chat_prompt_is_token_ids_as_transformers_renders_them(chat_tokenizer_dir):
    tok = frontend.load_tokenizer(chat_tokenizer_dir)
    ids = frontend.encode(tok, "def fibonacci(n):")
    assert all(isinstance(i, int) for i in ids)
    # The oracle: transformers' own tokenizing render (a mapping in 5.x, a list in 4.x).
    ref = tok.apply_chat_template([{"role": "user", "content": "def fibonacci(n):"}], add_generation_prompt=True,
                                  tokenize=True, enable_thinking=False)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    assert ids == list(ref)
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids[0] == im_start and ids.count(im_end) == 1
    assert tok.decode(ids) == ("<|im_start|>user\ndef fibonacci(n):<|im_end|>\n<|im_start|>assistant\n"
                               "<think>\n\n</think>\n\n")
    thinking = frontend.encode(tok, "def fibonacci(n):", thinking=True)
    assert tok.decode(thinking).endswith("<|im_start|>assistant\n")
    assert frontend.encoding_name(tok, "auto", False) == "chat template (thinking off)"


def test_raw_and_forced_encodings(chat_tokenizer_dir, tmp_path):
    tok = frontend.load_tokenizer(chat_tokenizer_dir)
    assert frontend.encode(tok, "import os", chat="off") == tok.encode("import os", add_special_tokens=False)
    assert frontend.encoding_name(tok, "off", False) == "raw text"
    plain = frontend.load_tokenizer(frontend.ASSETS / "target") if (frontend.ASSETS / "target").is_dir() else None
    if plain is not None and not plain.chat_template:
        with pytest.raises(ValueError, match="--chat-template on: the tokenizer has no chat template"):
            frontend.encode(plain, "x", chat="on")


def test_a_folder_without_tokenizer_files_is_an_error_naming_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"--tokenizer {tmp_path}: no tokenizer files"):
        frontend.load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match=r"--model .*nowhere: not a directory"):
        frontend.load_tokenizer(tmp_path / "nowhere", flag="--model")


@pytest.mark.parametrize("text, method", [("ar", frontend.AR), ("mtp:7", frontend.Method("mtp", 8)),
                                          (" dflash:16", frontend.Method("dflash", 16))])
def test_parse_method(text, method):
    got = frontend.parse_method(text)
    assert got == method and got.name == text.strip()


@pytest.mark.parametrize("text, match", [("eagle:3", "cannot parse 'eagle:3'"), ("mtp:16", "1..15"),
                                         ("mtp:0", "1..15"), ("dflash:1", ">= 2"), ("dflash:x", "cannot parse")])
def test_parse_method_errors_name_the_flag(text, match):
    with pytest.raises(ValueError, match=match) as e:
        frontend.parse_method(text, flag="--method")
    assert str(e.value).startswith("--method")


def test_default_model_dirs(tmp_path):
    m, d = tmp_path / "m", tmp_path / "d"
    m.mkdir(), d.mkdir()
    assert frontend.model_dirs(None, None) == (frontend.ASSETS / "target", frontend.ASSETS / "drafter")
    assert frontend.model_dirs(str(m), None) == (m, None)
    assert frontend.model_dirs(str(m), str(d)) == (m, d)
    # dflash2:B alone picks the shipped DFlash2 drafter; a user's --draft-model or --model wins
    assert frontend.model_dirs(None, None, dflash2=True) == (frontend.ASSETS / "target", frontend.ASSETS / "dflash2")
    assert frontend.model_dirs(None, str(d), dflash2=True)[1] == d
    assert frontend.model_dirs(str(m), None, dflash2=True) == (m, None)
    parse = frontend.parse_method
    assert frontend.wants_dflash2([parse("dflash2:16"), parse("ar"), parse("mtp:3")])
    assert not frontend.wants_dflash2([parse("dflash2:16"), parse("dflash:16")])
    assert not frontend.wants_dflash2([parse("ar")]) and not frontend.wants_dflash2([parse("ddtree:8")])


def test_default_dtype_is_float32_on_cpu():
    import jax

    assert frontend.default_dtype() == ("float32" if jax.default_backend() == "cpu" else "bfloat16")


shipped = pytest.mark.skipif(not (frontend.ASSETS / "target" / "config.json").is_file(), reason="no shipped models")


@shipped
def test_the_mtp_head_is_loaded_only_when_mtp_is_used():
    import jax.numpy as jnp

    target_dir, draft_dir = frontend.model_dirs(None, None)
    target, drafter = frontend.load_models(target_dir, draft_dir, [frontend.AR], dtype=jnp.float32, progress=False)
    assert drafter is None and not frontend.has_mtp(target)
    target, drafter = frontend.load_models(target_dir, draft_dir, [frontend.parse_method("mtp:3")],
                                          dtype=jnp.float32, progress=False)
    assert drafter is None and frontend.has_mtp(target)
    with pytest.raises(ValueError, match="dflash:32: larger than the drafter's block size"):
        frontend.load_models(target_dir, draft_dir, [frontend.Method("dflash", 32)], dtype=jnp.float32,
                            progress=False)
    with pytest.raises(ValueError, match="give --draft-model"):
        frontend.load_models(target_dir, None, [frontend.Method("dflash", 4)], dtype=jnp.float32, progress=False)


@shipped
def test_draft_trees_run_with_either_drafter():
    """``ddtree:N`` runs with a DFlash drafter (per-position marginals) and with a DFlash2 one (its selector's
    conditionals, ``DFlashProposer.tree``); dflash2:B is still refused for a DFlash drafter, naming the method."""
    import dataclasses

    from dflash_jax.config import DrafterConfig

    _, draft_dir = frontend.model_dirs(None, None)
    one = DrafterConfig.from_pretrained(draft_dir)
    assert not one.dflash2  # the shipped drafter: DFlash
    frontend.check_generation([frontend.parse_method("ddtree:64")], one, draft_dir)
    two = dataclasses.replace(one, num_hidden_layers=1, layer_types=("full_attention",), conv_kernel_size=2,
                              conv_group_size=16, selector_rank=8, selector_top_k=4)
    frontend.check_generation([frontend.parse_method(m) for m in ("dflash2:16", "dflash:8", "ddtree:64",
                                                                  "ddtree:8:4")], two, "DIR")
    with pytest.raises(ValueError, match=r"^dflash2:16: the drafter DIR is a DFlash drafter, not a DFlash2 one"):
        frontend.check_generation([frontend.parse_method("dflash2:16"), frontend.parse_method("ddtree:8")], one,
                                  "DIR")


@shipped
@pytest.mark.slow  # ~40 s of CPU (three compiled loops)
def test_greedy_speculative_decoding_is_lossless_in_bfloat16():
    """bfloat16 (the accelerator default): DFlash at blocks 4 and 16 emits plain decoding's greedy tokens.

    A 16-token verify and a 1-token decode reduce in different orders, so bf16 rounding flips an
    argmax where the top two bf16 logits tie: on the shipped pair, HumanEval/0..15 x 128 tokens, 4 of 16
    rows diverge, each at an exact (or one-ulp) bf16 tie (BUILD.md, MXFP4 section). These 4 prompts x 48
    tokens meet no tie, so any other difference fails here.
    """
    import jax.numpy as jnp

    from dflash_jax.decoding.api import generate

    target_dir, draft_dir = frontend.model_dirs(None, None)
    target, drafter = frontend.load_models(target_dir, draft_dir, [frontend.Method("dflash", 16)],
                                          dtype=jnp.bfloat16, progress=False)
    assert target.dtype == jnp.bfloat16 and drafter.params["fc"]["weight"].get_value().dtype == jnp.bfloat16
    tokenizer = frontend.load_tokenizer(target_dir)
    prompts = [tokenizer.encode(t) for t in ("def fib(n):", "import os\n\ndef list_files(path):\n    ",
                                             "class Stack:\n    def __init__(self):", "for i in range(10):")]
    plain = generate(target, prompts, max_new_tokens=48, stop_ids=()).token_lists()
    for block in (4, 16):
        out = generate(target, prompts, drafter=drafter, block_size=block, max_new_tokens=48, stop_ids=())
        assert out.token_lists() == plain, f"block {block}"
        assert float(out.tau.mean()) > 1.5  # drafts were accepted: the acceptance path ran, not only rejections


def test_a_draft_window_without_a_dflash_method_is_refused_before_loading(tmp_path):
    methods = [frontend.AR, frontend.parse_method("mtp:3")]
    with pytest.raises(ValueError, match="--draft-window 64: bounds a DFlash drafter's context, and none of ar, "
                                         "mtp:3 drafts with one"):
        frontend.load_models(tmp_path / "nothing here", None, methods, dtype="float32", draft_window=64)


def test_a_draft_tree_too_big_for_memory_is_refused_naming_the_bound():
    """``ddtree:N``'s verify holds node-by-node matrices, ~T^2 bytes (T = N + 1): refused in one line before any
    weight loads, naming the largest N that fits; a tree that fits passes."""
    from dflash_jax.config import read_target_config

    cfg = read_target_config(frontend.ASSETS / "target")[0]
    per_pair = frontend.tree_verify_bytes(cfg, 0)
    assert per_pair == 4 * (cfg.num_attention_heads + 5 * cfg.linear_num_value_heads + 1) == 100  # shipped: 4 + 20
    memory = (per_pair * 1001**2, "a 0.1 GB device")  # exactly a 1000-node tree
    frontend.check_tree_fits([frontend.parse_method("ddtree:1000"), frontend.AR], cfg, "--method", memory)
    with pytest.raises(ValueError, match=r"^--method: ddtree:100000: a draft tree of 100,000 nodes .* more than a "
                                         r"0.1 GB device \(0 GB\); at most ddtree:1000 fits$"):
        frontend.check_tree_fits([frontend.parse_method("ddtree:100000")], cfg, "--method", memory)
    frontend.check_tree_fits([frontend.parse_method("ddtree:2000")], cfg)  # this host (2,000 ran fine)


def test_method_names_in_any_case_and_every_form_in_the_error():
    assert frontend.parse_method("DDTREE:16", "--method") == frontend.parse_method("ddtree:16")
    assert frontend.parse_method(" DFlash2:8 ").name == "dflash2:8" and frontend.parse_method("AR") == frontend.AR
    with pytest.raises(ValueError, match=r"^--method: cannot parse 'ddtree'; expected ar, mtp:K .*dflash2:B "
                                         r"\(B >= 2\), or ddtree:N"):
        frontend.parse_method("ddtree", "--method")


def test_each_dflash_method_gets_its_own_shipped_drafter_unless_one_is_given(tmp_path):
    methods = [frontend.parse_method(m) for m in ("ar", "dflash:16", "dflash2:16", "ddtree:8", "mtp:3")]
    dflash, dflash2, tree = methods[1:4]
    assert frontend.draft_dirs(methods, None, None) == {dflash: frontend.ASSETS / "drafter",
                                                        dflash2: frontend.ASSETS / "dflash2",
                                                        tree: frontend.ASSETS / "drafter"}
    assert set(frontend.draft_dirs(methods, None, str(tmp_path)).values()) == {tmp_path}
    assert set(frontend.draft_dirs(methods, "m", None).values()) == {None}


def test_a_missing_folder_is_no_such_directory_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match=r'^--speculative-config "model" /nonexistent: no such directory$'):
        frontend.model_dirs(None, "/nonexistent", draft_flag='--speculative-config "model"')
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r'^--speculative-config "model" .*config.json: is a file'):
        frontend.model_dirs(None, str(tmp_path / "config.json"), draft_flag='--speculative-config "model"')
    with pytest.raises(ValueError, match=r"^--model .*nowhere: no such directory$"):
        frontend.model_dirs(str(tmp_path / "nowhere"), None)
