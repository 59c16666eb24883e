"""The random-weight models' tokenizer: a byte-level BPE trained offline, ChatML and Qwen2.5 templates.

Trained on a deterministic, locally generated English-like corpus with the Qwen2 pre-tokenizer
and `ByteLevel` decoder (so mlx-lm picks its BPE streaming detokenizer), ChatML special tokens,
`<tool_call>`/`<think>` tokens, and exactly `vocab_size` entries so every id a model can emit
decodes to something. The `tokenizers` package is imported only when a tokenizer is trained.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import time
from collections.abc import Iterator
from importlib.resources import files

logger = logging.getLogger(__name__)

# Added tokens, in Qwen's order, placed at the very end of the vocabulary (as Qwen does).
# ``special`` follows Qwen2.5/Qwen3: ChatML markers are special (skipped by
# ``skip_special_tokens``); tool-call and think markers are not, so they survive decoding and
# the tool / reasoning parsers can see them.
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    (ENDOFTEXT, True),
    (IM_START, True),
    (IM_END, True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<think>", False),
    ("</think>", False),
)
FILLER_TOKEN = "<|extra_{}|>"

# Qwen2's pre-tokenizer split (identical to transformers' Qwen2Tokenizer PRETOKENIZE_REGEX).
# transformers >= 5 rebuilds the Qwen2 pipeline from vocab + merges with this regex, so the
# tokenizer.json must use the very same one for both loaders to tokenize identically.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# The chat template shipped in Qwen/Qwen2.5-*-Instruct tokenizer_config.json, verbatim.
QWEN25_CHAT_TEMPLATE = files("model_builders").joinpath("templates/qwen25_chat.jinja").read_text()


# --------------------------------------------------------------------------------------
# Corpus + tokenizer
# --------------------------------------------------------------------------------------

_COMMON_WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this
from or had by hot word but what some we can out other were all there when up use your how
said an each she which do their time if will way about many then them write would like so
these her long make thing see him two has look more day could go come did number sound no
most people my over know water than call first who may down side been now find any new work
part take get place made live where after back little only round man year came show every
good me give our under name very through just form sentence great think say help low line
differ turn cause much mean before move right boy old too same tell does set three want air
well also play small end put home read hand port large spell add even land here must big high
such follow act why ask men change went light kind off need house picture try us again animal
point mother world near build self earth father head stand own page should country found
answer school grow study still learn plant cover food sun four between state keep eye never
last let thought city tree cross farm hard start might story saw far sea draw left late run
while press close night real life few north open seem together next white children begin got
walk example ease paper group always music those both mark often letter until mile river car
feet care second book carry took science eat room friend began idea fish mountain stop once
base hear horse cut sure watch color face wood main enough plain girl usual young ready above
ever red list though feel talk bird soon body dog family direct pose leave song measure door
product black short numeral class wind question happen complete ship area half rock order
fire south problem piece told knew pass since top whole king space heard best hour better true
during hundred five remember step early hold west ground interest reach fast verb sing listen
six table travel less morning ten simple several vowel toward war lay against pattern slow
center love person money serve appear road map rain rule govern pull cold notice voice unit
power town fine certain fly fall lead cry dark machine note wait plan figure star box noun
field rest correct able pound done beauty drive stood contain front teach week final gave
green quick develop ocean warm free minute strong special mind behind clear tail produce fact
street inch multiply nothing course stay wheel full force blue object decide surface deep moon
island foot system busy test record boat common gold possible plane dry wonder laugh thousand
ago ran check game shape miss brought heat snow tire bring yes distant fill east paint
language among model server request response token stream error value function weather city
don't it's I'm we're you'll can't that's he'd they've isn't
""".split()
_ONSETS = (
    "b c d f g h j k l m n p r s t v w z bl br ch cl cr dr fl fr gl gr pl pr sc sh sk sl sm sn "
    "sp st str sw th tr qu"
).split()
_VOWELS = "a e i o u y ai ea ee oa oo ou ie".split()
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "nt", "rk", "st", "ck", "x", "th"]
_SENTENCE_END = [".", ".", ".", ".", "?", "!", ":", ";"]
_CORPUS_SEED = 20240601


def _generate_corpus(n_chars: int) -> Iterator[str]:
    """Yields ~n_chars of deterministic English-like text in chunks.

    Why this shape: common English words give the BPE trainer realistic frequent merges, a
    large lexicon of pronounceable pseudo-words gives it enough distinct words to reach a
    32k vocabulary, and digits / punctuation / JSON-ish lines cover what prompts and tool
    calls contain. Seeded ``random.Random`` keeps it identical across runs and machines.
    """
    rng = random.Random(_CORPUS_SEED)
    lexicon = []
    for _ in range(60000):
        n_syll = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        lexicon.append(
            "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n_syll))
        )
    n_common = len(_COMMON_WORDS)
    parts: list[str] = []
    chunk_chars = 0  # characters in the current (not yet yielded) chunk
    total_chars = 0
    while total_chars < n_chars:
        if rng.random() < 0.03:
            # A tool-call-like JSON line, so braces/quotes/colons get merged like in real prompts.
            arguments = {rng.choice(_COMMON_WORDS): rng.choice(lexicon), "n": rng.randint(0, 999)}
            sentence = json.dumps({"name": rng.choice(lexicon), "arguments": arguments}) + "\n"
        else:
            words = []
            for _ in range(rng.randint(4, 18)):
                r = rng.random()
                if r < 0.3:  # Zipf-like: the first common words dominate, as in English
                    word = _COMMON_WORDS[min(int(rng.paretovariate(1.1)) - 1, n_common - 1)]
                elif r < 0.55:
                    word = rng.choice(_COMMON_WORDS)
                elif r < 0.93:
                    word = lexicon[min(int(rng.expovariate(1 / 8000)), len(lexicon) - 1)]
                else:
                    word = str(rng.randint(0, 10 ** rng.randint(1, 6)))
                if rng.random() < 0.05:
                    word = word.capitalize()
                if rng.random() < 0.06:
                    word += ","
                words.append(word)
            text = " ".join(words).rstrip(",")
            sentence = text[0].upper() + text[1:] + rng.choice(_SENTENCE_END)
            sentence += "\n\n" if rng.random() < 0.1 else " "
        parts.append(sentence)
        chunk_chars += len(sentence)
        total_chars += len(sentence)
        if chunk_chars >= 100_000:
            yield "".join(parts)
            parts, chunk_chars = [], 0
    if parts:
        yield "".join(parts)


@functools.lru_cache(maxsize=8)
def train_tokenizer_json(vocab_size: int) -> str:
    """Returns the tokenizer.json text of a byte-level BPE with exactly ``vocab_size`` ids.

    Training is deterministic (fixed corpus, the Rust trainer breaks ties by pair order) and
    fast (~0.3 s for 2k, ~2 s for 32k on 2 CPU cores), so it is redone per process rather than cached on
    disk; the in-process lru_cache only spares tests from training twice.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    n_added = len(ADDED_TOKENS)
    n_bytes = len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < n_bytes + n_added:
        raise ValueError(f"vocab_size must be at least {n_bytes + n_added} (256 byte tokens + {n_added} added tokens)")
    bpe_size = vocab_size - n_added

    def configure(tok: Tokenizer) -> None:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()

    t0 = time.perf_counter()
    trainee = Tokenizer(BPE())
    configure(trainee)
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # ~100 characters of corpus per wanted token is plenty for the trainer to reach the size.
    trainee.train_from_iterator(_generate_corpus(max(200_000, 100 * bpe_size)), trainer=trainer)
    trained = json.loads(trainee.to_str())["model"]
    vocab: dict[str, int] = dict(trained["vocab"])
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in trained["merges"]]

    # Pad a short vocabulary so every id below vocab_size decodes to something, then put the
    # added tokens at the very end (as Qwen does). They also go into the BPE vocab itself so
    # that ``tokenizer.vocab_size == len(tokenizer) == config.vocab_size``.
    shortfall = bpe_size - len(vocab)
    if shortfall:
        logger.warning("BPE trainer stopped at %d tokens; padding with %d filler tokens", len(vocab), shortfall)
    fillers = [FILLER_TOKEN.format(i) for i in range(shortfall)]
    for content in fillers + [c for c, _ in ADDED_TOKENS]:
        vocab[content] = len(vocab)
    assert len(vocab) == vocab_size

    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    configure(tok)
    tok.add_tokens([AddedToken(c, special=False, normalized=False) for c in fillers])
    tok.add_special_tokens([AddedToken(c, special=s, normalized=False) for c, s in ADDED_TOKENS])
    # add_special_tokens marks everything special; restore Qwen's flags for <tool_call> etc.
    data = json.loads(tok.to_str())
    flags = dict(ADDED_TOKENS)
    for entry in data["added_tokens"]:
        entry["special"] = flags.get(entry["content"], False)
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, expected {vocab_size}")
    logger.debug("trained %d-token BPE in %.2fs", vocab_size, time.perf_counter() - t0)
    return json.dumps(data, ensure_ascii=False, indent=2)


def token_ids(vocab_size: int) -> dict[str, int]:
    """Ids of the added tokens: always the last len(ADDED_TOKENS) ids of the vocabulary."""
    first = vocab_size - len(ADDED_TOKENS)
    return {content: first + i for i, (content, _) in enumerate(ADDED_TOKENS)}


def tokenizer_config(vocab_size: int, max_len: int) -> dict:
    ids = token_ids(vocab_size)
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[content]): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for content, special in ADDED_TOKENS
        },
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": QWEN25_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": max_len,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def with_bos_token(tokenizer_json: str, bos: str) -> str:
    """The tokenizer.json text with a post-processor that puts `bos` (an added token) before every encoding.

    Why: the trained tokenizer adds no BOS, as Qwen's do not; Llama-style tokenizers add one whenever
    special tokens are asked for, and tests of `add_special_tokens` need a tokenizer where it matters.
    """
    data = json.loads(tokenizer_json)
    bos_id = next(entry["id"] for entry in data["added_tokens"] if entry["content"] == bos)
    special = {"SpecialToken": {"id": bos, "type_id": 0}}
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [special, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [special, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }
    return json.dumps(data, ensure_ascii=False, indent=2)


def special_tokens_map() -> dict:
    def tok(content: str) -> dict:
        return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}

    return {
        "additional_special_tokens": [IM_START, IM_END],
        "eos_token": tok(IM_END),
        "pad_token": tok(ENDOFTEXT),
    }


# A thinking model's generation prompt (Qwen3-Thinking / DeepSeek-R1 style): the answer opens
# inside <think>, and `enable_thinking: false` renders an empty, closed block instead.
THINKING_GENERATION_PROMPT = r"""{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""


def thinking_chat_template() -> str:
    """The Qwen2.5 template (tools included) with a thinking generation prompt."""
    head, sep, _ = QWEN25_CHAT_TEMPLATE.rpartition("{%- if add_generation_prompt %}")
    assert sep, "the Qwen2.5 template lost its generation prompt"
    return head + THINKING_GENERATION_PROMPT
