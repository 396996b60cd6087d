"""Prompts: the tokenizer, the chat template, and left-padded, length-bucketed prompt ids.

One PODS step starts here: questions [P] -> chat-template strings [P] -> left-padded
int32 ids [P, Lp] + mask. ``Lp`` is rounded up to a bucket so that the jitted
sampler sees few distinct shapes and does not recompile for every new length.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from typing import Any, Sequence

import numpy as np

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant that solves problems. First think the problem through step by step "
    "inside <think> </think> tags. Then write only the final answer inside <answer> </answer> tags. "
    "Use exactly this format: <think> reasoning here </think><answer> final answer here </answer>"
)
# For base models, which have no chat template. ``{system}`` and ``{question}`` are filled in.
PLAIN_TEMPLATE = "{system}\n\nUser: {question}\nAssistant:"
# A checkpoint's tokenizer: one of these holds its vocabulary (fast, SentencePiece, BPE, WordPiece).
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
# One prompt renders in milliseconds; a chat template still rendering after this long loops.
CHAT_TEMPLATE_TIMEOUT_S = 10.0


class PromptError(ValueError):
    """A tokenizer cannot be loaded or a prompt cannot be built."""


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__


def load_tokenizer(path: str | os.PathLike, **kwargs: Any):
    """Loads the tokenizer saved in a checkpoint directory, from local files only.

    Args:
        path: a directory holding tokenizer.json / tokenizer_config.json.
        **kwargs: passed to ``AutoTokenizer.from_pretrained``.

    Raises:
        PromptError: the directory is missing or holds no loadable tokenizer.
    """
    from transformers import AutoTokenizer

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise PromptError(f"tokenizer directory not found: {path}")
    if not any(os.path.isfile(os.path.join(path, name)) for name in VOCABULARY_FILES):
        # Else transformers builds an empty tokenizer from config.json alone, and the run
        # fails later on prompts that tokenize to nothing.
        raise PromptError(f"{path}: the checkpoint has no tokenizer (looked for {', '.join(VOCABULARY_FILES)}); "
                          "copy the tokenizer files of the model it was saved from into it")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError/ValueError/...; report one line
        raise PromptError(f"cannot load a tokenizer from {path} ({_first_line(exc)})") from None


def token_id_count(tokenizer) -> int:
    """How many token ids the tokenizer can produce: its largest id + 1 (added tokens included)."""
    try:
        return max(tokenizer.get_vocab().values()) + 1
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return len(tokenizer)


def check_vocab(tokenizer, vocab_size: int, where: str) -> None:
    """Refuses a tokenizer whose ids reach past the model's embedding rows.

    A smaller tokenizer is fine (Qwen pads its embedding past the vocabulary); a larger one
    indexes rows that do not exist, which JAX clamps silently instead of failing.

    Raises:
        PromptError: the tokenizer has more token ids than the model's vocabulary.
    """
    ids = token_id_count(tokenizer)
    if ids > vocab_size:
        raise PromptError(f"{where}: the tokenizer has {ids} token ids but the model's vocabulary (vocab_size) "
                          f"has {vocab_size}; ids {vocab_size} and up have no embedding row, so the tokenizer "
                          "does not belong to these weights")


def has_chat_template(tokenizer) -> bool:
    """True when the tokenizer carries a chat template (instruct models do, base models do not)."""
    return bool(getattr(tokenizer, "chat_template", None))


def build_prompt(
    tokenizer,
    question: str,
    *,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    use_chat_template: bool | None = None,
    plain_template: str = PLAIN_TEMPLATE,
) -> str:
    """Turns a question into the prompt text the model continues.

    Args:
        tokenizer: a Hugging Face tokenizer.
        question: the problem text.
        system_prompt: the instructions; None or "" for none. The default asks for
            ``<think>...</think><answer>...</answer>``.
        use_chat_template: None picks the chat template when the tokenizer has one
            and ``plain_template`` otherwise (base models).
        plain_template: a format string with ``{system}`` and ``{question}``.

    Returns:
        The prompt text, ending where the assistant's answer starts.
    """
    use_chat = has_chat_template(tokenizer) if use_chat_template is None else use_chat_template
    if use_chat and not has_chat_template(tokenizer):
        raise PromptError("use_chat_template=True but the tokenizer has no chat template")
    if not use_chat:
        return plain_template.format(system=system_prompt or "", question=question).lstrip()
    messages = [{"role": "user", "content": question}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - jinja raises TemplateError for templates without a system role
        if not system_prompt:
            raise PromptError(f"the chat template failed ({_first_line(exc)})") from None
    # Some templates (e.g. Gemma's) reject a system turn: put the instructions in the user turn.
    merged = [{"role": "user", "content": f"{system_prompt}\n\n{question}"}]
    try:
        return tokenizer.apply_chat_template(merged, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001
        raise PromptError(f"the chat template failed ({_first_line(exc)})") from None


class _RenderTimeout(BaseException):
    # A BaseException: build_prompt's `except Exception` must not take it for a template error.
    pass


def _raise_render_timeout(signum, frame):
    raise _RenderTimeout()


def check_chat_template(tokenizer, question: str, *, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
                        timeout_s: float | None = None) -> str:
    """Renders one prompt as a run would, within ``timeout_s`` (default ``CHAT_TEMPLATE_TIMEOUT_S``).

    A chat template is code from the checkpoint; one that loops would hang the run at its
    first step. Checked before a run writes anything, it is one line instead.

    Returns:
        The rendered prompt.

    Raises:
        PromptError: the template fails, or runs past the bound.
    """
    timeout_s = CHAT_TEMPLATE_TIMEOUT_S if timeout_s is None else timeout_s
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < 1e6:
        raise ValueError(f"timeout_s must be a number of seconds > 0; got {timeout_s!r}")  # 0 would turn the alarm off
    where = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
    too_slow = PromptError(f"the chat template of {where} took more than {timeout_s:g} s to render one prompt "
                           "(a loop in the template?); fix chat_template in its tokenizer_config.json or "
                           "chat_template.jinja")
    if threading.current_thread() is not threading.main_thread():
        # No signals here: render in a thread; one that overruns is abandoned, and the run stops anyway.
        result: dict[str, Any] = {}

        def render():
            try:
                result["text"] = build_prompt(tokenizer, question, system_prompt=system_prompt)
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller
                result["error"] = exc

        worker = threading.Thread(target=render, name="chat-template-check", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            raise too_slow
        if "error" in result:
            raise result["error"]
        return result["text"]
    # A real-time alarm interrupts the template's Python loop (jinja compiles templates to Python).
    previous = signal.signal(signal.SIGALRM, _raise_render_timeout)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            return build_prompt(tokenizer, question, system_prompt=system_prompt)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _RenderTimeout:
        raise too_slow from None
    finally:
        signal.signal(signal.SIGALRM, previous)


def build_prompts(tokenizer, questions: Sequence[str], **kwargs: Any) -> list[str]:
    """``build_prompt`` over a list of questions."""
    return [build_prompt(tokenizer, question, **kwargs) for question in _texts(questions, "questions")]


def _texts(values: Sequence[str], what: str) -> list[str]:
    """``values`` as a list of texts: one text would be split into its characters, one prompt each."""
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{what} must be a list of texts; got one {type(values).__name__} ({values[:40]!r})")
    values = list(values)
    odd = next((i for i, v in enumerate(values) if not isinstance(v, str)), None)
    if odd is not None:
        raise TypeError(f"{what} must be a list of texts; item {odd} is {type(values[odd]).__name__}")
    return values


@dataclasses.dataclass(frozen=True)
class Bucketing:
    """How prompt lengths round up to a few padded shapes, capped at the longest allowed.

    Every bucket is one more compile of prefill, decode and the update, so the default
    is few of them: powers of two from 64, then ``max_prompt_length`` itself (4 buckets
    for 512).

    Attributes:
        mode: "pow2" rounds up to a power of two; "multiple" to a multiple of ``multiple``.
        multiple: the step of "multiple" mode.
        min_length: the smallest bucket in either mode.
    """

    mode: str = "pow2"
    multiple: int = 64
    min_length: int = 64

    def __post_init__(self):
        if self.mode not in ("multiple", "pow2"):
            raise ValueError(f"Bucketing.mode must be 'multiple' or 'pow2', got {self.mode!r}")
        for name in ("multiple", "min_length"):  # a float had made a padded length of 64.5
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"Bucketing.{name} must be an integer >= 1, got {value!r}")

    def __call__(self, length: int, max_length: int | None = None) -> int:
        """The padded length for a longest prompt of ``length`` tokens (at most ``max_length``)."""
        length = max(int(length), self.min_length)
        if self.mode == "pow2":
            padded = 1 << (length - 1).bit_length()
        else:
            padded = -(-length // self.multiple) * self.multiple
        return padded if max_length is None else max(min(padded, max_length), min(length, max_length))

    def lengths(self, max_length: int) -> tuple[int, ...]:
        """Every padded length a run with prompts of at most ``max_length`` tokens can see."""
        return tuple(sorted({self(n, max_length) for n in range(1, max_length + 1)}))


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """Left-padded prompt ids, ready for the sampler.

    Attributes:
        ids_PL: int32 [P, Lp], left-padded with ``pad_id``; P counts kept prompts.
        mask_PL: int32 [P, Lp], 1 on prompt tokens, 0 on padding.
        lengths_P: int32 [P], tokens per kept prompt.
        kept_P: int64 [P], index of each kept prompt in the input list.
        num_dropped: prompts dropped for being longer than ``max_prompt_length``.
        pad_id: the padding token id.
    """

    ids_PL: np.ndarray
    mask_PL: np.ndarray
    lengths_P: np.ndarray
    kept_P: np.ndarray
    num_dropped: int
    pad_id: int

    def padded_rows(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """``(ids [rows, Lp], mask [rows, Lp])``: the kept prompts, then copies of the last one.

        A sampler call of a fixed row count reuses one executable; the copies' results are
        dropped by the caller (the first P rows are the real prompts).
        """
        p = len(self.ids_PL)
        if not 1 <= p <= rows:
            raise ValueError(f"cannot pad {p} prompts to {rows} rows")
        return tuple(np.concatenate([x, np.repeat(x[-1:], rows - p, axis=0)]) for x in (self.ids_PL, self.mask_PL))


# Tokens that end a chat turn: Qwen2.5's <|im_end|>; Llama 3 Instruct's <|eot_id|>,
# <|eom_id|> and <|end_of_text|> (128009, 128008, 128001: its generation config's list,
# which transformers' generate, and so the authors' trainer, stops at).
END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")


def eos_token_ids(tokenizer) -> tuple[int, ...]:
    """Every id that ends a completion: the tokenizer's EOS plus the :data:`END_TOKENS` it knows."""
    vocab = tokenizer.get_vocab()
    ids = {tokenizer.eos_token_id} | {vocab[t] for t in END_TOKENS if t in vocab}
    ids.discard(None)
    if not ids:
        raise ValueError("the tokenizer has no EOS token; set tokenizer.eos_token")
    return tuple(sorted(ids))


def decode_completions(tokenizer, tokens_BT: np.ndarray, mask_BT: np.ndarray) -> list[str]:
    """Completion texts of sampled token rows, each cut at its mask."""
    return tokenizer.batch_decode([t[v] for t, v in zip(tokens_BT, mask_BT)], skip_special_tokens=True)


def pad_token_id(tokenizer) -> int:
    """The pad id: the tokenizer's pad token, else its EOS (masked out anyway), else 0."""
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(candidate, (list, tuple)):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def tokenize_prompts(
    tokenizer,
    prompts: Sequence[str],
    *,
    max_prompt_length: int,
    bucketing: Bucketing | None = None,
    add_special_tokens: bool | None = None,
) -> PromptBatch:
    """Tokenizes prompt texts into left-padded, bucketed int32 arrays.

    Args:
        tokenizer: a Hugging Face tokenizer.
        prompts: [P] prompt texts (from ``build_prompts``).
        max_prompt_length: longer prompts are dropped and counted, never truncated
            (a cut question would reward the wrong answer).
        bucketing: how the padded length Lp is chosen (default: powers of two from 64,
            capped at ``max_prompt_length``).
        add_special_tokens: None adds them only without a chat template, whose
            rendered text already holds BOS and the like.

    Returns:
        A PromptBatch with one row per kept prompt, in input order.
    """
    if isinstance(max_prompt_length, bool) or not isinstance(max_prompt_length, (int, np.integer)) \
            or max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be an integer >= 1, got {max_prompt_length!r}")
    bucketing = bucketing or Bucketing()
    if add_special_tokens is None:
        add_special_tokens = not has_chat_template(tokenizer)
    prompts = _texts(prompts, "prompts")
    encoded = tokenizer(prompts, add_special_tokens=add_special_tokens)["input_ids"] if prompts else []
    kept = []
    for index, ids in enumerate(encoded):
        if not ids:
            raise PromptError(f"prompt {index} tokenizes to no tokens")
        if len(ids) <= max_prompt_length:
            kept.append(index)
    lengths = np.asarray([len(encoded[i]) for i in kept], np.int32)
    width = bucketing(int(lengths.max()) if len(kept) else 0, max_prompt_length)
    pad_id = pad_token_id(tokenizer)
    ids_PL = np.full((len(kept), width), pad_id, np.int32)
    mask_PL = np.zeros((len(kept), width), np.int32)
    for row, index in enumerate(kept):
        ids = encoded[index]
        ids_PL[row, width - len(ids):] = ids
        mask_PL[row, width - len(ids):] = 1
    return PromptBatch(ids_PL, mask_PL, lengths, np.asarray(kept, np.int64), len(prompts) - len(kept), pad_id)


def prepare_prompts(tokenizer, questions: Sequence[str], *, max_prompt_length: int, bucketing: Bucketing | None = None,
                    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
                    use_chat_template: bool | None = None) -> PromptBatch:
    """Questions -> templated prompts -> a PromptBatch (``build_prompts`` then ``tokenize_prompts``)."""
    use_chat = has_chat_template(tokenizer) if use_chat_template is None else use_chat_template
    texts = build_prompts(tokenizer, questions, system_prompt=system_prompt, use_chat_template=use_chat)
    return tokenize_prompts(
        tokenizer, texts, max_prompt_length=max_prompt_length, bucketing=bucketing, add_special_tokens=not use_chat
    )
