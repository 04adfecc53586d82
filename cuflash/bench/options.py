"""Option spellings shared by the commands (bench, autotune): dtypes, sequence lengths, repeated lists.

Imports nothing but the standard library, so any command may use it cheaply.
"""

from __future__ import annotations

DTYPE_ALIASES = {
    "fp16": "float16", "float16": "float16", "half": "float16", "f16": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
}


def seqlen_option(text: str) -> int:
    """A sequence length: "512", "2k" (2048)."""
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def dtype_option(text: str) -> str:
    """A 16-bit dtype's canonical name from its spellings: fp16/half/f16 -> float16, bf16 -> bfloat16."""
    try:
        return DTYPE_ALIASES[text.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {text!r}") from None


def list_option(parser, values, convert, option: str) -> list:
    """Flatten repeated and comma-separated option values, each through `convert`; a bad one is a usage error."""
    out = []
    for value in values or ():
        for part in value.split(","):
            if part.strip():
                try:
                    out.append(convert(part))
                except ValueError as exc:
                    parser.error(f"{option}: {exc}")
    return out
