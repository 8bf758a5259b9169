"""Where each assistant message lies in its conversation's rendering: the characters that train (docs/sft.md).

A template with `{% generation %}` blocks says it: the blocks are what trains, as in transformers. They are given
to the assistant messages they belong to by the turns' ends: a block belongs to the last assistant message whose
turn the rendering has reached where the block starts, so that every block of one answer (reasoning, answer, end of
turn) counts as that message's.

A template without blocks is read by markers. The conversation is rendered whole once as it is, and once per
assistant message with that message's content replaced by a marker that no text holds. Everything before the marker
is the rendering up to the content; the content starts there when the real rendering starts with the same text.
What follows the content up to the turn's end is the end-of-turn text the template writes after it (it trains, or
the model never learns to stop): the text that follows the marker alike whether the conversation ends there, asks
for the next answer (the generation prompt) or goes on, cut back so that it ends on no part of a special token.
Nothing depends on earlier renderings being prefixes of later ones: a template may write EOS once after the loop
(Phi-3), move the system prompt into the last user turn (Mistral v0.3), or start with the assistant.

Templates that write an answer's text by its content still get their spans. Where the marker takes another branch
than the content (a tool call with empty content, Qwen3's `<think>` reasoning), what follows the turn is still the
same text, so the turn's end is found; its start is the end of the generation prompt, the header of an assistant
turn, before the first text that differs. A template that does not write a marked content at all (Llama 3.1's
tool-call turns) is rendered up to the message, with and without the generation prompt, and the turn is what the
message adds, where those renderings are prefixes of the whole. A message none of these finds is an error.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jinja2

from titan.data.chat_template import ChatTemplate

METHOD = "turns by markers, v2"
"""How assistant tokens are found: part of a chat store's identity, so that stores made another way are not reused."""
MARKER = "TitanMarker"
"""Letters only, so that templates that trim, strip, split or JSON-encode a content keep it whole."""

Span = tuple[int, int]


class TurnNotFound(Exception):
    """An assistant message whose characters in the rendering no method finds."""


@dataclass(frozen=True)
class Turn:
    """One message's turn in the whole rendering, as a marker in its content shows it."""

    content_start: int | None
    """Where its content starts, when the rendering before it is the marked one's; None otherwise. Without a
    generation prompt, where the turn's own text before the content starts."""
    end: int
    """Where its turn ends: after its end-of-turn text."""
    header_end: int | None
    """Where the generation prompt (an assistant turn's header) last ends before the first text that differs from
    the marked rendering; None without a generation prompt or where it is not there."""


def common_prefix_length(*texts: str) -> int:
    common = os.path.commonprefix(list(texts))
    return len(common)


class TurnFinder:
    """Renders one conversation's variations with one template and finds its messages' turns."""

    def __init__(self, template: ChatTemplate, messages: list[dict[str, Any]], text: str,
                 ends_special_token: Callable[[str, int], int]) -> None:
        """`text` is `messages` rendered; `ends_special_token(text, end)` moves `end` back to the start of a
        special token that contains it, if one does."""
        self.template = template
        self.messages = messages
        self.text = text
        self.ends_special_token = ends_special_token
        self.marker = MARKER
        while self.marker in text or any(self.marker in str(message.get("content", "")) for message in messages):
            self.marker += "X"

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str | None:
        """The text of `messages`; None where the template refuses this variation (a template may refuse a
        conversation that ends with an answer, or an empty one)."""
        try:
            return self.template.render(messages, add_generation_prompt)[0]
        except jinja2.exceptions.TemplateError:
            return None

    def marked(self, index: int) -> Turn | None:
        """Message `index`'s turn, found by a marker in its content (module docstring); None where the marker is
        missing or what follows the turn is not the real rendering's."""
        messages = [*self.messages[:index], {**self.messages[index], "content": self.marker},
                    *self.messages[index + 1:]]
        renderings = [self.render(messages), self.render(messages[: index + 1]),
                      self.render(messages[: index + 1], add_generation_prompt=True)]
        if any(rendering is None or rendering.count(self.marker) != 1 for rendering in renderings):
            return None
        (before, after), (opened, ended), (_, prompted) = (rendering.split(self.marker) for rendering in renderings)
        tail = self.ends_special_token(after, common_prefix_length(after, ended, prompted))
        rest = after[tail:]
        end = len(self.text) - len(rest)
        if not self.text.endswith(rest) or end < 0:
            return None
        common = self.text[:common_prefix_length(self.text, before)]
        prompt = prompted[common_prefix_length(ended, prompted):]
        start = len(before) - (len(self.unprompted_opening(index, opened)) if not prompt else 0)
        content_start = start if len(common) == len(before) and start <= end else None
        header = common.rfind(prompt) if prompt else -1
        return Turn(content_start, end, header + len(prompt) if header >= 0 else None)

    def unprompted_opening(self, index: int, opened: str) -> str:
        """What a template without a generation prompt writes for assistant message `index` before its content
        (Mistral's space before the answer), which the model writes too: the end of `opened` (the rendering up to
        that content) past the rendering of the messages before it."""
        earlier = self.render(self.messages[:index])
        return "" if earlier is None else opened[common_prefix_length(opened, earlier):]

    def answer_span(self, index: int) -> Span | None:
        """Assistant message `index`'s characters by its marker: from its content (or, where the template writes
        text before it by the content, the end of the generation prompt) to its turn's end."""
        turn = self.marked(index)
        if turn is None:
            return None
        start = turn.content_start if turn.content_start is not None else turn.header_end
        return (start, turn.end) if start is not None and start <= turn.end else None

    def prefix_span(self, index: int) -> Span | None:
        """Assistant message `index`'s characters as what rendering up to it adds to rendering up to the message
        before it with the generation prompt, where both are prefixes of the whole rendering."""
        before = self.render(self.messages[:index], add_generation_prompt=True)
        ended = self.render(self.messages[: index + 1])
        prompted = self.render(self.messages[: index + 1], add_generation_prompt=True)
        if before is None or ended is None or prompted is None:
            return None
        end = self.ends_special_token(ended, common_prefix_length(ended, prompted))
        if not ended.startswith(before) or len(before) > end or not self.text.startswith(ended[:end]):
            return None
        return len(before), end

    def turn_end(self, index: int) -> int | None:
        """Where message `index`'s turn ends in the rendering."""
        turn = self.marked(index)
        if turn is not None:
            return turn.end
        span = self.prefix_span(index) if self.messages[index]["role"] == "assistant" else None
        return None if span is None else span[1]


def assistant_indices(messages: list[dict[str, Any]]) -> list[int]:
    return [index for index, message in enumerate(messages) if message["role"] == "assistant"]


def marked_spans(finder: TurnFinder) -> list[list[Span]]:
    """Each assistant message's characters in a template without generation blocks (module docstring). Raises
    TurnNotFound naming the first message no method finds."""
    spans = []
    for index in assistant_indices(finder.messages):
        span = finder.answer_span(index) or finder.prefix_span(index)
        if span is None:
            raise TurnNotFound(f"assistant message {index} (neither a marker in its content nor rendering the "
                               f"conversation up to it shows where it is)")
        spans.append([span])
    return spans


def block_spans(finder: TurnFinder, blocks: list[Span]) -> list[list[Span]]:
    """The generation `blocks` of the rendering grouped by the assistant message they belong to: those that start
    before the last assistant message's turn, and the rest. Only that one boundary decides a role (what every
    assistant message trains, and what the last one does). Raises TurnNotFound where no message between the last
    two assistant messages shows where its turn ends."""
    indices = assistant_indices(finder.messages)
    if len(indices) < 2 or not blocks:
        return [blocks]
    boundary = next((end for index in range(indices[-2], indices[-1])
                     if (end := finder.turn_end(index)) is not None), None)
    if boundary is None:
        raise TurnNotFound(f"where assistant message {indices[-2]}'s turn ends, before the last assistant "
                           f"message's generation blocks")
    return [[block for block in blocks if block[0] < boundary], [block for block in blocks if block[0] >= boundary]]
