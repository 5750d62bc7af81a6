"""A tiny causal LM and word-level tokenizer built fully offline, for tests, CPU quickstarts and docs.

    from hgpo_trl.models.tiny import make_tiny
    model, tokenizer = make_tiny("keydoor", make_tasks("keydoor", "train"))             # word-level tokenizer
    model, tokenizer = make_tiny("alfworld", tasks, tokenizer="path/to/qwen2.5-tokenizer", vocab_rows=151936)

`make_tiny` is the one way to get a tiny model for an environment (train.py's `model_name_or_path: tiny`, with
`tiny_tokenizer` / `tiny_vocab_rows`, calls it). The pieces:

    from hgpo_trl.models.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny

    tokenizer = build_tiny_tokenizer(["You are in the kitchen.", "go to hall"])
    model = build_tiny_model(tokenizer)
    path = save_tiny(model, tokenizer, "/tmp/tiny")  # AutoModelForCausalLM / AutoTokenizer load it offline

The tokenizer lower-cases its input and splits it on whitespace and punctuation ("door." -> "door", "."),
so decoding cannot restore case or spacing: ``decode`` joins all tokens, tags and "\\n" included, with
single spaces. Hence ``decode(encode("go to hall")) == "go to hall"``, while
``"<action>go to hall</action>"`` decodes as ``"<action> go to hall </action>"``, which
``re.search(r"<action>(.*?)</action>", text)`` followed by ``strip()`` still parses as ``"go to hall"``.
"""

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, IM_START, IM_END, UNK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"
# Not special: TRL decodes completions with skip_special_tokens=True, which would drop special tags and
# newlines before reward functions could parse them.
TAG_TOKENS = ("<think>", "</think>", "<action>", "</action>", "\n")
# Role names the chat template writes, so rendered prompts never contain <unk>.
ROLE_WORDS = ("system", "user", "assistant")
AUTO_MAP = {"AutoTokenizer": [None, "TokenizersBackend"]}

# ChatML as in Qwen2.5, without Qwen's default system message.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_tokenizer(corpus: Iterable[str], extra_words: Iterable[str] = ()) -> PreTrainedTokenizerFast:
    """Train a word-level tokenizer on `corpus` plus `extra_words`; every word seen gets an id."""
    tokenizer = Tokenizer(models.WordLevel(unk_token=UNK))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    # The trainer's default vocab_size (30000) would silently drop rare words; keep them all.
    trainer = trainers.WordLevelTrainer(vocab_size=2**31 - 1, special_tokens=[PAD, IM_START, IM_END, UNK])
    tokenizer.train_from_iterator([*corpus, *extra_words, *ROLE_WORDS], trainer)
    # Added tokens are matched on the raw text before splitting, so tags stay whole and "\n" survives.
    tokenizer.add_tokens([AddedToken(token, normalized=False) for token in TAG_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=4096,  # as make_tiny's context (RoPE: no parameters depend on it)
        chat_template=CHAT_TEMPLATE,
    )
    # transformers 5.x loads any tokenizer next to a "qwen2" config.json as Qwen2Tokenizer, which rebuilds a
    # byte-level BPE from the vocab and silently garbles a word-level tokenizer. With this auto_map entry,
    # AutoTokenizer / AutoProcessor (trust_remote_code=False, the default) use the generic TokenizersBackend,
    # which reads tokenizer.json as saved. Kept in init_kwargs, every save_pretrained writes it: save_tiny's,
    # the trainer's checkpoints and its final save_model.
    fast.init_kwargs["auto_map"] = AUTO_MAP
    return fast


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
    max_position_embeddings: int = 512,
    vocab_rows: int | None = None,
) -> Qwen2ForCausalLM:
    """A randomly initialised float32 Qwen2 model sized for `tokenizer`, deterministic in `seed`. `vocab_rows`:
    embedding rows, at least len(tokenizer) (real Qwen2.5 checkpoints have more rows than tokens: 151,936 for
    0.5B-3B, 152,064 for 7B); default len(tokenizer)."""
    if vocab_rows is not None and vocab_rows < len(tokenizer):
        raise ValueError(f"vocab_rows ({vocab_rows}) must be at least the tokenizer's {len(tokenizer)} tokens")
    config = Qwen2Config(
        # len() counts the added tag tokens; tokenizer.vocab_size does not.
        vocab_size=vocab_rows or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        dtype="float32",
        # None: the tokenizer has no BOS (as in Qwen2.5), and transformers' Trainer would reset other values.
        bos_token_id=tokenizer.bos_token_id,
        # Copied into model.generation_config too, so generate() (and TRL) stop completions at <|im_end|>.
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # Seed a forked RNG so building a model leaves the caller's global torch RNG untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.eval()  # as from_pretrained returns it


def save_tiny(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, directory: str | Path) -> Path:
    """Save both with save_pretrained and point the model's `_name_or_path` at the directory.

    TRL rebuilds its reference model (beta != 0) from `model.config._name_or_path`, so save before training.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    model.config._name_or_path = str(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_tiny(env_name: str, tasks: Sequence[Mapping[str, Any]] = (), *, tokenizer: str | Path | None = None,
              env_kwargs: Mapping[str, Any] | None = None, history_length: int = 2, max_steps: int = 8,
              hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, vocab_rows: int | None = None,
              max_position_embeddings: int | None = None, seed: int = 0, progress: bool = False
              ) -> tuple[Qwen2ForCausalLM, Any]:
    """(model, tokenizer): a tiny Qwen2-architecture model for environment `env_name`, offline.

    `tokenizer=None` trains a word-level tokenizer on the texts of random episodes of `tasks` (prompts,
    admissible actions, observations; needs `tasks`). A folder (or a loaded tokenizer) uses that tokenizer, e.g.
    Qwen2.5's byte-level BPE, so the model sees what a real Qwen model sees; give it `vocab_rows=151936` to be
    shaped like Qwen2.5-0.5B-3B's embeddings. `max_position_embeddings`: default 4096 for the word-level
    tokenizer (its prompts are short) and 32768, Qwen2.5's, for a given one.
    """
    if tokenizer is None:
        from hgpo_trl.envs import make_env
        from hgpo_trl.models.warmstart import environment_corpus

        if not tasks:
            raise ValueError("make_tiny without a tokenizer builds a word-level one from the environment's texts: "
                             "pass the tasks to play")
        env = make_env(env_name, **(env_kwargs or {}))
        try:
            tok = build_tiny_tokenizer(environment_corpus(env, list(tasks), history_length=history_length,
                                                          max_steps=max_steps, progress=progress))
        finally:
            env.close()
        context = max_position_embeddings or 4096
    else:
        tok = tokenizer if not isinstance(tokenizer, str | Path) else load_tokenizer_folder(tokenizer)
        context = max_position_embeddings or 32768
    model = build_tiny_model(tok, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, seed=seed,
                             max_position_embeddings=context, vocab_rows=vocab_rows)
    return model, tok


def load_tokenizer_folder(folder: str | Path):
    """A tokenizer saved in `folder` (tokenizer.json / tokenizer_config.json), offline; a clear error otherwise."""
    from transformers import AutoTokenizer

    path = Path(folder).expanduser()
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()):
        raise ValueError(f"tiny_tokenizer: {path} is not a tokenizer folder (no tokenizer.json or "
                         "tokenizer_config.json there)")
    return AutoTokenizer.from_pretrained(str(path))
