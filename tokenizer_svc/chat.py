"""Chat templates: messages -> prompt token ids, where text a user wrote never becomes a special token.

The common case renders the model's template and encodes the text in one go, exactly as
``apply_chat_template(tokenize=True)`` would. When some message content holds the literal text
of a special token (``<|im_end|>``, ``</s>``, ...), the template is rendered again with
placeholders in place of the contents, and the pieces are encoded apart: the template's own
text with special tokens recognised, each content with them split into plain text. (A
SentencePiece tokenizer that prepends "▁" may then see a space where a content piece starts: a
small price in a case that only hostile input reaches.) No Redis here.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence

from shared.protocol import ChatMessage, ProtocolError

_SLOT = re.compile("\ue000(\\d+)\ue001")  # private-use code points: no template emits them


class ChatRenderer:
    """Owns a tokenizer's chat template and the set of its special-token literals."""

    def __init__(self, tokenizer, max_chars: int | None = None):
        self.tokenizer = tokenizer
        self.max_chars = max_chars  # a rendered conversation longer than this is refused untokenized
        literals = set(getattr(tokenizer, "all_special_tokens", ()) or ())
        for added in getattr(tokenizer, "added_tokens_decoder", {}).values():
            if getattr(added, "special", False):
                literals.add(str(added.content))
        literals.discard("")
        self._specials = re.compile("|".join(re.escape(t) for t in sorted(literals, key=len, reverse=True))) \
            if literals else None

    @property
    def has_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def render_text(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                    tools: list | None = None) -> str:
        if not messages:
            raise ProtocolError("messages must not be empty", "messages")
        if not self.has_template:
            raise ProtocolError("this model has no chat template; use /v1/completions", "messages")
        try:
            return self.tokenizer.apply_chat_template(
                [_as_dict(m) for m in messages], tools=tools, tokenize=False,
                add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # jinja raises its own errors (raise_exception in templates)
            raise ProtocolError(f"chat template failed: {exc}", "messages") from None

    def holds_special_text(self, messages: Sequence[ChatMessage]) -> bool:
        return self._specials is not None and any(self._specials.search(m.content) for m in messages)

    def encode(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
               tools: list | None = None) -> tuple[str, list[int]]:
        """(rendered text, token ids) for one conversation (and the tools it may call)."""
        text = self.render_text(messages, add_generation_prompt, tools)
        if self.max_chars is not None and len(text) > self.max_chars:
            raise ProtocolError(f"the conversation renders to {len(text)} characters, more than any prompt that "
                                f"fits the model's context can hold ({self.max_chars})", "messages")
        if not self.holds_special_text(messages):
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        return text, self.encode_guarded(messages, add_generation_prompt, tools)

    def encode_guarded(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                       tools: list | None = None) -> list[int]:
        """Render with placeholders, then encode template text and user contents separately."""
        slots = [dataclasses.replace(m, content=f"\ue000{i}\ue001") for i, m in enumerate(messages)]
        pieces = _SLOT.split(self.render_text(slots, add_generation_prompt, tools))
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:  # the template's own text
                if piece:
                    ids += self.tokenizer.encode(piece, add_special_tokens=False)
            else:
                content = messages[int(piece)].content
                if content:
                    ids += self.tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True)
        return ids


def _as_dict(message: ChatMessage) -> dict:
    """A message as transformers' chat templates take it (tool call arguments as a mapping)."""
    out: dict = {"role": message.role, "content": message.content}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                             for c in message.tool_calls]
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text  # a template that wants a mapping gets the text; most print it either way
