"""Prompts to token ids: one encoding for the engine, the server, the benchmark and training.

A prompt is a user message (wrapped in the chat template when the tokenizer has one), a list
of chat messages, raw text (`chat=False`), or token ids (taken as they are). The same prompt
gives the same ids everywhere, so a benchmark or a distillation run sees what a served
request would.
"""

from __future__ import annotations

from specdec.errors import SpecdecError
from specdec.tools import ToolPlan, render_chat

Prompt = str | list[dict] | list[int]


def encode(
    tokenizer, prompt: Prompt, *, chat: bool = True, max_length: int | None = None,
    tools: ToolPlan | None = None
) -> list[int]:
    """Token ids for `prompt`. Raises SpecdecError when it is empty, when the chat template
    rejects its messages, or when it leaves no room for a new token in `max_length`.
    `tools` (tools.tool_plan) shows a request's tools to the model; chat messages may hold
    past tool calls and results either way (see tools.chat_messages)."""
    param = "prompt"
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        if tools is not None:
            raise SpecdecError("tools need a chat prompt (messages), not token ids", "tools")
        ids = list(prompt)
    elif isinstance(prompt, list):
        ids, param = _apply_chat(tokenizer, prompt, tools), "messages"
    elif not isinstance(prompt, str) or not prompt.strip():
        raise SpecdecError("the prompt is empty", "prompt")
    elif chat and getattr(tokenizer, "chat_template", None):
        ids = _apply_chat(tokenizer, [{"role": "user", "content": prompt}], tools)
    elif tools is not None:
        raise SpecdecError("tools need a chat prompt and a tokenizer with a chat template", "tools")
    else:
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    if not ids:
        raise SpecdecError("the prompt is empty", param)
    if max_length is not None and len(ids) >= max_length:
        raise SpecdecError(
            f"the prompt has {len(ids)} tokens; the maximum context length is {max_length}, "
            "with room for at least one new token",
            "prompt",
        )
    return ids


def _apply_chat(tokenizer, messages: list[dict], tools: ToolPlan | None = None) -> list[int]:
    if not messages:
        raise SpecdecError("the prompt is empty", "messages")
    try:
        text = render_chat(tokenizer, messages, tools)
    except SpecdecError:
        raise
    except Exception as e:  # templates raise on role orders they do not support
        raise SpecdecError(f"the chat template rejected the messages: {str(e)[:200]}", "messages") from None
    # The template already wrote the special tokens (BOS included); do not add them twice.
    return tokenizer.encode(text, add_special_tokens=False)
