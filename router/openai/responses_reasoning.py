"""The ``reasoning`` output item of a Responses API answer (``responses_api.py``),
whole and as stream events, from the think block a reasoning parser splits off
(``router/reasoning.py``).

Shape (OpenAI's ``ResponseReasoningItem``), first in ``output``, before the message::

    {"type": "reasoning", "id": "rs_...", "summary": [], "status": "completed",
     "content": [{"type": "reasoning_text", "text": "..."}]}

Streamed at ``output_index`` 0::

    response.output_item.added (content [])  response.content_part.added (reasoning_text "")
    response.reasoning_text.delta ...        response.reasoning_text.done
    response.content_part.done               response.output_item.done

The item closes when the first content (or call) arrives, or at the end of an
output that never left its think block. A stored conversation keeps only the
content as the assistant's message: the reasoning is not fed back, as Qwen3's
and DeepSeek-R1's templates drop it from earlier turns.
"""

from __future__ import annotations

from typing import Callable

from router.openai.responses_input import new_id


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    """The reasoning output item (its content empty while in progress)."""
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


class ReasoningEvents:
    """The stream events of the reasoning item; ``event(kind, **fields)`` writes one.

    :meth:`delta` and :meth:`close` return the events to send and mutate the state:
    ``none`` (nothing yet) -> ``open`` -> ``done``.
    """

    def __init__(self, event: Callable[..., str]) -> None:
        self._event = event
        self.item_id = new_id("rs")
        self.text = ""
        self.state = "none"

    @property
    def num_items(self) -> int:
        """Output items before the message: 1 once reasoning came, else 0."""
        return 0 if self.state == "none" else 1

    def delta(self, text: str) -> list[str]:
        if not text:
            return []
        assert self.state != "done", "reasoning after the content began"
        events = []
        if self.state == "none":
            self.state = "open"
            events.append(self._event("response.output_item.added", output_index=0,
                                      item=reasoning_item(self.item_id, "", "in_progress")))
            events.append(self._event("response.content_part.added", item_id=self.item_id, output_index=0,
                                      content_index=0, part={"type": "reasoning_text", "text": ""}))
        self.text += text
        events.append(self._event("response.reasoning_text.delta", item_id=self.item_id, output_index=0,
                                  content_index=0, delta=text))
        return events

    def close(self) -> list[str]:
        if self.state != "open":
            return []
        self.state = "done"
        item = reasoning_item(self.item_id, self.text)
        return [
            self._event("response.reasoning_text.done", item_id=self.item_id, output_index=0, content_index=0,
                        text=self.text),
            self._event("response.content_part.done", item_id=self.item_id, output_index=0, content_index=0,
                        part=item["content"][0]),
            self._event("response.output_item.done", output_index=0, item=item),
        ]
