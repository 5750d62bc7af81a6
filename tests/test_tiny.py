"""The offline tiny model and tokenizer: vocabulary, tags, decoding, chat template, seeding, save/reload."""

import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

from hgpo_trl.models.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny

CORPUS = [
    "You are in the Kitchen. There is a door to the hall!",
    "go to hall",
    "Do not open the door, take the key",
]
TAGS = ["<think>", "</think>", "<action>", "</action>"]
PROMPT = [{"role": "user", "content": "go to hall"}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(CORPUS, extra_words=["north south"])


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_model(tokenizer)


def tokens(tokenizer, text):
    return tokenizer.convert_ids_to_tokens(tokenizer.encode(text))


def test_vocab_covers_corpus_and_extra_words(tokenizer):
    vocab = tokenizer.get_vocab()
    words = {w for text in CORPUS for w in re.findall(r"\w+|[^\w\s]", text.lower())}
    assert words | {"north", "south", "system", "user", "assistant", "\n"} <= vocab.keys()
    for ids in tokenizer([*CORPUS, "north south"])["input_ids"]:
        assert tokenizer.unk_token_id not in ids


def test_lowercases_splits_punctuation_and_maps_unknown_words_to_unk(tokenizer):
    assert tokens(tokenizer, "Open the DOOR.") == ["open", "the", "door", "."]
    assert tokens(tokenizer, "go to zebra") == ["go", "to", "<unk>"]


def test_special_tokens(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.unk_token == "<unk>"
    assert len({tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}) == 3


def test_vocab_is_deterministic(tokenizer):
    assert build_tiny_tokenizer(CORPUS, extra_words=["north south"]).get_vocab() == tokenizer.get_vocab()


def test_tags_and_newline_are_single_tokens(tokenizer):
    for tag in [*TAGS, "\n"]:
        assert tokens(tokenizer, tag) == [tag]
    assert tokens(tokenizer, "<think>hall</think>\n<action>Go to hall</action>") == [
        "<think>", "hall", "</think>", "\n", "<action>", "go", "to", "hall", "</action>",
    ]  # fmt: skip


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decode_joins_tokens_with_spaces_and_keeps_tags(tokenizer, skip_special_tokens):
    # TRL decodes completions with skip_special_tokens=True: the tags must survive it.
    def decode(text):
        return tokenizer.decode(tokenizer.encode(text), skip_special_tokens=skip_special_tokens)

    assert decode("go to hall") == "go to hall"
    assert decode("Do not open the door.") == "do not open the door ."
    text = decode("<action>go to hall</action>")
    assert text == "<action> go to hall </action>"
    assert re.search(r"<action>(.*?)</action>", text).group(1).strip() == "go to hall"
    assert tokenizer.encode(text) == tokenizer.encode("<action>go to hall</action>")


def test_chat_template_renders_chatml(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "open the door"}, *PROMPT], add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|im_start|>system\nopen the door<|im_end|>\n"
        "<|im_start|>user\ngo to hall<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.convert_ids_to_tokens(ids) == [
        "<|im_start|>", "user", "\n", "go", "to", "hall", "<|im_end|>", "\n",
        "<|im_start|>", "assistant", "\n",
    ]  # fmt: skip


def test_forward_logits_shape(model, tokenizer):
    assert model.config.vocab_size == len(tokenizer)  # includes the added tag tokens
    assert model.dtype == torch.float32 and model.lm_head.weight is model.model.embed_tokens.weight
    input_ids = torch.tensor(tokenizer(["go to hall", "open the door"])["input_ids"])
    with torch.no_grad():
        assert model(input_ids).logits.shape == (2, 3, len(tokenizer))


class ForceToken(LogitsProcessor):
    def __init__(self, token_id):
        self.token_id = token_id

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, -float("inf"))
        forced[:, self.token_id] = 0.0
        return forced


def test_generate_runs_to_the_limit_or_stops_at_im_end(model, tokenizer):
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt").input_ids
    n = prompt.shape[1]
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    # A word that is not eos: generation runs to max_new_tokens.
    hall = ForceToken(tokenizer.convert_tokens_to_ids("hall"))
    out = model.generate(prompt, max_new_tokens=5, do_sample=False, logits_processor=[hall])
    assert out.shape == (1, n + 5)
    # <|im_end|> ends generation after one token.
    im_end = ForceToken(tokenizer.eos_token_id)
    out = model.generate(prompt, max_new_tokens=5, do_sample=False, logits_processor=[im_end])
    assert out[0, n:].tolist() == [tokenizer.eos_token_id]
    assert model.generate(prompt, max_new_tokens=3, do_sample=True).shape[1] <= n + 3


def test_seed_determines_weights_and_leaves_global_rng_alone(model, tokenizer):
    rng_state = torch.get_rng_state()
    same, other = build_tiny_model(tokenizer, seed=0), build_tiny_model(tokenizer, seed=1)
    assert torch.equal(torch.get_rng_state(), rng_state)
    weights, same_weights, other_weights = model.state_dict(), same.state_dict(), other.state_dict()
    assert all(torch.equal(weights[k], same_weights[k]) for k in weights)
    assert not torch.equal(weights["model.embed_tokens.weight"], other_weights["model.embed_tokens.weight"])


def test_save_and_reload_offline(model, tokenizer, tmp_path):
    path = save_tiny(model, tokenizer, tmp_path / "tiny")
    assert model.config._name_or_path == str(path)  # where TRL rebuilds its reference model from
    loaded_model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    loaded_tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)

    text = "You see a Zebra.\n<think>hall</think><action>go to hall</action>"
    assert loaded_tokenizer.encode(text) == tokenizer.encode(text)
    assert loaded_tokenizer.decode(tokenizer.encode(text)) == tokenizer.decode(tokenizer.encode(text))
    chat = {"add_generation_prompt": True, "return_tensors": "pt"}
    input_ids = tokenizer.apply_chat_template(PROMPT, **chat)["input_ids"]
    assert torch.equal(loaded_tokenizer.apply_chat_template(PROMPT, **chat)["input_ids"], input_ids)
    assert loaded_tokenizer.eos_token_id == tokenizer.eos_token_id
    assert loaded_tokenizer.pad_token_id == tokenizer.pad_token_id

    with torch.no_grad():
        assert torch.equal(loaded_model(input_ids).logits, model(input_ids).logits)
    assert loaded_model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_plain_save_pretrained_reloads_as_saved_even_after_a_reload(model, tokenizer, tmp_path):
    """The trainer saves checkpoints and its final model with save_pretrained, not save_tiny: the tokenizer
    must still reload as the word-level tokenizer it is (not as a garbled Qwen2 BPE), also when a reloaded
    tokenizer is saved again, as a resumed run does."""
    text = "You see a Zebra.\n<action>go to hall</action>"
    first = tmp_path / "first"
    model.save_pretrained(first)
    tokenizer.save_pretrained(first)
    reloaded = AutoTokenizer.from_pretrained(first, local_files_only=True)
    second = tmp_path / "second"
    model.save_pretrained(second)
    reloaded.save_pretrained(second)
    for path in (first, second):
        loaded = AutoTokenizer.from_pretrained(path, local_files_only=True)
        assert loaded.encode(text) == tokenizer.encode(text)
        assert loaded.unk_token_id not in loaded.encode("go to hall")


def test_the_quickstart_s_tokenizer_is_the_one_its_figures_were_measured_with():
    """The tiny tokenizer's words are the environment's texts and the format instructions of the text action
    modes: a new mode's instruction (or any new text in the corpus) changed the quickstart's vocabulary, so its
    model, its measured learning, and the resume of a run saved before the change (the embedding rows differ)."""
    from hgpo_trl.envs import make_tasks
    from hgpo_trl.models.tiny import make_tiny

    tasks = list(make_tasks("keydoor", "train", num_rooms=6, num_colors=6))  # configs/quickstart.yaml's
    _, tokenizer = make_tiny("keydoor", tasks, env_kwargs={"coin_reward": 0.0, "key_reward": 3.0}, hidden_size=16,
                             num_layers=1, num_heads=2)
    assert len(tokenizer) == 78
