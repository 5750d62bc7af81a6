"""A tiny causal LM and word-level tokenizer built fully offline, for tests, CPU quickstarts and docs.

    from hgpo_trl.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny

    tokenizer = build_tiny_tokenizer(["You are in the kitchen.", "go to hall"])
    model = build_tiny_model(tokenizer)
    path = save_tiny(model, tokenizer, "/tmp/tiny")  # AutoModelForCausalLM / AutoTokenizer load it offline

The tokenizer lower-cases its input and splits it on whitespace and punctuation ("door." -> "door", "."),
so decoding cannot restore case or spacing: ``decode`` joins all tokens, tags and "\\n" included, with
single spaces. Hence ``decode(encode("go to hall")) == "go to hall"``, while
``"<action>go to hall</action>"`` decodes as ``"<action> go to hall </action>"``, which
``re.search(r"<action>(.*?)</action>", text)`` followed by ``strip()`` still parses as ``"go to hall"``.
"""

from collections.abc import Iterable
from pathlib import Path

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
        model_max_length=512,
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
) -> Qwen2ForCausalLM:
    """A randomly initialised float32 Qwen2 model sized for `tokenizer`, deterministic in `seed`."""
    config = Qwen2Config(
        # len() counts the added tag tokens; tokenizer.vocab_size does not.
        vocab_size=len(tokenizer),
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
