"""`chat_template_kwargs`: a request's extra arguments to the chat template ({"enable_thinking": false}),
checked before they reach it, in the ingress and in the replica alike. No torch."""
from __future__ import annotations

from typing import Any

# arguments of ours (or the template's own variables) that chat_template_kwargs may not set
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize",
    "return_dict", "return_assistant_tokens_mask", "return_tensors", "chat_template", "padding", "truncation",
    "max_length", "tokenizer_kwargs", "raise_exception", "strftime_now"})
MAX_TEMPLATE_KWARGS = 32


def template_kwargs_problem(kwargs: Any) -> str | None:
    """Why `chat_template_kwargs` cannot go to the chat template, or None: a mapping of names to plain
    values (text, numbers, booleans, null) that sets none of our own arguments nor a special token."""
    if not isinstance(kwargs, dict) or len(kwargs) > MAX_TEMPLATE_KWARGS:
        return f"must be an object of at most {MAX_TEMPLATE_KWARGS} values"
    for key, value in kwargs.items():
        if not isinstance(key, str) or not key.isidentifier():
            return f"{key!r} is not a name"
        if key in RESERVED_TEMPLATE_KWARGS or key.endswith("_token"):
            return f"{key!r} is an argument of the server's own, not the template's to take"
        if value is not None and not isinstance(value, (str, int, float, bool)):
            return f"{key!r}: values must be text, numbers, booleans or null"
    return None
