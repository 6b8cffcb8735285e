"""Tokenizer: a Hugging Face `tokenizers` backend plus the facts the engine needs around it.

The backend comes from one of two places:

- a Hugging Face ``tokenizer.json`` (with ``tokenizer_config.json`` for the special tokens, the
  BOS policy and the chat template), or
- a GGUF file's ``tokenizer.ggml.*`` metadata, rebuilt into the same kind of backend.

BOS is added here, not by the backend's post-processor, so that one flag (``add_bos_token``)
decides it for every source and a prompt that already starts with BOS (a rendered chat template
often does) never gets a second one.

Chat templates are rendered the way transformers renders them (sandboxed Jinja, ``trim_blocks``
and ``lstrip_blocks``, a ``tojson`` that does not HTML-escape, ``raise_exception``), because the
templates on the Hub are written against that environment.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from phaselab.errors import InvalidRequestError, ModelFormatError, ModelNotFoundError, UnsupportedModelError
from phaselab.modelinfo.gguf import is_gguf_file, open_gguf, read_metadata

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# The split regexes of the byte-level vocabularies we rebuild from GGUF, keyed by
# `tokenizer.ggml.pre`. Each is the regex of the model's original tokenizer.json; llama.cpp's
# `llama-vocab.cpp` carries the same ones.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SUPPORTED_GGUF_PRE_TOKENIZERS = ("default", "gpt2", "llama-bpe", "llama3", "llama-v3", "qwen2", "smollm")


def _byte_level_pipeline(pre: str) -> tuple[Any, Any, bool]:
    """(normalizer, pre_tokenizer, ignore_merges) that reproduce the original HF tokenizer.

    - "gpt2"/"default": GPT-2's own regex inside ByteLevel.
    - "smollm": SmolLM's tokenizer.json splits every digit apart *before* the GPT-2 regex
      (``Digits(individual_digits=True)``), as llama.cpp's SMOLLM pre-tokenizer does. It matters
      only for whitespace before a digit: "a  1" pre-tokenizes to "a", "  ", "1" (tokens
      a|ĠĠ|1) here, but to "a", " ", " 1" (a|Ġ|Ġ|1) with the GPT-2 regex alone, which is what
      transformers' GGUF conversion does.
    - "llama-bpe": Llama 3's regex (digits in groups of three); its BPE uses whole words that are
      in the vocabulary without merging (``ignore_merges``), as tokenizer.json says.
    - "qwen2": Qwen2's regex (single digits) after NFC normalization, as its tokenizer.json says.
    """
    byte_level_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    byte_level_plain = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("default", "gpt2"):
        return None, byte_level_regex, False
    if pre == "smollm":
        return None, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level_regex]), False
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False)
        return None, pre_tokenizers.Sequence([split, byte_level_plain]), True
    if pre == "qwen2":
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False)
        return normalizers.NFC(), pre_tokenizers.Sequence([split, byte_level_plain]), False
    raise UnsupportedModelError(
        f"GGUF pre-tokenizer {pre!r} is not supported (phaselab rebuilds {list(SUPPORTED_GGUF_PRE_TOKENIZERS)}); "
        "pass tokenizer_path=<the original Hugging Face model directory or its tokenizer.json>"
    )


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Text <-> token ids, special-token facts, and chat-template rendering."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        eos_token_ids: frozenset[int] | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
        extra_template_vars: Mapping[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        eos = set(eos_token_ids or ())
        if eos_token_id is not None:
            eos.add(eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        special |= {i for i in (bos_token_id, eos_token_id) if i is not None}
        self.all_special_ids: frozenset[int] = frozenset(special | self.eos_token_ids)
        # Template variables transformers passes from its special-token map (bos_token, ...).
        self._template_vars: dict[str, str] = dict(extra_template_vars or {})
        for key, token_id in (("bos_token", bos_token_id), ("eos_token", eos_token_id)):
            text = self.id_to_token(token_id) if token_id is not None else None
            if text is not None:
                self._template_vars[key] = text
        self._compiled_template: tuple[str, jinja2.Template] | None = None  # (source, compiled)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={sorted(self.eos_token_ids)}, "
            f"add_bos_token={self.add_bos_token}, chat_template={'yes' if self.chat_template else 'no'})"
        )

    # -- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in it (e.g. ``<|im_start|>``) stay whole.

        BOS is prepended iff ``add_bos_token`` and ``add_special_tokens``, and not when the text
        already begins with it.
        """
        ids: list[int] = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # -- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` with the model's chat template into prompt text (not ids).

        Extra keyword arguments become template variables (``tools``, ``documents``, model
        specific switches such as ``enable_thinking``). A template that rejects the
        conversation (``raise_exception``) raises InvalidRequestError with its message.
        """
        if self.chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template, so chat messages cannot be turned into a prompt; "
                "use the completions API with a plain prompt, or load a tokenizer that has one "
                "(tokenizer_path=<a Hugging Face model directory with a chat template>)"
            )
        if self._compiled_template is None or self._compiled_template[0] != self.chat_template:
            self._compiled_template = (self.chat_template, _compile_template(self.chat_template))
        variables: dict[str, Any] = {"tools": None, "documents": None, **self._template_vars, **kwargs}
        try:
            return self._compiled_template[1].render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"the chat template rejected these messages: {e}") from e

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_file(cls, tokenizer_json: str, tokenizer_config: dict[str, Any] | None = None) -> Tokenizer:
        """From a Hugging Face ``tokenizer.json`` and the dict of its ``tokenizer_config.json``.

        When the config does not say ``add_bos_token`` (Llama 3's does not: its tokenizer.json
        post-processor adds BOS), the post-processor's behaviour on an empty string decides.
        """
        try:
            backend = BackendTokenizer.from_file(tokenizer_json)
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise ModelFormatError(
                f"{tokenizer_json}: cannot read tokenizer ({e}); is it a Hugging Face tokenizers JSON file?"
            ) from e
        cfg = tokenizer_config or {}

        def token_id(key: str) -> int | None:
            content = _token_content(cfg.get(key))
            return backend.token_to_id(content) if content is not None else None

        bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:
            probe = backend.encode("", add_special_tokens=True).ids
            add_bos = bos_id is not None and probe[:1] == [bos_id]
            if bos_id is None and probe:
                bos_id, add_bos = probe[0], True  # the post-processor knows a BOS the config does not name
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        extra = {k: v for k in ("unk_token", "pad_token") if (v := _token_content(cfg.get(k))) is not None}
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            chat_template=template,
            add_bos_token=bool(add_bos),
            extra_template_vars=extra,
        )

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """From a GGUF's metadata (key -> value, arrays as lists; see phaselab.modelinfo.gguf.read_metadata).

        Only byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) are rebuilt. A
        SentencePiece vocabulary ("llama") is refused rather than approximated: its space and
        byte-fallback rules differ in edge cases, and a silently different tokenization is worse
        than an error that says where to get the exact one.
        """
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UnsupportedModelError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
                "pass tokenizer_path=<the original Hugging Face model directory or its tokenizer.json>"
            )
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
        token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        pre = metadata.get("tokenizer.ggml.pre") or "default"
        normalizer, pre_tokenizer, ignore_merges = _byte_level_pipeline(pre)

        vocab = {tok: i for i, tok in enumerate(tokens)}
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
        if normalizer is not None:
            backend.normalizer = normalizer
        backend.pre_tokenizer = pre_tokenizer
        backend.decoder = decoders.ByteLevel()
        # CONTROL tokens (<|im_start|>) and USER_DEFINED ones (<think>) are matched whole in the
        # text, as llama.cpp does; only CONTROL ones are special (dropped by skip_special_tokens).
        added = [
            AddedToken(tok, special=(tt == _TOKEN_TYPE_CONTROL), normalized=False)
            for tok, tt in zip(tokens, token_types)
            if tt in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
        ]
        backend.add_tokens(added)

        def meta_id(key: str) -> int | None:
            value = metadata.get(f"tokenizer.ggml.{key}")
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        eos_id = meta_id("eos_token_id")
        eos_ids = {i for i in (eos_id, meta_id("eot_token_id"), meta_id("eom_token_id")) if i is not None}
        add_bos = metadata.get("tokenizer.ggml.add_bos_token")
        if add_bos is None:  # llama.cpp's default for these vocabularies
            add_bos = pre in ("llama-bpe", "llama3", "llama-v3")
        extra = {}
        for key, var in (("unknown_token_id", "unk_token"), ("padding_token_id", "pad_token")):
            if (i := meta_id(key)) is not None:
                extra[var] = tokens[i]
        return cls(
            backend,
            bos_token_id=meta_id("bos_token_id"),
            eos_token_id=eos_id,
            eos_token_ids=frozenset(eos_ids),
            chat_template=metadata.get("tokenizer.chat_template"),
            add_bos_token=bool(add_bos),
            extra_template_vars=extra,
        )


def load_tokenizer(path: str) -> Tokenizer:
    """A Tokenizer from a Hugging Face model directory, a ``tokenizer.json`` or a ``.gguf`` file.

    For a directory (or a tokenizer.json inside one), ``tokenizer_config.json`` next to it supplies
    the special tokens, and the chat template comes from it or from ``chat_template.jinja`` /
    ``chat_template.json``.
    """
    if not os.path.exists(path):
        raise ModelNotFoundError(f"tokenizer path {path!r} does not exist")
    if os.path.isfile(path) and (path.endswith(".gguf") or is_gguf_file(path)):
        return load_gguf_tokenizer(path)
    if os.path.isdir(path):
        directory, tokenizer_json = path, os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_json):
            raise ModelNotFoundError(
                f"{path} has no tokenizer.json; phaselab reads the fast-tokenizer file. Export one with "
                "transformers (AutoTokenizer.from_pretrained(dir).save_pretrained(dir)) or pass "
                "tokenizer_path=<a tokenizer.json>"
            )
    else:
        directory, tokenizer_json = os.path.dirname(os.path.abspath(path)), path
    config = _read_json(os.path.join(directory, "tokenizer_config.json")) or {}
    if not config.get("chat_template"):
        template = _read_text(os.path.join(directory, "chat_template.jinja"))
        if template is None:
            template = (_read_json(os.path.join(directory, "chat_template.json")) or {}).get("chat_template")
        if template is not None:
            config = {**config, "chat_template": template}
    return Tokenizer.from_file(tokenizer_json, config)


def load_gguf_tokenizer(path: str) -> Tokenizer:
    """The tokenizer stored in a GGUF's metadata (no tensors are read, no torch imported)."""
    return Tokenizer.from_gguf(read_metadata(open_gguf(path)))


def _read_text(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def _read_json(path: str) -> dict[str, Any] | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{path} is not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise ModelFormatError(f"{path} should hold a JSON object, found {type(value).__name__}")
    return value


def _compile_template(source: str) -> jinja2.Template:
    """The chat template in transformers' rendering environment (the one templates target)."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        # Jinja's own tojson HTML-escapes (<, >, &, '), which would change the prompt text.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelFormatError(f"the chat template is not valid Jinja (line {e.lineno}: {e.message})") from e
