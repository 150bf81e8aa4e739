"""Chat prompts: a checkpoint's chat template (``tokenizer_config.json``), or a plain fallback.

With a template (a Jinja string, or a list of named ones where "default" is taken), messages
render as transformers' ``apply_chat_template(messages, add_generation_prompt=True)`` does: a
sandboxed Jinja environment with ``messages``, ``bos_token``, ``eos_token``,
``add_generation_prompt`` and ``raise_exception``; the text is then tokenized without adding
special tokens (the template writes them). Without one (the embedded reasoner has none), the
messages' contents are joined by newlines and end in exactly one newline, the prompt rule of
the reasoner; that text is tokenized as a plain prompt.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxlp.errors import CheckpointFormatError

ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """``template``: the Jinja source, or None for the fallback; ``bos_token``/``eos_token`` text."""

    template: str | None = None
    bos_token: str = ""
    eos_token: str = ""

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "ChatTemplate":
        file = Path(path) / "tokenizer_config.json"
        if not file.is_file():
            return cls()
        try:
            config = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointFormatError(f"{file}: cannot read ({e})") from None
        if not isinstance(config, dict):
            raise CheckpointFormatError(f"{file}: not a JSON object")
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise CheckpointFormatError(f"{file}: chat_template is not a string")
        token = lambda v: v.get("content", "") if isinstance(v, dict) else (v or "")  # noqa: E731
        return cls(template, token(config.get("bos_token")), token(config.get("eos_token")))

    @property
    def adds_special_tokens(self) -> bool:
        """Whether the rendered text carries its special tokens (tokenize it without adding them)."""
        return self.template is not None

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text of ``messages`` (each ``{"role": ..., "content": str}``, checked)."""
        check_messages(messages)
        if self.template is None:
            return "\n".join(m["content"] for m in messages).rstrip("\r\n") + "\n"
        return _compiled(self.template).render(messages=messages, bos_token=self.bos_token,
                                               eos_token=self.eos_token, add_generation_prompt=True)


def check_messages(messages: Any) -> None:
    """ValueError naming the first malformed message (roles of :data:`ROLES`, string content)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"messages[{i}].content: only text parts are supported")
            m["content"] = "".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string")


_TEMPLATES: dict[str, Any] = {}


def _compiled(source: str):
    if source not in _TEMPLATES:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            _TEMPLATES[source] = env.from_string(source)
        except TemplateError as e:
            raise CheckpointFormatError(f"the checkpoint's chat template does not compile: {e}") from None
    return _TEMPLATES[source]
