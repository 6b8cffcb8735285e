"""Token id -> the text and exact bytes shown in logprobs (`TokenStrings`), or "token_id:<id>"
(`TokenIdStrings`, vLLM's `return_tokens_as_token_ids`)."""

from __future__ import annotations

from typing import Any


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable char -> the byte it stands for."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenStrings:
    """id -> (text, bytes) of one token: exact bytes for byte-level BPE, decoded text otherwise."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        try:
            from tokenizers import decoders

            self._byte_level = isinstance(tokenizer.backend.decoder, decoders.ByteLevel)
        except Exception:  # noqa: BLE001 - any other tokenizer: decode per token
            self._byte_level = False
        self._decoder = _byte_decoder() if self._byte_level else {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        piece = self._tok.id_to_token(token_id)
        if piece is not None and self._byte_level and token_id not in self._tok.all_special_ids \
                and all(ch in self._decoder for ch in piece):
            raw = bytes(self._decoder[ch] for ch in piece)
        else:
            raw = self._tok.decode([token_id], skip_special_tokens=False).encode()
        hit = (raw.decode("utf-8", errors="replace"), raw)
        if len(self._cache) < 200_000:
            self._cache[token_id] = hit
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


class TokenIdStrings:
    """`return_tokens_as_token_ids`: every token as "token_id:<id>" (unambiguous, vLLM's format)."""

    def __init__(self, inner: TokenStrings) -> None:
        self._inner = inner

    def get(self, token_id: int) -> tuple[str, bytes]:
        return f"token_id:{token_id}", self._inner.get(token_id)[1]

    def text(self, token_id: int) -> str:
        return f"token_id:{token_id}"
