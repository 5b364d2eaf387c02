"""The ChatML prompt rendering the router and the engine twin share: :func:`render_chat`.

The simulator (``engine_twin``) renders chat and responses prompts with it, and the router's
``estimate`` tokenizer backend renders with it too, so with the simulator's built-in 4-byte
tokenizer the router's estimate bytes ARE the engine's tokens (packed as uint32), and both hash to
the same prefix blocks. :mod:`router.chat_template` holds the router's
Jinja templates.
"""

from __future__ import annotations

from typing import Any

#: Name of the built-in template, as the simulator reports it.
CHAT_TEMPLATE_NAME = "chatml"

#: Content-part types whose ``text`` counts as prompt text (chat ``text``, responses ``input_text``, and
#: ``output_text``: an earlier response's output passed back as input, as OpenAI's conversation-state guide does).
TEXT_PART_TYPES = ("text", "input_text", "output_text")


def content_text(content: Any, separator: str = "") -> str:
    """The text of one message's ``content``: a string as is, a list of parts as their text parts
    (``type`` ``text`` / ``input_text``) joined with ``separator``, anything else (None) as ``""``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return separator.join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") in TEXT_PART_TYPES
        )
    return ""


def render_chat(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """Render OpenAI chat messages with a ChatML template; list contents keep their text parts.

    ``[{"role": "user", "content": "hi"}]`` → ``"<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>
    assistant\\n"``. A message without ``role`` renders as ``user``.

    Raises:
        TypeError: a message is not an object.
    """
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError("each message must be an object")
        content = message.get("content")
        if isinstance(content, list):
            content = content_text(content)
        parts.append(f"<|im_start|>{message.get('role', 'user')}\n{content or ''}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)
