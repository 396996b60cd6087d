"""Prompts: a locally built tokenizer, chat and plain templates, left padding, buckets, drops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from podsjax.data.prompts import (DEFAULT_SYSTEM_PROMPT, Bucketing, PromptError, build_prompt, decode_completions, eos_token_ids, has_chat_template, load_tokenizer, pad_token_id, prepare_prompts, tokenize_prompts)
from tiny_tokenizer import CHATML_TEMPLATE, IM_END, PAD, save_tiny_tokenizer


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    return load_tokenizer(save_tiny_tokenizer(tmp_path_factory.mktemp("chat_tok")))


@pytest.fixture(scope="module")
def base_tokenizer(tmp_path_factory):
    return load_tokenizer(save_tiny_tokenizer(tmp_path_factory.mktemp("base_tok"), chat_template=None))


# ------------------------------------------------------------------ loading


def test_load_tokenizer_from_a_saved_directory(chat_tokenizer, base_tokenizer):
    assert has_chat_template(chat_tokenizer) and not has_chat_template(base_tokenizer)
    assert chat_tokenizer.pad_token == PAD and chat_tokenizer.eos_token == IM_END
    text = "Natalia sold 48 clips. <answer>72</answer>"
    ids = chat_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert chat_tokenizer.decode(ids) == text


def test_load_tokenizer_errors_are_one_line(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    for path, fragment in [(tmp_path / "missing", "tokenizer directory not found"), (broken, "cannot load a tokenizer"),
                           (tmp_path, "the checkpoint has no tokenizer (looked for tokenizer.json")]:
        with pytest.raises(PromptError) as info:
            load_tokenizer(path)
        assert fragment in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------- templates


def test_chat_prompt_has_system_user_and_generation_header(chat_tokenizer):
    assert "<think>" in DEFAULT_SYSTEM_PROMPT and "<answer>" in DEFAULT_SYSTEM_PROMPT
    prompt = build_prompt(chat_tokenizer, "What is 2 + 2?")
    assert prompt == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    bare = build_prompt(chat_tokenizer, "What is 2 + 2?", system_prompt=None)
    assert bare == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"


def test_base_model_gets_the_plain_template(base_tokenizer, chat_tokenizer):
    prompt = build_prompt(base_tokenizer, "What is 2 + 2?", system_prompt="Be brief.")
    assert prompt == "Be brief.\n\nUser: What is 2 + 2?\nAssistant:"
    forced = build_prompt(chat_tokenizer, "Q?", system_prompt="S", use_chat_template=False)
    assert forced == "S\n\nUser: Q?\nAssistant:"
    with pytest.raises(PromptError, match="no chat template"):
        build_prompt(base_tokenizer, "Q?", use_chat_template=True)


def test_template_without_a_system_role_gets_the_instructions_in_the_user_turn(tmp_path):
    strict = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "<start>{{ m['role'] }}: {{ m['content'] }}<end>{% endfor %}{% if add_generation_prompt %}<start>model: {% endif %}"
    )
    tokenizer = load_tokenizer(save_tiny_tokenizer(tmp_path, chat_template=strict))
    assert build_prompt(tokenizer, "Q?", system_prompt="S") == "<start>user: S\n\nQ?<end><start>model: "


# ------------------------------------------------------------- tokenization


def test_left_padding_mask_lengths_and_round_trip(chat_tokenizer):
    questions = ["Hi?", "What is 48 / 2 + 48? Show the steps.", "Compute \\frac{1}{2} + \\frac{1}{3}."]
    batch = prepare_prompts(chat_tokenizer, questions, max_prompt_length=512)
    texts = [build_prompt(chat_tokenizer, q) for q in questions]
    expected = [chat_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert batch.ids_PL.dtype == np.int32 and batch.mask_PL.dtype == np.int32
    longest = max(map(len, expected))
    assert batch.ids_PL.shape == (3, max(64, 1 << (longest - 1).bit_length()))  # the next power of two
    assert batch.num_dropped == 0 and batch.kept_P.tolist() == [0, 1, 2]
    assert batch.lengths_P.tolist() == [len(e) for e in expected]
    assert batch.pad_id == chat_tokenizer.pad_token_id
    width = batch.ids_PL.shape[1]
    for row, ids in enumerate(expected):
        pad = width - len(ids)
        assert batch.ids_PL[row, pad:].tolist() == ids  # tokens flush right
        assert (batch.ids_PL[row, :pad] == batch.pad_id).all()
        assert batch.mask_PL[row].tolist() == [0] * pad + [1] * len(ids)
        assert chat_tokenizer.decode(batch.ids_PL[row][batch.mask_PL[row] == 1]) == texts[row]


def test_long_prompts_are_dropped_and_counted(chat_tokenizer):
    long_question = "clips " * 300
    questions = ["Short?", long_question, "Also short?", long_question]
    batch = prepare_prompts(chat_tokenizer, questions, max_prompt_length=256)
    assert batch.num_dropped == 2
    assert batch.kept_P.tolist() == [0, 2]
    assert batch.ids_PL.shape[0] == 2 and 0 < batch.lengths_P.max() <= 256
    # The limit is inclusive: a prompt of exactly max_prompt_length tokens stays.
    exact = prepare_prompts(chat_tokenizer, ["Short?"], max_prompt_length=int(batch.lengths_P[0]))
    assert exact.num_dropped == 0
    below = prepare_prompts(chat_tokenizer, ["Short?"], max_prompt_length=int(batch.lengths_P[0]) - 1)
    assert below.num_dropped == 1 and below.ids_PL.shape[0] == 0


def test_bucketing_rules():
    assert [Bucketing()(n) for n in (0, 1, 64, 65, 300)] == [64, 64, 64, 128, 512]
    assert [Bucketing()(n, 400) for n in (1, 65, 300)] == [64, 128, 400]  # capped at the longest allowed
    assert Bucketing().lengths(512) == (64, 128, 256, 512)  # a run compiles for at most these
    assert Bucketing().lengths(500) == (64, 128, 256, 500)
    assert Bucketing(mode="multiple").lengths(200) == (64, 128, 192, 200)
    pow2 = Bucketing(mode="pow2", min_length=16)
    assert [pow2(n) for n in (1, 16, 17, 100, 129)] == [16, 16, 32, 128, 256]
    assert Bucketing(multiple=8, min_length=8)(9) == 16
    with pytest.raises(ValueError, match="mode"):
        Bucketing(mode="exact")
    with pytest.raises(ValueError, match="multiple"):
        Bucketing(multiple=0)


def test_new_lengths_in_one_bucket_do_not_recompile(chat_tokenizer):
    bucketing = Bucketing(mode="pow2", min_length=32)
    first = prepare_prompts(chat_tokenizer, ["Hi?", "What is 2 + 2?"], max_prompt_length=512, bucketing=bucketing)
    second = prepare_prompts(chat_tokenizer, ["Natalia sold 48 clips; how many?"], max_prompt_length=512, bucketing=bucketing)
    assert first.lengths_P.max() != second.lengths_P.max()

    @jax.jit
    def last_token(ids_PL, mask_PL):
        return jnp.sum(ids_PL * mask_PL, axis=-1)

    outputs = []
    for batch in (first, second):
        ids = np.zeros((2, batch.ids_PL.shape[1]), np.int32)
        ids[: len(batch.ids_PL)] = batch.ids_PL
        mask = np.zeros_like(ids)
        mask[: len(batch.mask_PL)] = batch.mask_PL
        outputs.append(last_token(ids, mask))
    assert first.ids_PL.shape[1] == second.ids_PL.shape[1]
    assert last_token._cache_size() == 1
    assert int(outputs[1][0]) == int(second.ids_PL[0][second.mask_PL[0] == 1].sum())


def test_pad_id_fallback_and_edge_cases(base_tokenizer, chat_tokenizer):
    assert pad_token_id(base_tokenizer) == base_tokenizer.pad_token_id

    class NoPad:
        pad_token_id = None
        eos_token_id = [7, 8]

    assert pad_token_id(NoPad()) == 7
    empty = tokenize_prompts(chat_tokenizer, [], max_prompt_length=16)
    assert empty.ids_PL.shape == (0, 16) and empty.num_dropped == 0  # never wider than the longest allowed
    with pytest.raises(PromptError, match="no tokens"):
        tokenize_prompts(chat_tokenizer, [""], max_prompt_length=16)
    with pytest.raises(ValueError, match="max_prompt_length"):
        tokenize_prompts(chat_tokenizer, ["x"], max_prompt_length=0)


def test_chatml_template_is_exported_for_other_tests():
    assert "add_generation_prompt" in CHATML_TEMPLATE


def test_padded_rows_repeat_the_last_prompt_and_completions_decode_up_to_their_mask(chat_tokenizer):
    batch = prepare_prompts(chat_tokenizer, ["What is 2 + 3?", "Tom has 4 apples."], max_prompt_length=512)
    ids, mask = batch.padded_rows(5)
    assert ids.shape == (5, batch.ids_PL.shape[1]) and mask.shape == ids.shape
    np.testing.assert_array_equal(ids[:2], batch.ids_PL)
    np.testing.assert_array_equal(ids[2:], np.repeat(batch.ids_PL[1:], 3, axis=0))
    np.testing.assert_array_equal(mask[2:], np.repeat(batch.mask_PL[1:], 3, axis=0))
    with pytest.raises(ValueError, match="cannot pad 2 prompts to 1 rows"):
        batch.padded_rows(1)
    end = chat_tokenizer.convert_tokens_to_ids(IM_END)
    assert eos_token_ids(chat_tokenizer) == (end,)
    tokens = np.asarray([chat_tokenizer("72", add_special_tokens=False)["input_ids"] + [end, end]])
    valid = np.ones_like(tokens, bool)
    valid[0, -1] = False
    assert decode_completions(chat_tokenizer, tokens, valid) == ["72"]  # special tokens skipped, mask honoured


def test_a_llama_3_completion_ends_at_each_of_its_generation_configs_end_tokens():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"a": 0, "<|end_of_text|>": 128001, "<|eom_id|>": 128008, "<|eot_id|>": 128009}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="a")),
                                        eos_token="<|eot_id|>")
    assert eos_token_ids(tokenizer) == (128001, 128008, 128009)



# ------------------------------------------------------------- time bound

LOOPING = "{% for i in range(100000) %}{% for j in range(REPEATS) %}{% endfor %}{% endfor %}" + CHATML_TEMPLATE


def test_a_chat_template_that_loops_stops_at_the_time_bound(tmp_path, chat_tokenizer):
    import threading
    import time

    from podsjax.data.prompts import check_chat_template

    assert check_chat_template(chat_tokenizer, "Q?", system_prompt="S") == build_prompt(chat_tokenizer, "Q?",
                                                                                          system_prompt="S")
    endless = load_tokenizer(save_tiny_tokenizer(tmp_path / "endless", chat_template=LOOPING.replace("REPEATS",
                                                                                                     "100000")))
    started = time.monotonic()
    with pytest.raises(PromptError, match="took more than 0.5 s to render one prompt"):
        check_chat_template(endless, "Q?", timeout_s=0.5)
    assert time.monotonic() - started < 5
    # Away from the main thread (no signals there) the bound holds too; the render it abandons
    # is a short loop here, so that it ends soon on its own.
    slow = load_tokenizer(save_tiny_tokenizer(tmp_path / "slow", chat_template=LOOPING.replace("REPEATS", "40")))
    raised = []
    checker = threading.Thread(target=lambda: raised.append(pytest.raises(PromptError, check_chat_template, slow,
                                                                          "Q?", timeout_s=0.05)))
    checker.start()
    checker.join(30)
    assert raised and "took more than 0.05 s" in str(raised[0].value)
    # A template that fails is its usual one line, under the bound too.
    broken = load_tokenizer(save_tiny_tokenizer(tmp_path / "broken", chat_template="{{ messages | no_such_filter }}"))
    with pytest.raises(PromptError, match="the chat template failed"):
        check_chat_template(broken, "Q?")


def test_one_text_where_a_list_belongs_is_refused(chat_tokenizer):
    # "What is 2+2?" had become twelve one-character prompts.
    with pytest.raises(TypeError, match="questions must be a list of texts; got one str"):
        prepare_prompts(chat_tokenizer, "What is 2+2?", max_prompt_length=256)
    with pytest.raises(TypeError, match="prompts must be a list of texts; got one str"):
        tokenize_prompts(chat_tokenizer, "What is 2+2?", max_prompt_length=256)
    with pytest.raises(TypeError, match="questions must be a list of texts; item 1 is NoneType"):
        prepare_prompts(chat_tokenizer, ["a", None], max_prompt_length=256)
    for bad in (100.5, "100", None, True):
        with pytest.raises(ValueError, match="max_prompt_length must be an integer >= 1"):
            tokenize_prompts(chat_tokenizer, ["a"], max_prompt_length=bad)


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), float("inf")])
def test_a_chat_template_bound_that_is_no_bound_is_refused(chat_tokenizer, timeout_s):
    from podsjax.data.prompts import check_chat_template

    # 0 had turned the alarm off: a looping template would have hung.
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds > 0"):
        check_chat_template(chat_tokenizer, "Q?", timeout_s=timeout_s)


@pytest.mark.parametrize("changes", [dict(multiple=1.5), dict(multiple="64"), dict(min_length=0),
                                     dict(min_length=True)])
def test_bucketing_takes_whole_lengths(changes):
    with pytest.raises(ValueError, match="must be an integer >= 1"):  # 1.5 had padded to 64.5 tokens
        Bucketing(mode="multiple", **changes)
