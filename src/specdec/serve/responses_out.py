"""The Responses API's reply: a `response` object, or its typed stream events.

The generation is the chat one (serve/responses.py translates the request); this writer turns
its result, or its chat deltas as they stream, into Responses output items: an assistant
`message` with one `output_text` part for text, a `function_call` item per call. Streamed,
the events follow OpenAI's order: response.created, response.in_progress, then per item
output_item.added, (content_part.added, output_text.delta..., output_text.done,
content_part.done | function_call_arguments.delta..., function_call_arguments.done),
output_item.done, and last response.completed (response.incomplete when max_output_tokens
cut the reply). Each SSE frame names its event, and sequence_number counts from 0.
"""

from __future__ import annotations

import json
import time
import uuid

from specdec.sequence import GenerationResult
from specdec.serve.responses import ResponsesRequest, rename


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(result: GenerationResult) -> dict:
    prompt, output = len(result.prompt_ids), len(result.token_ids)
    return {
        "input_tokens": prompt, "input_tokens_details": {"cached_tokens": result.stats.cached_prompt_tokens},
        "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def _message(item_id: str, text: str, status: str) -> dict:
    content = ([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
               if status != "in_progress" else [])
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _call(item_id: str, call: dict, status: str) -> dict:
    fn = call["function"]
    return {"id": item_id, "type": "function_call", "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"], "status": status}


class ResponsesReply:
    """Writes one request's reply as the Responses API does."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.body, self.model = body, model
        self.id, self.created = _id("resp"), int(time.time())
        self.sequence = 0
        self.output: list[dict] = []  # the items done so far (streaming)
        self._open: dict | None = None  # the item being streamed: {"item", "index", "text" | "call"}

    def rename(self, param: str | None) -> str | None:
        return rename(param)

    def response(self, status: str, output: list[dict], result: GenerationResult | None = None,
                  spec: dict | None = None) -> dict:
        body = self.body
        obj = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": None, "store": False, "truncation": "disabled",
            "text": body.text if body.text and body.text.get("format") else {"format": {"type": "text"}},
            "usage": _usage(result) if result is not None else None,
        }
        if spec is not None:
            obj["spec_decode"] = spec
        return obj

    # ---- the whole reply ------------------------------------------------------------------

    def whole(self, result: GenerationResult, spec: dict | None, logprobs: dict | None) -> dict:
        text = result.content if result.tool_calls or result.content is not None else result.text
        output = [_message(_id("msg"), text, "completed")] if text else []
        output += [_call(_id("fc"), call, "completed") for call in result.tool_calls]
        return self.response(_status(result.finish_reason), output, result, spec)

    # ---- the stream -----------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
        return f"event: {kind}\ndata: {payload}\n\n".encode()

    def open(self) -> list[bytes]:
        started = self.response("in_progress", [])
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]

    def delta(self, delta: dict, logprobs: dict | None) -> list[bytes]:
        frames: list[bytes] = []
        if delta.get("content"):
            if self._open is None or "text" not in self._open:
                frames += self._close_item()
                frames += self._open_message()
            self._open["text"] += delta["content"]
            frames.append(self._event("response.output_text.delta", item_id=self._open["item"]["id"],
                                      output_index=self._open["index"], content_index=0,
                                      delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls", []):
            if "id" in call:  # a new call opens
                frames += self._close_item()
                frames += self._open_call(call)
            arguments = call.get("function", {}).get("arguments", "")
            if arguments:
                self._open["call"]["function"]["arguments"] += arguments
                frames.append(self._event("response.function_call_arguments.delta",
                                          item_id=self._open["item"]["id"],
                                          output_index=self._open["index"], delta=arguments))
        return frames

    def close(self, result: GenerationResult, finish_reason: str, spec: dict | None,
              logprobs: dict | None) -> list[bytes]:
        frames = self._close_item()
        status = _status(finish_reason)
        final = self.response(status, self.output, result, spec)
        return [*frames, self._event("response.completed" if status == "completed" else "response.incomplete",
                                     response=final)]

    def error(self, body: dict) -> list[bytes]:
        err = body["error"]
        return [self._event("error", code=str(err.get("code")), message=err["message"],
                            param=err.get("param"))]

    def _open_message(self) -> list[bytes]:
        item = _message(_id("msg"), "", "in_progress")
        self._open = {"item": item, "index": len(self.output), "text": ""}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.output_item.added", output_index=self._open["index"], item=item),
                self._event("response.content_part.added", item_id=item["id"],
                            output_index=self._open["index"], content_index=0, part=part)]

    def _open_call(self, call: dict) -> list[bytes]:
        opened = {"id": call["id"], "function": {"name": call["function"]["name"], "arguments": ""}}
        item = _call(_id("fc"), opened, "in_progress")
        self._open = {"item": item, "index": len(self.output), "call": opened}
        return [self._event("response.output_item.added", output_index=self._open["index"], item=item)]

    def _close_item(self) -> list[bytes]:
        """Finish the item being streamed: its done events, and its place in `output`."""
        if self._open is None:
            return []
        item_id, index = self._open["item"]["id"], self._open["index"]
        if "text" in self._open:
            text = self._open["text"]
            done = _message(item_id, text, "completed")
            part = done["content"][0]
            frames = [self._event("response.output_text.done", item_id=item_id, output_index=index,
                                  content_index=0, text=text, logprobs=[]),
                      self._event("response.content_part.done", item_id=item_id, output_index=index,
                                  content_index=0, part=part)]
        else:
            call = self._open["call"]
            done = _call(item_id, call, "completed")
            frames = [self._event("response.function_call_arguments.done", item_id=item_id,
                                  output_index=index, name=call["function"]["name"],
                                  arguments=call["function"]["arguments"])]
        self.output.append(done)
        self._open = None
        return [*frames, self._event("response.output_item.done", output_index=index, item=done)]


def _status(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"
