"""A tokenizer's own chat template for the router (the ONE ChatML rendering, which the ``estimate``
backend and the engine twin share, is :func:`common.chatml.render_chat`).

* :class:`JinjaChatTemplate` — a tokenizer's own chat template (``chat_template`` in
  ``tokenizer_config.json``, or a ``chat_template.jinja`` file), rendered with jinja2 the way
  Hugging Face ``transformers`` ``apply_chat_template`` does (sandboxed environment, ``trim_blocks``
  and ``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception`` / ``strftime_now``
  globals, a ``tojson`` filter that keeps non-ASCII, the tokenizer's special tokens as variables),
  without depending on ``transformers``. Used by the router's ``hf`` tokenizer backend.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from common.chatml import content_text

__all__ = ["SPECIAL_TOKEN_KEYS", "ChatTemplateError", "JinjaChatTemplate"]

#: Special-token keys of ``tokenizer_config.json`` passed to templates as variables (transformers'
#: ``SPECIAL_TOKENS_ATTRIBUTES``).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """A chat template that does not compile, or that failed while rendering (including the
    template's own ``raise_exception(...)``, e.g. "Conversation roles must alternate")."""


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or a serialised ``AddedToken`` object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick_template(value: Any) -> str | None:
    """``chat_template`` is a string, or a list of ``{"name", "template"}`` (the one named
    ``default`` is used, as transformers does when no name is asked for)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    return None


class JinjaChatTemplate:
    """A compiled Jinja chat template and the special tokens it is rendered with.

    Args:
        source: the template text.
        special_tokens: variables such as ``bos_token`` / ``eos_token`` (token strings).

    Raises:
        ChatTemplateError: the template does not compile.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class GenerationTag(Extension):
            """``{% generation %}…{% endgeneration %}`` (transformers' assistant-mask marker): the
            body renders unchanged; the mask itself is not needed to build a prompt."""

            tags = {"generation"}

            def parse(self, parser: Any) -> nodes.Node:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.Scope(body, lineno=lineno)

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[GenerationTag, loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_tokenizer_dir(cls, directory: str | Path) -> JinjaChatTemplate | None:
        """The template beside a tokenizer.json: ``chat_template.jinja`` if present (newer Hugging
        Face layout), else ``chat_template`` in ``tokenizer_config.json``; None when neither exists.
        Special tokens come from ``tokenizer_config.json`` when it exists.

        Raises:
            ChatTemplateError: the template does not compile.
            ValueError: ``tokenizer_config.json`` is not a JSON object.
        """
        directory = Path(directory)
        config: dict[str, Any] = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))
            if not isinstance(config, dict):
                raise ValueError(f"{config_path} is not a JSON object")
        jinja_path = directory / "chat_template.jinja"
        source = jinja_path.read_text(encoding="utf-8") if jinja_path.is_file() else _pick_template(
            config.get("chat_template"))
        if source is None:
            return None
        tokens = {key: text for key in SPECIAL_TOKEN_KEYS if (text := _token_text(config.get(key))) is not None}
        return cls(source, tokens)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[Any] | None = None, variables: Mapping[str, Any] | None = None) -> str:
        """The prompt text for ``messages``.

        Message contents given as a list of parts are flattened to their text parts joined with
        ``"\\n"`` (vLLM's ``string`` content format, its default for templates that expect string
        contents). ``variables`` are extra template variables (vLLM's ``chat_template_kwargs``);
        they cannot replace ``messages``, ``tools`` or ``add_generation_prompt``.

        Raises:
            ChatTemplateError: the template failed (bad roles order, a missing variable it requires…).
        """
        flat = [
            {**m, "content": content_text(m["content"], "\n")} if isinstance(m.get("content"), list) else m
            for m in messages
        ]
        context = {**self.special_tokens, **(variables or {}), "messages": flat, "tools": tools,
                     "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(context)
        except Exception as exc:  # the template's raise_exception, sandbox errors, or a TypeError on odd input
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
